"""The chunked step: a persistent worker thread running d2h / adam_kernel / materialize per chunk.

One worker thread per optimizer takes :class:`ChunkJob` s from a FIFO queue. A job runs, in
order, some of: ``d2h`` (gradients to where the kernel reads them: nothing on the CPU unless a
torch-kernel gradient needs an upcast into the chunk-sized scratch buffer), ``adam_kernel`` (fused
AdamW on the chunk's slab views) and ``materialize`` (fp32 master downcast into the model's
parameters). :meth:`Pipeline.drain` waits until every job submitted so far is done and returns
their stage records and the first error.

All CPU work of the worker runs under ``thread_limit(job.threads)``, entered when a job needs a
different count and left at the end of each step (the barrier). torch's intra-op thread count is
per OS thread (OpenMP ICVs are per thread). Checked on torch 2.13 CPU (OpenMP backend):
``torch.set_num_threads(n)`` called in the worker makes the worker's kernels use n threads (1 or 2
busy threads seen in /proc per-thread CPU time) and leaves the main thread's count unchanged, but
it also sets the default that threads created later start with, hence the restore.

Transports: :class:`HostTransport` (parameters on the CPU: in place where the kernel allows,
else copies through a chunk-sized scratch buffer) and ``offload._cuda_transport.CudaTransport``
(a pinned ring per direction, d2h and h2d on side streams with events; the worker issues the next
chunks' d2h before running the current chunk's kernel, see that module).

Kernel "fused-mp" (items with ``fused=True``: bf16/fp16 parameters): no upcast and no downcast
pass. On the CPU, d2h does nothing (the kernel reads the gradient itself) and the kernel writes the
low-precision weight straight into the parameter, except for a chunk started during backward
(``overlap_backward``), whose weights must not change before ``step()``: it writes into a host
buffer of the parameter's dtype that materialize then copies into the parameter. On CUDA, d2h
copies the gradient into pinned low-precision staging, the kernel reads it there and writes the
weight into a pinned low-precision buffer per parameter, and materialize copies that to the device.

Per-chunk Python. A memory-bound step keeps the memory bus busy only while a kernel runs; the
worker's Python between two kernel calls leaves it idle, and right after a kernel has streamed
~100 MB through the caches that Python runs slowly. Measured on a 2-core VM, 125M bf16 model,
4 Mi-element chunks: 0.2-0.45 ms between kernel calls, 8-15% of the step, before the hot path was
trimmed: the slab views of a chunk are made once and reused (:class:`_SlabListCache`), a whole
parameter goes to the fused-mp kernel as it is (no view, :func:`_param_operand`), the step
counters are incremented inside the kernel call, the worker thread runs with grad mode off for
good, and on the CPU a step's fused-mp job gets its kernel arguments from the submitting thread
(:meth:`HostTransport.prepare`), which builds them while the worker runs the previous kernel.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from offload._kernels import Hyper, fused_adamw_, mixed_precision_adamw_, native_adamw_f32_
from offload._slabs import HostSlabs, SlabKind, View
from offload._threads import thread_limit

logger = logging.getLogger(__name__)

__all__ = [
    "ChunkJob",
    "DrainResult",
    "HostTransport",
    "Item",
    "Pipeline",
    "StageRecord",
]

#: Item kinds: the kernel that updates an item (see :attr:`Item.fused`).
KIND_TORCH, KIND_MP, KIND_F32 = 0, 1, 2
#: Byte alignment of each view inside a pinned staging buffer.
_STAGING_ALIGN = 64
#: How often a waiting ``drain`` checks that the worker thread is still alive, in seconds.
_LIVENESS_POLL_S = 1.0


@dataclass(slots=True)
class Item:
    """One view of a chunk, with the tensors it reads and writes for this step."""

    view: View
    param: Tensor
    """The model parameter (written by materialize)."""
    grad: Tensor | None
    """The parameter's gradient captured when the job was made (read by d2h)."""
    grad_version: int
    step: Tensor
    """The parameter's fp32 step tensor."""
    fused: int = KIND_TORCH
    """Which kernel updates the item: :data:`KIND_TORCH`, :data:`KIND_MP` (fused-mp, a bf16/fp16
    parameter with a gradient of its dtype) or :data:`KIND_F32` (fused-mp's fp32 entry point, an
    fp32 parameter with an fp32 gradient). Truthy for the native kernel."""


