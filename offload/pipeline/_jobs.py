"""The pipeline's records: a job (:class:`ChunkJob`, the :class:`~offload.state._items.Item` records it
updates), what running it learned (:class:`JobProgress`), its kernel calls (:class:`KernelCalls`),
what a stage took (:class:`StageRecord`) and what a step's drain hands back (:class:`DrainResult`).

A job is a description, frozen once made (by ``step()``'s jobs, ``offload.pipeline._step``, or the
launcher of a chunk started during backward): which chunk, items, hyper-parameters, threads,
stages and events. What the worker and the transport learn while they run it (the d2h in
flight, the gradient operands, the kernel calls, whether the kernel ran and the weights were
written) goes into its one :class:`JobProgress`, which only they write; the optimizer reads it
once the job is done. Items stay mutable on purpose: the optimizer reuses a chunk's item list
from step to step and only puts in each step's gradients (``HostLayout.items``,
``offload.state._items``). All are plain slotted records because the worker reads their fields
once per chunk while the memory bus waits (see :mod:`offload.pipeline._pipeline`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from torch import Tensor

from offload.kernels._adamw import Hyper
from offload.state._items import Item, ItemKind

__all__ = [
    "Call",
    "CallSteps",
    "ChunkJob",
    "DrainResult",
    "JobProgress",
    "KernelCalls",
    "StageRecord",
]


@dataclass(slots=True)
class StageRecord:
    """One stage of one chunk, in ``time.perf_counter`` seconds; GPU parts may be pending."""

    chunk: int
    """The chunk's index."""
    stage: str
    """``"d2h"``, ``"adam_kernel"`` or ``"materialize"``."""
    start: float
    """When the stage began (host clock)."""
    end: float
    """When it ended (host clock; moved later by GPU time in :meth:`finalize`)."""
    busy_s: float
    """Time the stage kept its resource busy."""
    pending: tuple[Any, Any, Callable[[], None]] | None = None
    """(start_event, end_event, a call that waits for end_event on the host, bounded) of GPU work
    whose time is added when the stats are read."""

    def finalize(self) -> None:
        if self.pending is None:
            return
        start_ev, end_ev, wait_end = self.pending
        wait_end()
        gpu_s = start_ev.elapsed_time(end_ev) / 1e3
        self.busy_s += gpu_s
        self.end = max(self.end, self.start + self.busy_s)
        self.pending = None


Call = tuple[ItemKind, Any, tuple[list[Tensor], ...]]
"""(kind, kernel function, positional tensor lists) of one kernel call; the worker adds the steps
to increment and the hyper-parameters."""
CallSteps = tuple[list[int], list[Tensor]]
"""The slots and step tensors of one call's items, in order."""


class KernelCalls(NamedTuple):
    """A job's kernel calls, as :class:`offload.pipeline._calls.CallBuilder` made them (the only
    maker of kernel calls). Immutable; a named tuple, not a frozen dataclass, because one is made
    per job on the submitting thread (0.2 us against 0.6 us, torch 2.13 CPU VM)."""

    calls: list[Call]
    """One call per kind of item the job holds (usually one)."""
    steps: list[CallSteps]
    """Per call: the slots and step tensors of its items."""


