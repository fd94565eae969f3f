"""Injection seams: what tests, simulations and integrators hand ``offload`` in place of hardware.

Nothing here is needed to train. These are the types the optimizer's and the thread plan's
injection points take (docs/architecture.md, "Injection points"), for a test that fakes a GPU, a
machine's topology or a native build, and for an integrator who wraps the real ones:

- :class:`KernelSet` (built over a :class:`KernelLoader`, or any :class:`ExtensionLoader`): the
  kernels ``CPUOffloadAdamW(kernels=)`` calls (spies, injected failures, a missing build);
- :class:`DeviceOps`: the CUDA transport's streams, events, copies and pinned blocks that
  ``CPUOffloadAdamW(device_ops=)`` takes; :class:`TorchCudaOps` are the real ones, to wrap, and
  :class:`CudaRuntime` the runtime calls of their pinned blocks (``TorchCudaOps(runtime=)``);
- :class:`NumaBinding`: what a ``CPUOffloadAdamW(numa_binder=)`` callable returns;
- :class:`CpuTopology`, :class:`RankCpus` and :class:`CgroupCpuLimit`: a machine, a rank's mask
  and a cgroup quota for ``plan_cpu_threads(topology=, masks=)``.

``autotune.testing.InProcessAgreement`` is the seam of the collectives (ranks that are threads of
one process). Importing this module has no side effects: it names classes that ``import offload``
has already loaded.
"""

from __future__ import annotations

from offload.kernels._adamw import KernelSet
from offload.kernels._build import ExtensionLoader, KernelLoader
from offload.pipeline._cuda_runtime import CudaRuntime
from offload.pipeline._cuda_transport import DeviceOps, TorchCudaOps
from offload.threads._numa import NumaBinding
from offload.threads._rule import RankCpus
from offload.threads._topology import CgroupCpuLimit, CpuTopology

__all__ = [
    "CgroupCpuLimit",
    "CpuTopology",
    "CudaRuntime",
    "DeviceOps",
    "ExtensionLoader",
    "KernelLoader",
    "KernelSet",
    "NumaBinding",
    "RankCpus",
    "TorchCudaOps",
]