@dataclass(slots=True)
class StageRecord:
    """One stage of one chunk, in ``time.perf_counter`` seconds; GPU parts may be pending."""

    chunk: int
    stage: str
    start: float
    end: float
    busy_s: float
    pending: tuple[Any, Any] | None = None
    """(start_event, end_event) of GPU work whose time is added when the stats are read."""

    def finalize(self) -> None:
        if self.pending is None:
            return
        start_ev, end_ev = self.pending
        end_ev.synchronize()
        gpu_s = start_ev.elapsed_time(end_ev) / 1e3
        self.busy_s += gpu_s
        self.end = max(self.end, self.start + self.busy_s)
        self.pending = None


@dataclass(slots=True)
class ChunkJob:
    chunk: int
    items: list[Item]
    hyper: Hyper
    threads: int
    update: bool
    """Run d2h and adam_kernel."""
    materialize: bool
    check_versions: bool = False
    """Early launch: skip the kernel if a gradient changed since the job was made."""
    ready_event: Any = None
    """CUDA: event after which the gradients are final (d2h waits on it)."""
    write_event: Any = None
    """CUDA: event after which the parameters may be overwritten (h2d waits on it)."""
    # Filled by the worker.
    transfer: Any = None
    grads: list[Tensor] | None = None
    """Per item: the gradient operand its kernel reads (low precision for KIND_MP, fp32 else)."""
    calls: list[_Call] | None = None
    """The kernel calls of the job, made by the submitting thread (see Transport.prepare)."""
    call_steps: list[tuple[list[int], list[Tensor]]] | None = None
    """Per call: the slots and step tensors of its items (made with ``calls``)."""
    staging: Any = None
    """CUDA: the h2d ring slot the kernel wrote the new weights into (see CudaTransport)."""
    kernel_ran: bool = False
    skipped_stale: bool = False
    direct: bool = False
    """Host: every item's kernel reads its gradient where it is and writes its parameter itself
    (no upcast, no materialize copy); set by :meth:`HostTransport.finish_d2h` or ``prepare``."""


@dataclass(slots=True)
class _Barrier:
    done: threading.Event = field(default_factory=threading.Event)
    result: DrainResult | None = None


_STOP = object()


@dataclass(slots=True)
class _OnWorker:
    fn: Any
    threads: int
    event: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


@dataclass(slots=True)
class DrainResult:
    records: list[StageRecord]
    error: BaseException | None
    last_h2d_event: Any
    wait_s: float = 0.0


_Call = tuple[int, Any, tuple[list[Tensor], ...]]
"""(kind, kernel function, positional tensor lists) of one kernel call; the worker adds the steps
to increment and the hyper-parameters."""


class Transport(Protocol):
    is_async: bool

    def prepare(self, job: ChunkJob, lists: _SlabListCache) -> None: ...

    def issue_d2h(self, job: ChunkJob) -> None: ...

    def finish_d2h(self, job: ChunkJob, slabs: HostSlabs, records: list[StageRecord]) -> None: ...

    def lowp_out(self, job: ChunkJob, item: Item) -> Tensor: ...

    def materialize(self, job: ChunkJob, slabs: HostSlabs, records: list[StageRecord]) -> None: ...

    def flush(self) -> Any: ...


def _flat(t: Tensor) -> Tensor:
    t = t.detach()
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def _param_view(it: Item) -> Tensor:
    return it.param.detach().view(-1)[it.view.start : it.view.stop]


def _grad_operand(it: Item) -> Tensor:
    """The item's gradient as the fused-mp kernel reads it: the gradient itself when the item
    covers all of it and it is contiguous (the kernel reads any shape, and a view made per
    parameter per step costs Python time while the memory bus idles), else a flat slice (of a
    contiguous copy, for a non-contiguous gradient: it is only read)."""
    g = it.grad
    assert g is not None  # jobs with update=True only hold items with a gradient
    if it.view.whole and g.is_contiguous():
        return g
    return _flat(g)[it.view.start : it.view.stop]


