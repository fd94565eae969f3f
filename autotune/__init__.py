"""Online autotuning of a training step's performance knobs.

Generic: this package knows named discrete knobs, step-time samples and process groups; it knows
nothing of AdamW or offloading (``offload`` wires it in).
"""

from __future__ import annotations

from autotune._agree import AgreementError, AgreementMismatch, AgreementTimeout
from autotune._cache import TuningCache
from autotune._fingerprint import Fingerprint, fingerprint
from autotune._inprocess import InProcessAgreement
from autotune._measurement import Measurement
from autotune._space import Knob, SearchSpace, geometric_ladder, powers_of_two
from autotune._trace import TraceWriter
from autotune._config import AutotuneConfig, StepSample
from autotune._tuner import OnlineTuner

__all__ = [
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
    "fingerprint",
    "geometric_ladder",
    "powers_of_two",
]