@dataclass(slots=True)
class JobProgress:
    """What the worker and the transport learn while they run one :class:`ChunkJob`: written only
    by them (the worker's stages, :func:`offload.pipeline._worker.write_weights` where the caller
    writes a committed chunk's weights, and the transport's methods; a host job's calls are made
    by the transport at submit, before the worker sees the job), read by the optimizer once the
    job is done (``done``, or the drain)."""

    calls: KernelCalls | None = None
    """The job's kernel calls, once made (at submit by ``Transport.prepare``, else by the worker
    after d2h); dropped after the kernel ran."""
    transfer: Any = None
    """The transport's state of an issued d2h (None: not issued yet)."""
    grads: list[Tensor] | None = None
    """Per item: the gradient operand its kernel reads (low precision for KIND_MP, fp32 else)."""
    coef_in_grads: bool = False
    """The transport multiplied the torch kernel's gradient operands by ``hyper.grad_coef``
    already (a low-precision gradient is rounded to its dtype first, as torch's ``_foreach_mul_``
    does): its calls run without the coefficient (see :func:`offload.pipeline._operands.torch_grads`)."""
    direct: bool = False
    """Host: every item's kernel reads its gradient where it is and writes its parameter itself
    (no upcast, no materialize copy); set by :meth:`HostTransport.finish_d2h`."""
    speculate: dict[ItemKind, Tensor] | None = None
    """Early launch: per item kind, where the gradient checksums of what the chunk consumed go (what
    ``ChunkJob.before_kernel`` returned): a native kernel's call is given them and fills them in
    its own pass (``offload.kernels._outputs.speculation_outputs`` says what they receive); for
    torch's kernel on CUDA (``KIND_TORCH``) the transport fills them from the staged copies in
    ``finish_d2h`` and removes the entry, so torch's kernel is never given ``checksums=``."""
    staging: Any = None
    """CUDA: the h2d ring slot the kernel wrote the new weights into (see CudaTransport)."""
    kernel_started: bool = False
    """The worker began the job's kernel calls: from here on a failure may leave the job's items
    part-written (``offload.pipeline._step.part_stepped``)."""
    kernel_ran: bool = False
    """The job's kernel calls ran (read by the optimizer for early launches)."""
    writing: bool = False
    """Its weights are being written, or were (materialize began)."""
    materialized: bool = False
    """Its weights were written (materialize ran)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkJob:
    """One chunk's work for one step: some of d2h, adam_kernel and materialize. A description,
    never changed once made; what running it learns goes into its :attr:`progress`."""

    chunk: int
    """The chunk's index in the layout."""
    items: list[Item]
    """Its views (possibly the optimizer's reused list for the chunk)."""
    hyper: Hyper
    """The hyper-parameters of the chunk's param group."""
    threads: int
    """Intra-op threads the worker runs the job's CPU work with (an early job not started when
    ``step()`` begins runs with the step's: ``Pipeline.set_threads``)."""
    update: bool
    """Run d2h and adam_kernel."""
    materialize: bool
    """Write the new weights into the parameters."""
    ready_event: Any = None
    """CUDA: event after which the gradients are final (d2h waits on it)."""
    write_event: Any = None
    """CUDA: event after which the parameters may be overwritten (h2d waits on it)."""
    into_next: bool = False
    """The update goes out of place: from the committed slabs into their second generation,
    which ``step()`` then commits by a swap (chunks started during backward, and every other
    chunk of their param groups in that step; ``offload.state._slabs``)."""
    done: Any = None
    """Early launch: a ``threading.Event`` the worker sets once it processed (or skipped) the job,
    so ``step()`` can judge an early chunk as soon as its kernel ran."""
    before_kernel: Callable[[ChunkJob], dict[ItemKind, Tensor]] | None = None
    """Early launch: called by the worker with the job right before its kernel (the speculation's
    gradient checksums, ``offload.overlap._speculation``); returns where the checksums of what
    the kernel consumes go (:attr:`JobProgress.speculate`)."""
    progress: JobProgress = field(default_factory=JobProgress, compare=False, repr=False)
    """What the worker and the transport learned running it (written only by them)."""


@dataclass(slots=True)
class DrainResult:
    """What :meth:`Pipeline.drain` hands back for the jobs since the previous drain."""

    records: list[StageRecord]
    """Every stage of every job, in the order they ran."""
    error: BaseException | None
    """The first error of the step (later jobs were skipped)."""
    last_h2d_event: Any
    """CUDA: the event of the step's last host-to-device copy (not waited for), else None."""
    wait_s: float = 0.0
    """How long ``drain`` waited."""
    pinned_bytes: int = 0
    """CUDA: page-locked host bytes the transport holds at the step's end."""
    pinned_registrations: int = 0
    """CUDA: pinned blocks registered since the previous drain (0 once a layout's first step ran)."""
