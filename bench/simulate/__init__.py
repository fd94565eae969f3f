"""Simulated large nodes, ``python -m bench.simulate``: the real tuner against a step-time model: sessions, nodes,
contention, the oracle bound and the report.

The command is ``_main``; ``__main__`` runs it.
"""
