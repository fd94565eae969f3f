"""The offloaded step's speed knobs (:class:`OffloadSettings`, frozen, hashable), the kernels it
can run, and every environment variable ``offload`` reads (one accessor each, read when called,
never at import). What a step reports is ``offload._stats``'s.

The variables are parsed with ``autotune.knobs``' parsers, so a malformed value is a
``KnobError`` worded as autotune's own; the launcher's (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``),
which the tuner reads too, are ``autotune.knobs``' accessors, re-exported here so that
``threads/`` and ``kernels/`` take their environment from this module alone. The list is
documented in ``docs/environment.md``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from autotune import knobs
from autotune.knobs import KnobError, local_rank, local_world_size

__all__ = [
    "DEFAULT_CHUNK_NUMEL", "KERNELS", "MAX_RING_SLOTS", "MAX_THREADS", "MIN_CHUNK_NUMEL", "THREADS_VAR",
    "TORCH_EXTENSIONS_VAR", "Kernel", "KnobError", "OffloadSettings", "extensions_dir", "local_rank",
    "local_world_size", "omp_num_threads", "threads_override", "torch_extensions_dir",
]

#: Most intra-op threads one rank may ask for, from any source (argument, settings, environment).
#: Far above the cores of any single machine's rank; a count beyond it is a typo, and reached
#: ``torch.set_num_threads`` unchecked it crashed the process (100000: libgomp cannot create the
#: threads and the process dies with SIGSEGV). Counts between the rank's CPUs and this are
#: clamped with a warning by ``offload.plan_cpu_threads``.
MAX_THREADS = 1024

#: Default pipeline chunk: 4 Mi elements (16 MiB of fp32 per slab) keeps several chunks in flight
#: for a 100M-parameter model while each kernel call is long enough to reach memory bandwidth.
DEFAULT_CHUNK_NUMEL = 4 << 20
#: Smallest accepted chunk; smaller chunks are dominated by per-call overhead.
MIN_CHUNK_NUMEL = 1 << 10

Kernel = Literal["torch", "fused-mp", "auto"]
#: The kernels a step can run, in the order the tuner lists them (``OffloadSettings.kernel`` also
#: accepts "auto", which resolves to one of them).
KERNELS: tuple[Kernel, ...] = ("torch", "fused-mp")
#: Deepest CUDA staging ring accepted (``OffloadSettings.ring_slots``). Each slot is one pinned
#: block per direction as large as the largest chunk's staging (2 x 8 MiB for 4 Mi bf16 elements),
#: and the worker issues ``slots - 1`` chunks' gradient copies ahead of the kernel; past a few
#: slots the copies only run further ahead of a kernel they cannot outpace, while the pinned
#: memory keeps growing (the reference system uses 4).
MAX_RING_SLOTS = 8


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadSettings:
    """Knobs of the offloaded step that change speed, never the math.

    Change them between steps with ``CPUOffloadAdamW.apply_settings``.
    """

    threads: int | None = None
    """Intra-op threads for the CPU kernel; None means "use this rank's ThreadPlan"."""
    chunk_numel: int = DEFAULT_CHUNK_NUMEL
    """Target elements per pipeline chunk (chunks never cross a param-group boundary)."""
    kernel: Kernel = "auto"
    """CPU AdamW implementation. "torch": torch's fused CPU AdamW on fp32 (bf16/fp16 parameters:
    upcast the gradient, update the fp32 master, downcast it into the parameter: three passes).
    "fused-mp": the single-pass native kernel (``offload.kernels._fused_mp``): bf16/fp16 parameters
    read their gradient and are written in the same pass as their fp32 master; fp32 parameters
    get the same arithmetic in one parallel region per chunk. "auto" (default): "fused-mp" where
    it is bitwise equal to "torch" on this torch build and CPU (``bitwise_matches_torch``) and it
    builds, else "torch". Where the kernel cannot be built the optimizer logs why once and runs
    "torch" (``CPUOffloadAdamW.settings`` says which kernel is in force, never "auto")."""
    speculate: bool = True
    """With ``CPUOffloadAdamW(overlap_backward=True)``: start chunks during backward (False: every
    chunk runs in ``step()``, the hooks stay). Exact either way (a speculation is validated before
    it commits), so the tuner may switch it: on a machine where backward needs the same cores it
    locks in False. No effect without ``overlap_backward``."""
    backward_threads: int | None = None
    """With ``CPUOffloadAdamW(overlap_backward=True)``: intra-op threads of the chunks started
    during backward (None: ``threads``, as for every other chunk). The chunks ``step()`` runs, and
    the early ones still queued when it starts, keep ``threads``: during backward the trainer's
    thread launches work and busy cores slow it (fewer cores at their top clock, a shared memory
    bus; DeepSpeed Reflow's point), while in ``step()`` it only waits. Never above ``threads``
    (a larger value is clamped to it). Exact whatever the value (the kernels are bitwise
    independent of the thread count), so the tuner may choose it. No effect without overlap."""
    ring_slots: int | None = None
    """On CUDA (parameters on a CUDA device, or ``CPUOffloadAdamW(device_ops=)``): pinned
    chunk-sized slots per direction of the staging rings (None: 2, double buffering); the worker
    issues the gradient copies of ``ring_slots - 1`` chunks ahead of the current kernel, so
    copies ride out a kernel that is sometimes slower, at one more pinned block per direction
    per slot. From 2 to :data:`MAX_RING_SLOTS`. A change between steps re-makes the rings on the
    worker at the next step (as a chunk-size change does). Exact whatever the value (the same
    bytes reach the kernel), so the tuner may choose it. Ignored by the host transport (CPU
    parameters without ``device_ops``: no ring)."""
    bind_numa: bool | None = None
    """Bind this process to the NUMA node of its GPU (of most of its affinity mask on a CPU-only
    machine) so the host state's pages sit on the node whose cores compute on them
    (``offload.state._placement``; what it did: ``CPUOffloadAdamW.numa_placement``; ``close()``
    restores the affinity). True at construction: bind before the host slabs are allocated, and
    first-touch them from the optimizer's worker thread with its intra-op threads. Switched on by
    ``apply_settings``: bind, and move the slabs' pages to the node in place (``mbind``: the same
    addresses and bits, no second copy); switched off: the affinity is restored and the pages stay
    where they are. A logged no-op on one node; a failed page move a logged warning, never an error.
    None (default): off, and the tuner may probe it (the ``bind_numa`` knob, only where the local
    ranks' masks span several NUMA nodes); True or False: the user's choice, kept by the tuner.
    Exact whatever the value (the same kernels on the same bits)."""

    def __post_init__(self) -> None:
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int)
            or not 1 <= self.threads <= MAX_THREADS
        ):
            raise ValueError(f"OffloadSettings.threads={self.threads!r}: expected None or an int from 1 to {MAX_THREADS}")
        if self.backward_threads is not None and (
            isinstance(self.backward_threads, bool) or not isinstance(self.backward_threads, int)
            or not 1 <= self.backward_threads <= MAX_THREADS
        ):
            raise ValueError(f"OffloadSettings.backward_threads={self.backward_threads!r}: expected None or an int "
                             f"from 1 to {MAX_THREADS}")
        if self.ring_slots is not None and (
            isinstance(self.ring_slots, bool) or not isinstance(self.ring_slots, int)
            or not 2 <= self.ring_slots <= MAX_RING_SLOTS
        ):
            raise ValueError(f"OffloadSettings.ring_slots={self.ring_slots!r}: expected None or an int from 2 to "
                             f"{MAX_RING_SLOTS}")
        if (
            isinstance(self.chunk_numel, bool)
            or not isinstance(self.chunk_numel, int)
            or self.chunk_numel < MIN_CHUNK_NUMEL
        ):
            raise ValueError(
                f"OffloadSettings.chunk_numel={self.chunk_numel!r}: expected an int >= {MIN_CHUNK_NUMEL}"
            )
        if not isinstance(self.speculate, bool):
            raise ValueError(f"OffloadSettings.speculate={self.speculate!r}: expected a bool")
        if self.bind_numa is not None and not isinstance(self.bind_numa, bool):
            raise ValueError(f"OffloadSettings.bind_numa={self.bind_numa!r}: expected None or a bool")
        if not isinstance(self.kernel, str) or self.kernel not in (*KERNELS, "auto"):
            raise ValueError(
                f"OffloadSettings.kernel={self.kernel!r}: expected one of {KERNELS} or 'auto'"
            )


# ------------------------------------------------------------------------------ the environment

#: Forces the intra-op thread count of every rank; wins over the ThreadPlan and the tuner's
#: thread knob.
THREADS_VAR = "OFFLOAD_AUTOTUNE_THREADS"
#: torch's own variable for where C++ extensions are built; the fused-mp kernel follows it.
TORCH_EXTENSIONS_VAR = "TORCH_EXTENSIONS_DIR"


def threads_override() -> int | None:
    """``OFFLOAD_AUTOTUNE_THREADS``: explicit intra-op thread count for this rank, or None.

    An integer from 1 to :data:`MAX_THREADS`; ``plan_cpu_threads`` clamps it to the rank's CPUs.
    """
    return knobs.read_int(THREADS_VAR, minimum=1, maximum=MAX_THREADS)


def omp_num_threads() -> int | None:
    """``OMP_NUM_THREADS`` (torchrun sets 1); only reported, never obeyed over an explicit plan."""
    return knobs.read_int("OMP_NUM_THREADS", minimum=1)


def omp_wait_policy() -> str | None:
    """``OMP_WAIT_POLICY`` as set (OpenMP reads it at start; this project only reads it to say
    whether the spin-wait notice of ``tune_step_threads`` applies), or None if unset."""
    return os.environ.get("OMP_WAIT_POLICY")


def torch_extensions_dir() -> Path | None:
    """``TORCH_EXTENSIONS_DIR`` (torch's convention for C++ extension builds), or None if unset."""
    return knobs.read_path(TORCH_EXTENSIONS_VAR)


def extensions_dir() -> Path:
    """Where native kernels are built: ``TORCH_EXTENSIONS_DIR``, else ``$XDG_CACHE_HOME`` (or
    ``~/.cache``)/offload-autotune/ext (``autotune.knobs.cache_home``).

    Independent of ``OFFLOAD_AUTOTUNE_CACHE`` on purpose: a cache path of ``/dev/null`` or
    ``c.json`` once put the build in ``/dev/ext/`` or a silent rebuild in ``./ext/``.
    """
    return torch_extensions_dir() or knobs.cache_home() / "ext"
