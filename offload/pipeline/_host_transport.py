"""The host transport: parameters on the CPU, so the "device" is the host and d2h is nothing
unless a kernel cannot read a gradient where it is.

No copies where a kernel can read the gradient and write the parameter itself: the fused-mp kernel
(items of kind MP, bf16/fp16 parameters) reads the gradient in place and writes the low-precision
weight straight into the parameter, and an fp32 parameter that is its own master is updated in
place. The exception is a chunk started during backward (``overlap_backward``), whose weights must
not change before ``step()``: its kernel writes into a host buffer of the parameter's dtype that
materialize then copies into the parameter. Only a bf16/fp16 gradient of the torch kernel is
upcast, into the chunk-sized scratch buffer.

A step's in-place job gets its kernel arguments from the submitting thread (:meth:`HostTransport.
prepare`), which builds them while the worker runs the previous kernel: measured on a 2-core VM,
125M bf16 model, 4 Mi-element chunks, the worker's Python between two kernel calls was 0.2-0.45 ms,
8-15% of the step, before this and the other hot-path trims of :mod:`offload.pipeline._pipeline`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from offload.pipeline._buffers import LowpBuffers, Scratch, SlabListCache
from offload.pipeline._jobs import Call, CallSteps, ChunkJob, StageRecord
from offload.state._items import KIND_F32, KIND_MP, Item
from offload.kernels._adamw import KernelSet
from offload.pipeline._operands import build_calls, call_steps, flat, grad_operand, param_operand, param_view, torch_grads
from offload.state._slabs import Chunk, HostSlabs

__all__ = ["HostTransport"]


@dataclass(slots=True, kw_only=True)
class _Prepared:
    """The kernel calls of one chunk's reusable item list (see :meth:`HostTransport.prepare`)."""

    items: list[Item]
    """The list object the calls were made for (held, so its id is never reused)."""
    direct: bool
    """Every item reads its gradient in place and writes its parameter: calls can be made."""
    calls: list[Call]
    """The call templates (no gradients: they are put in per step)."""
    index: list[list[int] | None]
    """Per call: the items it takes (None: all of them)."""
    partial: list[list[tuple[int, int]]]
    """Per call: (position, item) of the pieces of parameters, whose views are remade per step."""
    whole: list[bool]
    """Per item: it covers its whole parameter."""
    steps: list[CallSteps]
    """Per call: the slots and step tensors of its items."""


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
        self._prepared: dict[int, _Prepared] = {}

    def ready_event(self) -> Any:
        """None: the gradients are final when a hook or ``step()`` sees them."""
        return None

    def forget(self) -> None:
        """Drop the prepared calls of the old chunk layout."""
        self._prepared.clear()

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

    def prepare(self, job: ChunkJob, lists: SlabListCache, kernels: KernelSet) -> None:
        """A step's in-place job: its kernel calls, made here on the submitting thread.

        Where every kernel reads the gradients where they are and writes the parameters itself,
        the whole call is known at submit time. Making it here, while the worker runs the previous
        chunk's kernel with the GIL released, leaves the worker nothing but the call: no Python
        per parameter between two kernels, when the memory bus would idle. (Jobs launched during
        backward write a staging buffer and are checked at step(); the worker prepares those.)

        The calls of a chunk are made once for the item list the optimizer reuses from step to
        step (``HostLayout.items``, ``offload.state._items``); a later step only puts in its gradients.
        """
        if not (job.update and job.materialize) or job.into_next:
            return  # out of place (a step that commits a speculation): the worker builds the calls
        items = job.items
        entry = self._prepared.get(job.chunk)
        if entry is None or entry.items is not items:
            entry = self._prepare_entry(job, lists, kernels)
            self._prepared[job.chunk] = entry
        if not entry.direct:
            return
        grads = [g if w and g.is_contiguous() else grad_operand(it)  # type: ignore[union-attr]
                 for it, w, g in zip(items, entry.whole, [it.grad for it in items])]
        calls = []
        for (kind, fn, args), idx, partial in zip(entry.calls, entry.index, entry.partial):
            targs = list(args)
            targs[1] = grads if idx is None else [grads[i] for i in idx]
            if partial:  # pieces of parameters: their views are remade (.data may have changed)
                first = list(args[0])  # the parameter operands (own masters, or KIND_MP outputs)
                for j, i in partial:
                    first[j] = param_operand(items[i])
                targs[0] = first
            calls.append((kind, fn, tuple(targs)))
        job.direct = True
        job.calls = calls
        job.call_steps = entry.steps

    def _prepare_entry(self, job: ChunkJob, lists: SlabListCache, kernels: KernelSet) -> _Prepared:
        items = job.items
        slots = lists.slabs.slots
        for it in items:
            if not self._reads_in_place(it) or (
                it.kind != KIND_MP and slots[it.view.slot].master_offset >= 0
            ):
                return _Prepared(items=items, direct=False, calls=[], index=[], partial=[], whole=[], steps=[])
        calls = build_calls(job, lists.slabs, lists, [grad_operand(it) for it in items],
                            param_operand, None, kernels, host_weights=self.host_weights)
        # The templates must not keep this step's gradients alive: their place is filled per step.
        calls = [(kind, fn, (args[0], [], *args[2:])) for kind, fn, args in calls]
        kinds = sorted({it.kind for it in items})
        index: list[list[int] | None] = (
            [None] if len(kinds) == 1 else
            [[i for i, it in enumerate(items) if it.kind == k] for k in kinds]
        )
        partial = []
        for idx in index:
            members = range(len(items)) if idx is None else idx
            partial.append([(j, i) for j, i in enumerate(members) if not items[i].view.whole])
        return _Prepared(items=items, direct=True, calls=calls, index=index, partial=partial,
                         whole=[it.view.whole for it in items], steps=call_steps(items, calls))

    def issue_d2h(self, job: ChunkJob) -> None:
        job.transfer = time.perf_counter()

    def finish_d2h(self, job: ChunkJob, slabs: HostSlabs, records: list[StageRecord]) -> None:
        if job.calls is not None:  # prepared at submit: nothing to copy, nothing to look up
            return
        items = job.items
        upcast = [i for i, it in enumerate(items) if not self._reads_in_place(it)]
        grads = [grad_operand(it) if it.kind == KIND_MP or it.grad.dtype == torch.float32  # type: ignore[union-attr]
                 else None for it in items]
        # KIND_F32 with a master of its own (overlap_backward): the kernel writes the parameter
        # too, in its pass (f32_out), as KIND_MP's does
        # (all of them: build_calls hands the kernel outs for every KIND_F32 item or for none)
        own = [slabs.slots[it.view.slot].master_offset < 0 for it in items]
        outs = not any(o for it, o in zip(items, own) if it.kind == KIND_F32)
        # (out of place an own master's new value is in the second generation: copied in by materialize)
        job.direct = not upcast and job.materialize and all(
            it.kind == KIND_MP or (o and not job.into_next) or (it.kind == KIND_F32 and outs)
            for it, o in zip(items, own))
        if upcast:
            t0 = time.perf_counter()
            sources = [flat(it.grad)[it.view.start : it.view.stop] if g is None else g  # type: ignore[arg-type]
                       for it, g in zip(items, grads)]
            grads = torch_grads(job, sources, upcast, self._scratch)  # type: ignore[assignment]
            t1 = time.perf_counter()
            records.append(StageRecord(job.chunk, "d2h", t0, t1, t1 - t0))
        job.grads = grads  # type: ignore[assignment]

    def lowp_out(self, job: ChunkJob, item: Item) -> Tensor:
        """Straight into the parameter, unless the chunk started during backward (see module doc)."""
        if job.materialize:
            return param_operand(item)
        return self._lowp.view(item, for_write=True)

    def materialize(self, job: ChunkJob, slabs: HostSlabs, records: list[StageRecord]) -> None:
        if job.update and job.direct:
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
