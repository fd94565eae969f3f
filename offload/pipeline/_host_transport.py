"""The host transport: parameters on the CPU, so the "device" is the host and d2h is nothing
unless a kernel cannot read a gradient where it is.

No copies where a kernel can read the gradient and write the parameter itself: the fused-mp kernel
(items of kind MP, bf16/fp16 parameters) reads the gradient in place and writes the low-precision
weight straight into the parameter, and an fp32 parameter that is its own master is updated in
place. The exception is a chunk started during backward (``overlap_backward``), whose weights must
not change before ``step()``: its kernel writes into a host buffer of the parameter's dtype that
materialize then copies into the parameter. Only a bf16/fp16 gradient of the torch kernel is
upcast, into the chunk-sized scratch buffer.

A step's in-place job gets its kernel calls on the submitting thread (:meth:`HostTransport.
prepare`, from :meth:`offload.pipeline._calls.CallBuilder.in_place`), while the worker runs the
previous kernel: measured on a 2-core VM, 125M bf16 model, 4 Mi-element chunks, the worker's Python
between two kernel calls was 0.2-0.45 ms, 8-15% of the step, before this and the other hot-path
trims of :mod:`offload.pipeline._pipeline`. What the transport learns running a job (the gradient
operands, whether its kernels write the parameters themselves) goes into the job's
``JobProgress``; the job itself is never written.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from offload.pipeline._buffers import LowpBuffers, Scratch
from offload.pipeline._calls import CallBuilder
from offload.pipeline._jobs import ChunkJob, StageRecord
from offload.state._items import KIND_F32, KIND_MP, Item
from offload.pipeline._operands import flat, grad_operand, param_operand, param_view, torch_grads
from offload.state._slabs import Chunk, HostSlabs

__all__ = ["HostTransport"]


class HostTransport:
    """Parameters on the CPU: no copies where a kernel can read the gradient and write the
    parameter itself (see the module doc); upcasts go through a chunk-sized scratch buffer."""

    device: torch.device | None = None
    """None: the parameters are on the host."""
    lookahead: int = 0
    """Nothing to issue ahead: d2h is synchronous (an upcast, or nothing)."""
    caller_writes: bool = True
    """A committed chunk's weight copy (its per-parameter buffer, or its master, into the
    parameter) may run on the thread calling ``step()``."""
    host_weights: bool = True
    """The parameters are host tensors: the kernels compare the masters with them."""

    def __init__(self, copy: Any = None) -> None:
        """``copy(dsts, srcs)``: the weight copies of native items (``KernelSet.copy``; None:
        ``torch._foreach_copy_``)."""
        self._copy = copy if copy is not None else torch._foreach_copy_
        self._lowp = LowpBuffers()
        self._scratch = Scratch()

    def ready_event(self) -> Any:
        """None: the gradients are final when a hook or ``step()`` sees them."""
        return None

    def forget(self) -> None:
        """Nothing cached per chunk layout here (the call templates are the ``CallBuilder``'s)."""

    def resize_rings(self, slots: int) -> None:
        """No staging ring on the host: ``OffloadSettings.ring_slots`` is ignored."""

    def reserve(self, chunks: Sequence[Chunk], dtypes: Sequence[torch.dtype],
                places: Mapping[int, tuple[int, torch.dtype]]) -> None:
        """Nothing pinned on the host."""

    def pinned_stats(self) -> tuple[int, int]:
        """Nothing pinned on the host."""
        return 0, 0

    def close(self) -> None:
        """Nothing to release."""

    @staticmethod
    def _reads_in_place(it: Item) -> bool:
        g = it.grad
        return it.kind == KIND_MP or (g is not None and g.dtype == torch.float32)

    def prepare(self, job: ChunkJob, calls: CallBuilder) -> None:
        """A step's in-place job: its kernel calls, made here on the submitting thread.

        Where every kernel reads the gradients where they are and writes the parameters itself,
        the whole call is known at submit time. Making it here, while the worker runs the previous
        chunk's kernel with the GIL released, leaves the worker nothing but the call: no Python
        per parameter between two kernels, when the memory bus would idle. (Jobs launched during
        backward write a staging buffer and are checked at step(); the worker makes those calls.)

        ``calls`` makes them once per item list the optimizer reuses from step to step
        (``HostLayout.items``, ``offload.state._items``); a later step only puts in its gradients.
        They go into ``job.progress`` in one write, the last thing done here, so a raise leaves
        the job as it was and the worker makes them instead.
        """
        if not (job.update and job.materialize) or job.into_next:
            return  # out of place (a step that commits a speculation): the worker makes the calls
        made = calls.in_place(job, self._reads_in_place, host_weights=self.host_weights)
        if made is not None:
            job.progress.calls = made

    def issue_d2h(self, job: ChunkJob) -> None:
        job.progress.transfer = time.perf_counter()

    def finish_d2h(self, job: ChunkJob, slabs: HostSlabs, records: list[StageRecord]) -> None:
        progress = job.progress
        if progress.calls is not None:  # made at submit: nothing to copy, nothing to look up
            progress.direct = True
            return
        items = job.items
        upcast = [i for i, it in enumerate(items) if not self._reads_in_place(it)]
        grads = [grad_operand(it) if it.kind == KIND_MP or it.grad.dtype == torch.float32  # type: ignore[union-attr]
                 else None for it in items]
        # KIND_F32 with a master of its own (overlap_backward): the kernel writes the parameter
        # too, in its pass (f32_out), as KIND_MP's does
        # (all of them: the calls hand the kernel outs for every KIND_F32 item or for none)
        own = [slabs.slots[it.view.slot].master_offset < 0 for it in items]
        outs = not any(o for it, o in zip(items, own) if it.kind == KIND_F32)
        # (out of place an own master's new value is in the second generation: copied in by materialize)
        progress.direct = not upcast and job.materialize and all(
            it.kind == KIND_MP or (o and not job.into_next) or (it.kind == KIND_F32 and outs)
            for it, o in zip(items, own))
        if upcast:
            t0 = time.perf_counter()
            sources = [flat(it.grad)[it.view.start : it.view.stop] if g is None else g  # type: ignore[arg-type]
                       for it, g in zip(items, grads)]
            grads, progress.coef_in_grads = torch_grads(job, sources, upcast, self._scratch)  # type: ignore[assignment]
            t1 = time.perf_counter()
            records.append(StageRecord(job.chunk, "d2h", t0, t1, t1 - t0))
        progress.grads = grads  # type: ignore[assignment]

    def lowp_out(self, job: ChunkJob, item: Item) -> Tensor:
        """Straight into the parameter, unless the chunk started during backward (see module doc)."""
        if job.materialize:
            return param_operand(item)
        return self._lowp.view(item, for_write=True)

    def materialize(self, job: ChunkJob, slabs: HostSlabs, records: list[StageRecord]) -> None:
        if job.update and job.progress.direct:
            return  # the kernels of this job wrote every parameter themselves
        t0 = time.perf_counter()
        copied = False
        native: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}  # one call per dtype
        for it in job.items:
            if it.kind == KIND_MP:
                if job.update:
                    continue  # the kernel of this job wrote the parameter itself
                src = self._lowp.view(it, for_write=False)  # the kernel ran during backward, into the buffer
            elif job.into_next:  # the new master, out of place: the next generation (own: scratch)
                src = slabs.next_view("master", it.view)
            elif slabs.slots[it.view.slot].master_offset >= 0:
                src = slabs.view("master", it.view)
            else:
                continue  # the parameter is its own master, updated in place
            copied = True
            if it.kind and it.param.dtype == src.dtype:  # a native kernel's item: the extension is loaded
                pair = native.setdefault(src.dtype, ([], []))
                pair[0].append(param_operand(it))  # the copy reads sizes, not shapes: no view of a whole one
                pair[1].append(src)
            else:
                param_view(it).copy_(src)  # a conversion (torch's kernel on a bf16 model)
        for dsts, srcs in native.values():
            self._copy(dsts, srcs)
        t1 = time.perf_counter()
        if copied:
            records.append(StageRecord(job.chunk, "materialize", t0, t1, t1 - t0))

    def f32_out(self, job: ChunkJob, item: Item) -> Tensor | None:
        """A step's job: the parameter, which the kernel writes in its pass besides the master
        (a master of its own: overlap_backward; 4 bytes written per element instead of a copy
        pass that reads the master again). A chunk started during backward: None (its weights
        must not change before ``step()``; they are copied in at commit)."""
        return param_operand(item) if job.materialize else None

    def flush(self) -> Any:
        return None

    def settle(self) -> None:
        """Nothing: no copies in flight, no buffers to size."""

    def order_caller(self, event: Any) -> None:
        """Nothing: the host copies are done when the drain returns (and ``flush`` gives None)."""