def _param_operand(it: Item) -> Tensor:
    """The item's parameter as the fused-mp kernel writes it: the parameter itself for a whole
    one, else a flat view. Never a copy: ``step()`` checked the parameter is contiguous, and a
    non-contiguous one makes ``view`` raise rather than the update land in a temporary."""
    return it.param if it.view.whole else _param_view(it)


class _LowpBuffers:
    """One host buffer per parameter, of the parameter's dtype, made on first use.

    Holds the fused-mp kernel's low-precision output until materialize copies it into the
    parameter. ``pin`` for CUDA; each buffer remembers the event of its last host-to-device copy,
    and :meth:`view` waits for it before handing the buffer out for writing again.
    """

    def __init__(self, *, pin: bool) -> None:
        self._pin = pin
        self._bufs: dict[int, Tensor] = {}
        self._last: dict[int, Any] = {}

    def view(self, it: Item, *, for_write: bool) -> Tensor:
        slot = it.view.slot
        buf = self._bufs.get(slot)
        if buf is None:
            buf = self._new(it)
            self._bufs[slot] = buf
        if for_write:
            last = self._last.pop(slot, None)
            if last is not None:
                last.synchronize()
        return buf[it.view.start : it.view.stop]

    def _new(self, it: Item) -> Tensor:
        return torch.empty(it.param.numel(), dtype=it.param.dtype, pin_memory=self._pin)

    def used_by(self, slot: int, event: Any) -> None:
        self._last[slot] = event


class _Scratch:
    """One chunk-sized fp32 buffer, reused chunk after chunk, for gradients a kernel cannot read
    where they are (a bf16/fp16 gradient on the torch kernel): the worker upcasts into it right
    before the chunk's kernel, so one buffer serves every chunk (no full-size gradient slab)."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.float32)

    def views(self, numels: list[int]) -> list[Tensor]:
        offsets, total = [], 0
        for n in numels:
            offsets.append(total)
            total += -(-n // (_STAGING_ALIGN // 4)) * (_STAGING_ALIGN // 4)
        if self._buf.numel() < total:
            self._buf = torch.empty(total, dtype=torch.float32)
        return [self._buf[o : o + n] for o, n in zip(offsets, numels)]


def _master_operand(it: Item, slabs: HostSlabs) -> Tensor:
    """The tensor the kernel updates as the item's fp32 master: the parameter itself when it is
    its own master (an fp32 parameter of a CPU model), else its master slab view."""
    if slabs.slots[it.view.slot].master_offset < 0:
        return _param_operand(it)
    return slabs.view("master", it.view)


def _call_steps(items: list[Item], calls: list[_Call]) -> list[tuple[list[int], list[Tensor]]]:
    """Per call of :func:`_build_calls`: the slots and step tensors of its items, in order."""
    if len(calls) == 1:
        return [([it.view.slot for it in items], [it.step for it in items])]
    out = []
    for kind, _, _ in calls:
        its = [it for it in items if it.fused == kind]
        out.append(([it.view.slot for it in its], [it.step for it in its]))
    return out


def _build_calls(
    job: ChunkJob,
    slabs: HostSlabs,
    lists: _SlabListCache,
    grads: list[Tensor],
    lowp_out: Any,
    f32_out: Any = None,
) -> list[_Call]:
    """The kernel calls of ``job``, one per kind of item it holds (usually one).

    ``grads[i]``: the gradient operand of item ``i``; ``lowp_out(item)``: where a KIND_MP item's
    low-precision weight goes. Moments come from the per-chunk cache; masters are the parameter
    itself for own-master items (see :func:`_master_operand`). ``f32_out(item)``, if given: where a
    KIND_F32 item's new weight is also written (CUDA: the ring slot the h2d copy reads).
    """
    items = job.items
    kinds = {it.fused for it in items}
    groups: list[tuple[int, list[Item], list[Tensor]]]
    if len(kinds) == 1:
        groups = [(kinds.pop(), items, grads)]
    else:
        groups = []
        for kind in sorted(kinds):
            idx = [i for i, it in enumerate(items) if it.fused == kind]
            groups.append((kind, [items[i] for i in idx], [grads[i] for i in idx]))
    calls: list[_Call] = []
    for kind, its, gs in groups:
        slab = lists.get(job.chunk, its, ("exp_avg", "exp_avg_sq"))
        masters = [_master_operand(it, slabs) for it in its]
        steps = [it.step for it in its]
        if kind == KIND_MP:
            outs = [lowp_out(it) for it in its]
            calls.append((kind, mixed_precision_adamw_,
                          (outs, gs, masters, slab["exp_avg"], slab["exp_avg_sq"], steps)))
        else:
            fn: Any = native_adamw_f32_ if kind == KIND_F32 else fused_adamw_
            outs = [f32_out(it) for it in its] if kind == KIND_F32 and f32_out is not None else []
            if outs and all(o is not None for o in outs):
                fn = functools.partial(native_adamw_f32_, outs=outs)
            calls.append((kind, fn, (masters, gs, slab["exp_avg"], slab["exp_avg_sq"], steps)))
    return calls


@dataclass(slots=True)
class _Prepared:
    """The kernel calls of one chunk's reusable item list (see :meth:`HostTransport.prepare`)."""

    items: list[Item]
    """The list object the calls were made for (held, so its id is never reused)."""
    direct: bool
    """Every item reads its gradient in place and writes its parameter: calls can be made."""
    calls: list[_Call]
    index: list[list[int] | None]
    """Per call: the items it takes (None: all of them)."""
    partial: list[list[tuple[int, int]]]
    """Per call: (position, item) of the pieces of parameters, whose views are remade per step."""
    whole: list[bool]
    steps: list[tuple[list[int], list[Tensor]]]


