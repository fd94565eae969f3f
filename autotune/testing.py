"""Injection seams: what tests and simulations hand ``autotune`` in place of a real process group.

Nothing here is needed to tune a run. :class:`InProcessAgreement` is an ``Agreement`` whose ranks
are threads of one process (``InProcessAgreement.group(n)``), with gloo's semantics, for
``OnlineTuner(group=)``, ``TuningSession(group=)`` and ``offload.plan_cpu_threads(agreement=)``:
several tuners agree in one process as the local ranks of a node would (``bench.simulate``, the
tests). The other seams (a clock, a cache, a trace writer, a fingerprint) are parameters of the
public classes; ``offload.testing`` holds the optimizer's. Importing this module has no side effects.
"""

from __future__ import annotations

from autotune.agree._inprocess import InProcessAgreement

__all__ = ["InProcessAgreement"]
