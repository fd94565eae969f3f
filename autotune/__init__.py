"""Online autotuning of a training step's performance knobs.

Generic: this package knows named discrete knobs, step-time samples and process groups; it knows
nothing of AdamW or offloading (``offload`` wires it in). ``Agreement`` is the protocol of the
collectives an ``OnlineTuner(group=)`` (and ``offload.plan_cpu_threads(agreement=)``) takes;
``make_agreement(group, timeout_s=)`` is the one an ``OnlineTuner`` builds for a group (``None``:
this node's ranks), for a caller that shares it with other collectives (``offload`` does).
The injection seam of the collectives, ``InProcessAgreement`` (ranks that are threads of one
process), is in :mod:`autotune.testing`; ``autotune.InProcessAgreement`` raises an
``AttributeError`` that says so.
"""

from __future__ import annotations

from typing import Any

from autotune.agree._agree import Agreement, AgreementError, AgreementMismatch, AgreementTimeout, make_agreement
from autotune.cache._cache import TuningCache
from autotune.cache._fingerprint import Fingerprint, fingerprint
from autotune.measure._measurement import Measurement
from autotune.measure._space import Knob, SearchSpace, geometric_ladder, powers_of_two
from autotune.report._trace import TraceWriter
from autotune._config import AutotuneConfig, StepSample
from autotune.tuner._tuner import OnlineTuner
from autotune.tuner._session import TuningSession, cache_for, trace_for

__all__ = [
    "Agreement",
    "AgreementError",
    "AgreementMismatch",
    "AgreementTimeout",
    "AutotuneConfig",
    "Fingerprint",
    "Knob",
    "Measurement",
    "OnlineTuner",
    "SearchSpace",
    "StepSample",
    "TraceWriter",
    "TuningCache",
    "TuningSession",
    "cache_for",
    "fingerprint",
    "geometric_ladder",
    "make_agreement",
    "powers_of_two",
    "trace_for",
]


def __getattr__(name: str) -> Any:
    if name == "InProcessAgreement":
        raise AttributeError("autotune.InProcessAgreement moved to autotune.testing.InProcessAgreement (an injection "
                             "seam for tests and simulations): from autotune.testing import InProcessAgreement")
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")
