"""The GPU checks of ``bench/device_check.sh``, ``python -m bench.device_checks``: the checks, the gradient
layouts, the disturbances, the runner and the fake device of the CPU dry run.

The command is ``_main``; ``__main__`` runs it.
"""
