"""CPU-offloaded AdamW: fp32 master weights and moments in host memory, a chunked pipelined step,
per-stage timings, and a thread budget that never oversubscribes.

Besides the optimizer, the thread plan, the stock-optimizer wrapper and ``tune_deepspeed`` (DeepSpeed
ZeRO-Offload's CPU Adam step; deepspeed is imported only when it is called), the package exports the
types its injection points take (docs/architecture.md, "Injection points"): ``KernelSet`` (with
its ``KernelLoader`` / ``ExtensionLoader``) for ``CPUOffloadAdamW(kernels=)``, ``NumaBinding``
(what a ``numa_binder=`` returns), ``DeviceOps`` (what ``CPUOffloadAdamW(device_ops=)`` takes:
the CUDA transport's streams, events, copies and pinned blocks; ``TorchCudaOps`` are the real
ones, to wrap, and ``CudaRuntime`` the runtime calls of their pinned blocks, ``TorchCudaOps(runtime=)``), and ``CpuTopology``,
``RankCpus`` and ``CgroupCpuLimit`` for ``plan_cpu_threads(topology=, masks=)``. ``MasterParamLoadPlanner`` loads a torch AdamW DCP
checkpoint of a bf16/fp16 model (imported on first use: ``torch.distributed.checkpoint`` is slow
to import).
"""

from __future__ import annotations

from typing import Any

from offload._optimizer import CPUOffloadAdamW
from offload.kernels._build import ExtensionLoader, KernelLoader
from offload.kernels._adamw import KernelSet
from offload.pipeline._cuda_runtime import CudaRuntime
from offload.pipeline._cuda_transport import DeviceOps, TorchCudaOps
from offload.threads._numa import NumaBinding
from offload._settings import OffloadSettings
from offload._stats import StageSpan, StepStats
from offload._stock import StepThreadsError, ThreadTunedOptimizer, tune_step_threads
from offload.tuning._deepspeed import DeepSpeedTuning, DeepSpeedTuningError, tune_deepspeed
from offload.threads._rule import RankCpus
from offload.threads._plan import ThreadPlan, plan_cpu_threads, thread_limit
from offload.threads._topology import CgroupCpuLimit, CpuTopology

__all__ = [
    "CPUOffloadAdamW",
    "CgroupCpuLimit",
    "CpuTopology",
    "CudaRuntime",
    "DeepSpeedTuning",
    "DeepSpeedTuningError",
    "DeviceOps",
    "ExtensionLoader",
    "KernelLoader",
    "KernelSet",
    "MasterParamLoadPlanner",
    "NumaBinding",
    "OffloadSettings",
    "RankCpus",
    "StageSpan",
    "StepStats",
    "StepThreadsError",
    "ThreadPlan",
    "ThreadTunedOptimizer",
    "TorchCudaOps",
    "plan_cpu_threads",
    "thread_limit",
    "tune_deepspeed",
    "tune_step_threads",
]


def __getattr__(name: str) -> Any:
    if name == "MasterParamLoadPlanner":
        from offload.state._dcp import MasterParamLoadPlanner

        return MasterParamLoadPlanner
    raise AttributeError(f"module 'offload' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
