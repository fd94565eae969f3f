"""The contract between the pipeline's worker and a transport (host or CUDA).

A transport moves a job's gradients to where the kernel reads them (``issue_d2h`` /
``finish_d2h``), says where the kernel writes its outputs (``lowp_out`` / ``f32_out``) and moves
the new weights into the parameters (``materialize``). Every transport implements every member
(the host transport with trivial ones), so the worker never probes for one.

A job (``ChunkJob``) is a description the transport only reads; what it learns running it (the
d2h in flight, the gradient operands, the ring slot of the new weights, the calls it had made at
submit) it writes into the job's ``JobProgress``, which only it and the worker write. It never
makes kernel calls itself: ``prepare`` asks the pipeline's ``CallBuilder`` for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from offload.pipeline._calls import CallBuilder
from offload.pipeline._jobs import ChunkJob, StageRecord
from offload.state._items import Item
from offload.state._slabs import Chunk, HostSlabs

__all__ = ["Transport"]


class Transport(Protocol):
    """What the worker (``offload.pipeline._worker.Worker``) calls, in this order per job."""

    device: torch.device | None
    """The CUDA device the worker thread binds to; None for parameters on the CPU."""
    lookahead: int
    """Jobs whose d2h the worker issues ahead of the current job's kernel (0: none); read per
    job, so a change between steps (:meth:`resize_rings`) holds from the next step on."""
    caller_writes: bool
    """The weights of a committed early chunk may be written by the thread that calls ``step()``
    (``Pipeline.write_committed``) while the worker still runs later chunks' kernels: the host
    transport's copies touch nothing the worker's jobs of other chunks use."""
    host_weights: bool
    """The parameters are host tensors the kernels may read: a low-precision parameter's master is
    compared with its live weight in the kernel's pass (an edit through ``.data``,
    ``offload.state._items.follows_weights``). False on CUDA: the weights are on the device."""

    def ready_event(self) -> Any:
        """On the thread that calls ``step()`` or runs a backward hook: an event recorded on its
        current device stream, after which the gradients (and every use of the weights) queued so
        far are final; a job's d2h copies wait for it (``ChunkJob.ready_event``), and so do its
        weight copies (``write_event``). None where nothing runs asynchronously (the host)."""
        ...

    def prepare(self, job: ChunkJob, calls: CallBuilder) -> None:
        """On the submitting thread: optionally the job's kernel calls ahead, from ``calls``, into
        ``job.progress.calls`` (one write, last: a raise leaves the job as it was)."""
        ...

    def issue_d2h(self, job: ChunkJob) -> None:
        """Start moving the job's gradients (sets ``job.progress.transfer``)."""
        ...

    def finish_d2h(self, job: ChunkJob, slabs: HostSlabs, records: list[StageRecord]) -> None:
        """Wait for them; set ``job.progress.grads`` unless its calls were made at submit."""
        ...

    def lowp_out(self, job: ChunkJob, item: Item) -> Tensor:
        """Where a KIND_MP item's kernel writes the low-precision weight."""
        ...

    def f32_out(self, job: ChunkJob, item: Item) -> Tensor | None:
        """Where a KIND_F32 item's kernel also writes its new weight; None: in place only."""
        ...

    def materialize(self, job: ChunkJob, slabs: HostSlabs, records: list[StageRecord]) -> None:
        """Move the job's new weights into the parameters."""
        ...

    def flush(self) -> Any:
        """End of a step (the drain barrier): the last h2d event or None; waits for nothing."""
        ...

    def settle(self) -> None:
        """After :meth:`flush`, at the same barrier: wait for copies still in flight and size the
        buffers for the next step; may raise (a bounded device wait that timed out)."""
        ...

    def order_caller(self, event: Any) -> None:
        """On the thread that drained: what it queues next on the device runs after ``event``
        (:meth:`flush`'s last h2d event, not None), whether or not the step then raises."""
        ...

    def forget(self) -> None:
        """Drop what was cached for the old chunk layout (between steps)."""
        ...

    def resize_rings(self, slots: int) -> None:
        """Between steps: ``slots`` staging slots per direction from the next step on, and
        :attr:`lookahead` ``slots - 1`` (``OffloadSettings.ring_slots``; a no-op without a ring)."""
        ...

    def reserve(self, chunks: Sequence[Chunk], dtypes: Sequence[torch.dtype],
                places: Mapping[int, tuple[int, torch.dtype]]) -> None:
        """On the idle worker between steps (``Pipeline.reserve``): make now what the steps of
        this chunk layout stage through (``dtypes``: per slot; ``places``: slot -> elements and
        dtype of the early weights' places), so no step makes any (never during backward)."""
        ...

    def pinned_stats(self) -> tuple[int, int]:
        """At a step's end: (page-locked bytes held, blocks registered since the previous call)."""
        ...

    def close(self) -> None:
        """The worker has stopped: release what the transport holds (pinned memory)."""
        ...
