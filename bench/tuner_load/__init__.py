"""The tuner on a loaded host, ``python -m bench.tuner_load``: real tuners under a controlled background load
(``_load``), scored against every candidate right after lock-in.

The command is ``_main``; ``__main__`` runs it.
"""
