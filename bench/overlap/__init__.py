"""Overlap with backward, ``python -m bench.overlap``: ``overlap_backward`` against off on an emulated
accelerator: the emulation, the multi-rank runs, the report.

The command is ``_main``; ``__main__`` runs it.
"""
