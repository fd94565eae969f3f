"""Online autotuning of a training step's performance knobs.

Generic: this package knows named discrete knobs, step-time samples and process groups; it knows
nothing of AdamW or offloading (``offload`` wires it in). ``Agreement`` is the protocol of the
collectives an ``OnlineTuner(group=)`` (and ``offload.plan_cpu_threads(agreement=)``) takes;
``InProcessAgreement`` implements it for ranks that are threads of one process;
``make_agreement(group, timeout_s=)`` is the one an ``OnlineTuner`` builds for a group (``None``:
this node's ranks), for a caller that shares it with other collectives (``offload`` does).
"""

from __future__ import annotations

from autotune._agree import Agreement, AgreementError, AgreementMismatch, AgreementTimeout, make_agreement
from autotune._cache import TuningCache
from autotune._fingerprint import Fingerprint, fingerprint
from autotune._inprocess import InProcessAgreement
from autotune._measurement import Measurement
from autotune._space import Knob, SearchSpace, geometric_ladder, powers_of_two
from autotune._trace import TraceWriter
from autotune._config import AutotuneConfig, StepSample
from autotune._tuner import OnlineTuner
from autotune._session import TuningSession, cache_for, trace_for

__all__ = [
    "Agreement",
    "AgreementError",
    "AgreementMismatch",
    "AgreementTimeout",
    "AutotuneConfig",
    "Fingerprint",
    "InProcessAgreement",
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
