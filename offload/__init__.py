"""CPU-offloaded AdamW: fp32 master weights and moments in host memory, a chunked pipelined step,
per-stage timings, and a thread budget that never oversubscribes.

What a user needs: the optimizer, what you set (``OffloadSettings``) and what a step reports
(``StepStats``); the thread plan (``plan_cpu_threads``, ``ThreadPlan``, ``thread_limit``); the
tuner for a stock optimizer of CPU parameters (``tune_step_threads``, which returns a
``ThreadTunedOptimizer``, ``StepThreadsError``) and for DeepSpeed ZeRO-Offload's CPU Adam step
(``tune_deepspeed``, ``DeepSpeedTuningError``; deepspeed is imported only when it is called); and
``MasterParamLoadPlanner``, which loads a torch AdamW DCP checkpoint of a bf16/fp16 model (imported
on first use: ``torch.distributed.checkpoint`` is slow to import). The types of two values these
return are importable from here for annotations, outside ``__all__``: ``StageSpan`` (the items of
``StepStats.spans``) and ``DeepSpeedTuning`` (what ``tune_deepspeed`` returns).

The injection seams (the kernels, the CUDA device operations, NUMA binding, CPU topologies and
masks that tests and simulations hand in) are in :mod:`offload.testing`; ``offload.KernelSet`` and
the others that were here raise an ``AttributeError`` that says so.
"""

from __future__ import annotations

from typing import Any

from offload._optimizer import CPUOffloadAdamW
from offload._settings import OffloadSettings
from offload._stats import StageSpan, StepStats
from offload._stock import StepThreadsError, ThreadTunedOptimizer, tune_step_threads
from offload.tuning._deepspeed import DeepSpeedTuning, DeepSpeedTuningError, tune_deepspeed
from offload.threads._plan import ThreadPlan, plan_cpu_threads, thread_limit

__all__ = [
    "CPUOffloadAdamW",
    "DeepSpeedTuningError",
    "MasterParamLoadPlanner",
    "OffloadSettings",
    "StepStats",
    "StepThreadsError",
    "ThreadPlan",
    "ThreadTunedOptimizer",
    "plan_cpu_threads",
    "thread_limit",
    "tune_deepspeed",
    "tune_step_threads",
]

#: Names this package exported until the injection seams moved to ``offload.testing``.
_MOVED_TO_TESTING = frozenset({"CgroupCpuLimit", "CpuTopology", "CudaRuntime", "DeviceOps", "ExtensionLoader",
                               "KernelLoader", "KernelSet", "NumaBinding", "RankCpus", "TorchCudaOps"})


def __getattr__(name: str) -> Any:
    if name == "MasterParamLoadPlanner":
        from offload.state._dcp import MasterParamLoadPlanner

        return MasterParamLoadPlanner
    if name in _MOVED_TO_TESTING:
        raise AttributeError(f"offload.{name} moved to offload.testing.{name} (an injection seam for tests and "
                             f"for integrators who fake hardware): from offload.testing import {name}")
    raise AttributeError(f"module 'offload' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