class HostTransport:
    """Parameters on the CPU: no copies where a kernel can read the gradient and write the
    parameter itself (see the module doc); upcasts go through a chunk-sized scratch buffer."""

    is_async = False

    def __init__(self) -> None:
        self._lowp = _LowpBuffers(pin=False)
        self._scratch = _Scratch()
        self._prepared: dict[int, _Prepared] = {}

    def forget(self) -> None:
        """Drop the prepared calls of the old chunk layout."""
        self._prepared.clear()

    @staticmethod
    def _reads_in_place(it: Item) -> bool:
        g = it.grad
        return it.fused == KIND_MP or (g is not None and g.dtype == torch.float32)

    def prepare(self, job: ChunkJob, lists: _SlabListCache) -> None:
        """A step's in-place job: its kernel calls, made here on the submitting thread.

        Where every kernel reads the gradients where they are and writes the parameters itself,
        the whole call is known at submit time. Making it here, while the worker runs the previous
        chunk's kernel with the GIL released, leaves the worker nothing but the call: no Python
        per parameter between two kernels, when the memory bus would idle. (Jobs launched during
        backward write a staging buffer and check gradient versions; the worker prepares those.)

        The calls of a chunk are made once for the item list the optimizer reuses from step to
        step (see ``CPUOffloadAdamW._items``); a later step only puts in its gradients.
        """
        if not (job.update and job.materialize and not job.check_versions):
            return
        items = job.items
        entry = self._prepared.get(job.chunk)
        if entry is None or entry.items is not items:
            entry = self._prepare_entry(job, lists)
            self._prepared[job.chunk] = entry
        if not entry.direct:
            return
        grads = [g if w and g.is_contiguous() else _grad_operand(it)  # type: ignore[union-attr]
                 for it, w, g in zip(items, entry.whole, [it.grad for it in items])]
        calls = []
        for (kind, fn, args), idx, partial in zip(entry.calls, entry.index, entry.partial):
            targs = list(args)
            targs[1] = grads if idx is None else [grads[i] for i in idx]
            if partial:  # pieces of parameters: their views are remade (.data may have changed)
                first = list(args[0])  # the parameter operands (own masters, or KIND_MP outputs)
                for j, i in partial:
                    first[j] = _param_operand(items[i])
                targs[0] = first
            calls.append((kind, fn, tuple(targs)))
        job.direct = True
        job.calls = calls
        job.call_steps = entry.steps

    def _prepare_entry(self, job: ChunkJob, lists: _SlabListCache) -> _Prepared:
        items = job.items
        slots = lists.slabs.slots
        for it in items:
            if not self._reads_in_place(it) or (
                it.fused != KIND_MP and slots[it.view.slot].master_offset >= 0
            ):
                return _Prepared(items, False, [], [], [], [], [])
        calls = _build_calls(job, lists.slabs, lists, [_grad_operand(it) for it in items],
                             _param_operand)
        # The templates must not keep this step's gradients alive: their place is filled per step.
        calls = [(kind, fn, (args[0], [], *args[2:])) for kind, fn, args in calls]
        kinds = sorted({it.fused for it in items})
        index: list[list[int] | None] = (
            [None] if len(kinds) == 1 else
            [[i for i, it in enumerate(items) if it.fused == k] for k in kinds]
        )
        partial = []
        for idx in index:
            members = range(len(items)) if idx is None else idx
            partial.append([(j, i) for j, i in enumerate(members) if not items[i].view.whole])
        return _Prepared(items, True, calls, index, partial, [it.view.whole for it in items],
                         _call_steps(items, calls))

    def issue_d2h(self, job: ChunkJob) -> None:
        job.transfer = time.perf_counter()

    def finish_d2h(self, job: ChunkJob, slabs: HostSlabs, records: list[StageRecord]) -> None:
        if job.calls is not None:  # prepared at submit: nothing to copy, nothing to look up
            return
        items = job.items
        upcast = [i for i, it in enumerate(items) if not self._reads_in_place(it)]
        grads = [_grad_operand(it) if it.fused == KIND_MP or it.grad.dtype == torch.float32  # type: ignore[union-attr]
                 else None for it in items]
        job.direct = not upcast and all(
            it.fused == KIND_MP or slabs.slots[it.view.slot].master_offset < 0 for it in items
        ) and job.materialize
        if upcast:
            t0 = time.perf_counter()
            views = self._scratch.views([items[i].view.numel for i in upcast])
            for i, dst in zip(upcast, views):
                it = items[i]
                dst.copy_(_flat(it.grad)[it.view.start : it.view.stop])  # type: ignore[arg-type]
                grads[i] = dst
            t1 = time.perf_counter()
            records.append(StageRecord(job.chunk, "d2h", t0, t1, t1 - t0))
        job.grads = grads  # type: ignore[assignment]

    def lowp_out(self, job: ChunkJob, item: Item) -> Tensor:
        """Straight into the parameter, unless the chunk started during backward (see module doc)."""
        if job.materialize:
            return _param_operand(item)
        return self._lowp.view(item, for_write=True)

    def materialize(self, job: ChunkJob, slabs: HostSlabs, records: list[StageRecord]) -> None:
        if job.update and job.direct:
            return  # the kernels of this job wrote every parameter themselves
        t0 = time.perf_counter()
        copied = False
        for it in job.items:
            if it.fused == KIND_MP:
                if not job.update:  # the kernel ran during backward, into the buffer
                    _param_view(it).copy_(self._lowp.view(it, for_write=False))
                    copied = True
                # else: the kernel of this job wrote the parameter itself
            elif slabs.slots[it.view.slot].master_offset >= 0:
                _param_view(it).copy_(slabs.view("master", it.view))
                copied = True
            # else: the parameter is its own master, updated in place
        t1 = time.perf_counter()
        if copied:
            records.append(StageRecord(job.chunk, "materialize", t0, t1, t1 - t0))

    def flush(self) -> Any:
        return None


