"""CPU-offloaded AdamW: fp32 master weights and moments in host memory, a chunked pipelined step,
per-stage timings, and a thread budget that never oversubscribes."""

from __future__ import annotations

from offload._optimizer import CPUOffloadAdamW
from offload._settings import OffloadSettings, StageSpan, StepStats
from offload._stock import StepThreadsError, ThreadTunedOptimizer, tune_step_threads
from offload._threads import ThreadPlan, plan_cpu_threads, thread_limit

__all__ = [
    "CPUOffloadAdamW",
    "OffloadSettings",
    "StageSpan",
    "StepStats",
    "StepThreadsError",
    "ThreadPlan",
    "ThreadTunedOptimizer",
    "plan_cpu_threads",
    "thread_limit",
    "tune_step_threads",
]
