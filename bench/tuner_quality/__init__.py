"""Tuner quality, ``python -m bench.tuner_quality``: the online tuner's choice against an exhaustive interleaved
sweep: measuring, statistics, rendering.

The command is ``_main``; ``__main__`` runs it.
"""