@dataclass(slots=True)
class _SlabLists:
    views: tuple[View, ...]
    lists: dict[str, list[Tensor]]


class _SlabListCache:
    """The slab views a kernel call of one chunk takes, per kind and in item order, made once per
    chunk and reused while the chunk's items are the same views. Used by the submitting thread
    and by the worker; a dict get/set is atomic, and either writer stores a correct entry."""

    def __init__(self, slabs: HostSlabs) -> None:
        self.slabs = slabs
        self._entries: dict[tuple[int, tuple[str, ...]], _SlabLists] = {}

    def clear(self) -> None:
        self._entries.clear()

    def get(self, chunk: int, items: list[Item], kinds: tuple[SlabKind, ...]) -> dict[str, list[Tensor]]:
        views = tuple(it.view for it in items)
        key = (chunk, kinds)
        got = self._entries.get(key)
        if got is None or got.views != views:
            got = _SlabLists(views, {k: [self.slabs.view(k, v) for v in views] for k in kinds})
            self._entries[key] = got
        return got.lists


class _Worker:
    """State owned by the worker thread (never touched by other threads while it runs), except
    :attr:`lists`, which the submitting thread shares (see :class:`_SlabListCache`)."""

    def __init__(
        self, q: queue.Queue[Any], slabs: HostSlabs, transport: Transport, lists: _SlabListCache
    ) -> None:
        self.q = q
        self.slabs = slabs
        self.transport = transport
        self.records: list[StageRecord] = []
        self.error: BaseException | None = None
        self.stepped: set[int] = set()
        self.device: torch.device | None = getattr(transport, "device", None)
        self._threads: int | None = None
        self._limit = contextlib.ExitStack()
        self.lists = lists

    def _use_threads(self, threads: int) -> None:
        if threads != self._threads:
            self._limit.close()
            self._limit.enter_context(thread_limit(threads))
            self._threads = threads

    def _release_threads(self) -> None:
        self._limit.close()
        self._threads = None

    def run(self) -> None:
        # Grad mode is per thread; nothing this thread runs is differentiated.
        torch.set_grad_enabled(False)
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        pending: collections.deque[Any] = collections.deque()
        lookahead = getattr(self.transport, "lookahead", 1) if self.transport.is_async else 0
        while True:
            item = pending.popleft() if pending else self.q.get()
            if item is _STOP:
                self._release_threads()
                return
            if isinstance(item, _Barrier):
                self._barrier(item)
                continue
            if isinstance(item, _OnWorker):
                try:
                    self._use_threads(item.threads)
                    item.fn()
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    item.error = exc
                finally:
                    self._release_threads()
                    item.event.set()
                continue
            job: ChunkJob = item
            if self.error is not None:
                continue  # a failed step: leave the remaining chunks untouched
            try:
                if job.update and job.transfer is None:
                    self.transport.issue_d2h(job)
                # Async transports: issue the gradient copies of the next queued jobs before this
                # job's kernel, so they run while it computes (never past a barrier).
                while job.update and len(pending) < lookahead and (
                    not pending or isinstance(pending[-1], ChunkJob)
                ):
                    try:
                        nxt = self.q.get_nowait()
                    except queue.Empty:
                        break
                    pending.append(nxt)
                    if isinstance(nxt, ChunkJob) and nxt.update and nxt.transfer is None:
                        self.transport.issue_d2h(nxt)
                self._process(job)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller of step()
                logger.debug("chunk %d failed", job.chunk, exc_info=True)
                self.error = exc

    def _process(self, job: ChunkJob) -> None:
        self._use_threads(job.threads)
        if job.update:
            self.transport.finish_d2h(job, self.slabs, self.records)
            if job.check_versions and any(
                it.grad is None or it.grad._version != it.grad_version for it in job.items
            ):
                job.skipped_stale = True
                return
            self._kernel(job)
        if job.materialize:
            self.transport.materialize(job, self.slabs, self.records)

    def _kernel(self, job: ChunkJob) -> None:
        stepped = self.stepped
        t0 = time.perf_counter()
        calls, call_steps = job.calls, job.call_steps
        if calls is None:
            assert job.grads is not None  # set by finish_d2h
            transport = self.transport
            f32_out = getattr(transport, "f32_out", None)
            calls = _build_calls(
                job, self.slabs, self.lists, job.grads, lambda it: transport.lowp_out(job, it),
                None if f32_out is None else (lambda it: f32_out(job, it)),
            )
        if call_steps is None:
            call_steps = _call_steps(job.items, calls)
        # Each parameter's step goes up once per optimizer step, in the first chunk holding it
        # that runs (set.add returns None: the test adds the slot as it goes).
        for (_, fn, args), (slots, steps) in zip(calls, call_steps):
            new = [st for slot, st in zip(slots, steps) if slot not in stepped and not stepped.add(slot)]
            fn(*args, steps_to_increment=new, hyper=job.hyper)
        job.calls = job.call_steps = None
        job.grads = None
        self._record_kernel(job, t0)

    def _record_kernel(self, job: ChunkJob, t0: float) -> None:
        t1 = time.perf_counter()
        job.kernel_ran = True
        self.records.append(StageRecord(job.chunk, "adam_kernel", t0, t1, t1 - t0))

    def _barrier(self, barrier: _Barrier) -> None:
        self._release_threads()
        last = None
        try:
            last = self.transport.flush()
        except BaseException as exc:  # noqa: BLE001
            if self.error is None:
                self.error = exc
        barrier.result = DrainResult(records=self.records, error=self.error, last_h2d_event=last)
        self.records, self.error = [], None
        self.stepped = set()
        barrier.done.set()


