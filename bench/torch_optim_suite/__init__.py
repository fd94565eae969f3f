"""PyTorch's own optimizer tests against CPUOffloadAdamW, ``python -m bench.torch_optim_suite``: the
runner, the filter of the cases and the pytest plugin that swaps the optimizer in.

The command is ``_main``; ``__main__`` runs it.
"""