def _worker_main(worker: _Worker) -> None:
    try:
        worker.run()
    except BaseException:  # pragma: no cover - run() catches per job; this is a last resort
        logger.exception("offload worker thread died")
        raise


def _shutdown(q: queue.Queue[Any], thread: threading.Thread) -> None:
    if thread.is_alive():
        q.put(_STOP)
        thread.join(timeout=10.0)


class Pipeline:
    """Owns the worker thread and its queue. Thread-safe ``submit``; ``drain`` from one thread."""

    def __init__(self, slabs: HostSlabs, transport: Transport, *, name: str) -> None:
        self._q: queue.Queue[Any] = queue.Queue()
        self._lists = _SlabListCache(slabs)
        self._prepare_failed = False
        self._worker = _Worker(self._q, slabs, transport, self._lists)
        self._thread = threading.Thread(
            target=_worker_main, args=(self._worker,), name=name, daemon=True
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._q, self._thread)
        self.transport = transport

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: ChunkJob) -> None:
        """Queue ``job``; first the transport may prepare its kernel arguments on this thread."""
        if not self._finalizer.alive:
            raise RuntimeError("the optimizer's pipeline is closed")
        try:
            self.transport.prepare(job, self._lists)
        except Exception:  # noqa: BLE001 - the worker meets the same problem and reports it
            job.calls = job.call_steps = None
            job.direct = False
            if not self._prepare_failed:  # the worker's path still works, but slower: say so once
                self._prepare_failed = True
                logger.warning("preparing chunk %d's kernel call at submit failed; the worker "
                               "prepares it instead (slower)", job.chunk, exc_info=True)
        self._q.put(job)

    def on_worker(self, fn: Any, *, threads: int) -> None:
        """Run ``fn()`` on the worker thread with ``threads`` intra-op threads and wait for it
        (the NUMA first touch of the slabs: the pages land where the kernels will run)."""
        done = _OnWorker(fn, threads)
        self._q.put(done)
        while not done.event.wait(_LIVENESS_POLL_S):
            if not self._thread.is_alive():
                raise RuntimeError("the optimizer's worker thread died; see the log")
        if done.error is not None:
            raise done.error

    def forget_layout(self) -> None:
        """Drop the cached kernel argument lists of the old chunk layout (call between steps)."""
        self._lists.clear()
        forget = getattr(self.transport, "forget", None)
        if forget is not None:
            forget()

    def drain(self) -> DrainResult:
        """Wait until every submitted job is done; return their records and the first error."""
        if not self._finalizer.alive:
            raise RuntimeError("the optimizer's pipeline is closed")
        barrier = _Barrier()
        t0 = time.perf_counter()
        self._q.put(barrier)
        while not barrier.done.wait(_LIVENESS_POLL_S):
            if not self._thread.is_alive():
                raise RuntimeError("the optimizer's worker thread died; see the log")
        result = barrier.result
        assert result is not None
        result.wait_s = time.perf_counter() - t0
        return result

    def close(self) -> None:
        self._finalizer()
