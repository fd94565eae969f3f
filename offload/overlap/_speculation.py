"""Speculative chunks: work started during backward is a guess, committed or undone at ``step()``.

With ``overlap_backward`` a chunk starts (``offload.overlap._hooks``) as soon as its gradients have
arrived, long before ``step()``. Between backward and ``step()`` a training loop may still change
what the step should consume: clip or unscale the gradients (torch's ``clip_grad_norm_``,
``GradScaler``), all-reduce them (DDP), run another backward, set the learning rate, skip the
step. So an early chunk is a *speculation*, and this module makes it one that is never wrong:

* the chunk's master and moments are saved into a backup buffer of the chunk before its kernel
  overwrites them (kept from step to step: the memory cost of speculation, 12 bytes per
  speculated element), and a checksum of every gradient view it reads is recorded. The native
  kernels do both in their own pass (``saves``/``checksums``,
  ``offload.kernels._outputs.speculation_outputs``): the gradient is read from memory once and the
  backups are only written, 40 bytes per element moved instead of 28 + 24 + 12 (read for
  ownership) + 4 with a copy and a checksum pass first, which is what items of torch's kernel
  still take. For a CUDA gradient the native kernel checksums the staged copy it consumed (so a
  gradient changed while the copy ran, A -> B -> A, is not taken for A: no device work in the
  hook either); for torch's kernel the checksum is taken on the device at launch;
* at ``step()`` :meth:`Speculation.stale_chunks` compares what each early chunk consumed with
  what the step would consume: the gradients' *content* (a checksum of every word, read again
  now: version counters miss in-place ops through a DTensor and GradScaler's CPU unscale, and
  multiplying by 1.0 changes nothing), the group's hyper-parameters, the clip coefficient and the
  grad scale;
* a chunk that agrees is committed as it is; one that does not is restored from its backup on the
  worker (in queue order, after its kernel) and recomputed in ``step()`` from the committed state.
  A step that does not happen (``zero_grad()`` before ``step()``, a GradScaler overflow, an error)
  restores every early chunk and the step counters (:meth:`Speculation.abandon`).

The checksum is a lane-weighted 64-bit sum of the gradient's words (``offload.kernels._grad_stats``,
one native pass on the CPU, torch ops on a device): any change of one element changes it, and so
do sign flips and swapped neighbours; changes that cancel within every lane and across the
weighted lanes (elements 32 apart swapped) are not seen. Where a kernel takes it, it is per view
(the elements of one parameter a chunk reads, ``grad_slice``); a device checksum at launch is
per parameter, once per window at the first early chunk holding it (final then: a chunk starts
only when all its parameters' hooks fired). At ``step()`` the gradients' checksums are read again
(on their device, one sync for all) while the worker still runs the last early kernels, and
compared once they are done.

A native kernel checksums a private copy of each piece (at most 16 Ki elements) and updates from
that copy; an item of torch's kernel on the host gets a copy of its gradient here, which is
checksummed and which its kernel reads. Either way what was checksummed is what was consumed,
even while another thread writes the gradient (a change and its undo, A -> B -> A, is then
redone, not committed as A).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import Tensor

from offload.state._dtensor import local as _local
from offload.state._edits import stamp
from offload.state._items import KIND_TORCH, ItemKind
from offload.pipeline._jobs import ChunkJob
from offload.pipeline._operands import grad_slice
from offload.kernels._adamw import Hyper
from offload.state._params import ParamRecord
from offload.state._slabs import SLAB_KINDS, Chunk, HostSlabs

logger = logging.getLogger(__name__)

__all__ = ["GradReading", "Speculation", "SpeculativeChunk", "checksums_of", "same_hyper"]

Checksums = Callable[[list[Tensor]], Tensor]
"""``checksums(tensors)``: a 1-D int64 tensor, one content checksum per tensor."""
ViewKey = tuple[int, int, int]
"""(slot, start, stop): the elements of one parameter's gradient an early item read."""
#: Elements: each view's place in a chunk's backup starts on a multiple of this (256 bytes), so
#: the kernels' non-temporal stores into it are aligned.
_BACKUP_ALIGN = 64


def same_hyper(a: Hyper, b: Hyper) -> bool:
    """Would a kernel run with ``a`` give the bits of one run with ``b``?"""
    if (a.beta1, a.beta2, a.weight_decay, a.eps) != (b.beta1, b.beta2, b.weight_decay, b.eps):
        return False
    return (_same_value(a.lr, b.lr) and _same_scale(a.grad_coef, b.grad_coef)
            and _same_scale(a.grad_scale, b.grad_scale))


def on_host(hyper: Hyper) -> Hyper:
    """``hyper`` with its tensors (a device lr, GradScaler's scale, a clip coefficient) copied to
    the host once, so that comparing it with many chunks' hyper-parameters syncs at most once."""
    def host(v: Any) -> Any:
        return v.detach().to("cpu") if isinstance(v, Tensor) and v.device.type != "cpu" else v

    return replace(hyper, lr=host(hyper.lr), grad_scale=host(hyper.grad_scale), grad_coef=host(hyper.grad_coef))


def _same_value(a: float | Tensor, b: float | Tensor) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            return False  # a float lr and a tensor lr take different kernel paths
        return a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu()))
    return a == b


def _same_scale(a: Tensor | None, b: Tensor | None) -> bool:
    """None means 1 (no clipping, no scaling)."""
    if a is None and b is None:
        return True
    one = torch.ones((), dtype=torch.float32)
    a = one if a is None else a.detach().to("cpu", torch.float32)
    b = one if b is None else b.detach().to("cpu", torch.float32)
    return bool(torch.equal(a, b))


@dataclass(slots=True)
class SpeculativeChunk:
    """What one early chunk consumed, and where its state was saved."""

    job: ChunkJob
    """The job started during backward (its ``hyper`` is what its kernel used)."""
    slots: tuple[int, ...]
    """The parameters of the chunk."""
    grads: dict[int, Tensor]
    """Per slot: the gradient object it read (kept alive until the step ends)."""
    steps: dict[int, Tensor]
    """Per slot: the step tensor its kernel counts."""
    stamps: dict[int, tuple[int, int, int]]
    """Per slot: the parameter's edit stamp at the launch (an edit after it makes the chunk late)."""
    saved: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    """(slab view, backup view) pairs filled by the worker (before or in the kernel)."""
    views: list[ViewKey] = field(default_factory=list)
    """The gradient views whose checksums are recorded per view (host gradients; CUDA ones of a
    native kernel, checksummed from their staged copy)."""


@dataclass(slots=True)
class GradReading:
    """The gradients an early chunk's parameters have at ``step()`` (:meth:`Speculation.read_now`)."""

    changed: set[int] = field(default_factory=set)
    """Slots whose gradient is gone or another tensor shape, dtype or device than the one read."""
    grads: dict[int, Tensor] = field(default_factory=dict)
    """The others' gradients (local tensors)."""
    views: dict[ViewKey, int] = field(default_factory=dict)
    """Per view an early item read with its checksum recorded (host gradients; CUDA ones read by a
    native kernel from their staged copy): the checksum of the gradient now."""


class Speculation:
    """Backups, checksums and step snapshots of one optimizer's early chunks (see module doc)."""

    def __init__(self, checksums: Checksums) -> None:
        self._checksums = checksums
        self._backup: dict[int, list[Tensor]] = {}  # chunk index -> its backup (master, exp_avg, exp_avg_sq)
        self._offsets: dict[int, dict[tuple[int, int], int]] = {}  # chunk -> view -> offset
        self._views: dict[int, Any] = {}  # chunk -> its views' backup and slab views (_chunk_views)
        self._launched: dict[int, SpeculativeChunk] = {}
        self._steps0: dict[int, tuple[Tensor, Tensor]] = {}  # slot -> (step tensor, its value)
        self._sums: dict[ViewKey, tuple[Tensor, int]] = {}  # view -> (checksums, index) of what its kernel read
        self._device_sums: dict[int, tuple[Tensor, Any]] = {}  # CUDA: (checksum at launch, its event)

    @property
    def backup_bytes(self) -> int:
        """Host bytes held by the backup buffers (12 per element of every chunk ever speculated)."""
        return sum(t.numel() * t.element_size() for b in self._backup.values() for t in b)

    def forget_layout(self) -> None:
        """A new chunk layout or new slabs: the backup buffers describe the old one."""
        assert not self._launched, "forget_layout() with early chunks in flight"
        self._backup.clear()
        self._offsets.clear()
        self._views.clear()

    # -------------------------------------------------------------- launch (backward hook)
    def launch(self, chunk: Chunk, job: ChunkJob, grads: Mapping[int, Tensor],
               records: Sequence[ParamRecord], state: Mapping[Tensor, dict[str, Any]]) -> None:
        """On the launching thread, before ``job`` is submitted: snapshot the step counters of
        parameters no earlier chunk of this window touched, and arrange the worker's backup and
        checksums (:meth:`before_kernel`)."""
        first = [s for s in grads if s not in self._steps0]
        for s in first:
            step = state[records[s].param]["step"]
            self._steps0[s] = (step, step.clone())
        # CUDA gradients of torch's kernel: checksummed on the device at launch. Those of a native
        # kernel are checksummed as the kernel reads their staged copy (what it consumed).
        torch_kind = {it.view.slot for it in job.items if it.kind == KIND_TORCH}
        cuda = [s for s in first if grads[s].device.type == "cuda" and s in torch_kind]
        if cuda:  # enqueued on the stream that produced the gradients: asynchronous, cheap
            sums = self._checksums([grads[s] for s in cuda])
            done = torch.cuda.Event()
            done.record()  # on this thread's stream (a DDP comm hook may run on another one)
            for s, v in zip(cuda, sums):
                self._device_sums[s] = (v, done)
        spec = SpeculativeChunk(job, tuple(grads), dict(grads),
                                {s: state[records[s].param]["step"] for s in grads},
                                {s: stamp(records[s]) for s in grads})
        spec.views = [(it.view.slot, it.view.start, it.view.stop) for it in job.items
                      if grads[it.view.slot].device.type != "cuda" or it.kind != KIND_TORCH]
        self._launched[chunk.index] = spec
        job.before_kernel = lambda job, spec=spec, chunk=chunk: self._before_kernel(job, spec, chunk)

    def bind(self, slabs: HostSlabs) -> None:
        """The slabs the backups copy (set again after every relayout)."""
        self._slabs = slabs

    def _buffer(self, chunk: Chunk) -> tuple[list[Tensor], dict[tuple[int, int], int]]:
        """The chunk's backup (made at its first speculation) and each view's offset in it."""
        buf = self._backup.get(chunk.index)
        if buf is None:
            offsets, pos = {}, 0
            for v in chunk.views:
                offsets[(v.slot, v.start)] = pos
                pos += -(-v.numel // _BACKUP_ALIGN) * _BACKUP_ALIGN
            buf = self._backup[chunk.index] = [torch.empty(pos, dtype=torch.float32) for _ in SLAB_KINDS]
            self._offsets[chunk.index] = offsets
        return buf, self._offsets[chunk.index]

    def _chunk_views(self, chunk: Chunk) -> dict[tuple[int, int], tuple[list[Tensor], list[Tensor], ViewKey]]:
        """Per view of the chunk: its backup views, its slab views (master, exp_avg, exp_avg_sq)
        and its key, made once per chunk layout: slicing them anew for every item of every early
        job held the GIL against the trainer's thread (512 tensors: ~20 ms per iteration)."""
        views = self._views.get(chunk.index)
        if views is None:
            buf, offsets = self._buffer(chunk)
            views = {}
            for v in chunk.views:
                at = offsets[(v.slot, v.start)]
                views[(v.slot, v.start)] = ([b[at : at + v.numel] for b in buf],
                                            [self._slabs.view(kind, v) for kind in SLAB_KINDS],
                                            (v.slot, v.start, v.stop))
            self._views[chunk.index] = views
        return views

    def _before_kernel(self, job: ChunkJob, spec: SpeculativeChunk, chunk: Chunk) -> None:
        """On the worker, right before the early kernel (and before the host transport reads or
        upcasts any gradient): the backup of the state the kernel will write and the checksums
        of the host gradient views it will read. Items of a native kernel with a host gradient
        get both from their kernel call (``job.speculate``); the others here, first."""
        views = self._chunk_views(chunk)
        pairs: list[tuple[Tensor, Tensor]] = []
        copy_to: list[Tensor] = []
        copy_from: list[Tensor] = []
        summed: list[tuple[ViewKey, Tensor]] = []
        fused: dict[ItemKind, tuple[list[Tensor], list[ViewKey]]] = {}
        snapshots: dict[int, Tensor] = {}  # slot -> the copy torch's kernel reads (host gradients)
        for it in job.items:
            v = it.view
            saves, state, key = views[(v.slot, v.start)]
            pairs.extend(zip(state, saves))
            host = it.grad is not None and it.grad.device.type != "cuda"
            if it.grad is not None and it.kind != KIND_TORCH:  # the kernel reads it (CUDA: staged)
                entry = fused.setdefault(it.kind, ([], []))
                entry[0].extend(saves)
                entry[1].append(key)
                continue
            copy_to.extend(saves)
            copy_from.extend(state)
            if host:
                # torch's kernel reads the gradient later: it reads a copy taken now, the copy
                # that is checksummed (a change and its undo in between, A -> B -> A, would
                # otherwise commit what B gave: 15 of 20 loaded runs of the races check)
                snapshot = snapshots.get(v.slot)
                if snapshot is None:
                    snapshot = snapshots[v.slot] = it.grad.clone()
                it.grad = snapshot
                summed.append((key, grad_slice(snapshot, v.start, v.stop)))
        if summed:
            sums = self._checksums([g for _, g in summed])
            for i, (key, _) in enumerate(summed):
                self._sums[key] = (sums, i)
        if copy_to:
            torch._foreach_copy_(copy_to, copy_from)
        job.speculate = {}
        for kind, (saves, keys) in fused.items():
            sums = torch.zeros(len(keys), dtype=torch.int64)
            job.speculate[kind] = (saves, sums)
            for i, key in enumerate(keys):
                self._sums[key] = (sums, i)
        spec.saved = pairs

    # -------------------------------------------------------------- step()
    def has_launched(self) -> bool:
        """Some chunk of this window started early."""
        return bool(self._launched)

    def take(self) -> dict[int, SpeculativeChunk]:
        """The early chunks of this window (the window stays open until :meth:`close`)."""
        return dict(self._launched)

    def late_edits(self, records: Sequence[ParamRecord]) -> list[int]:
        """The slots of early chunks whose parameter was edited after the chunk started."""
        return sorted({s for spec in self._launched.values() for s, st in spec.stamps.items()
                       if st != stamp(records[s])})

    def read_now(self, launched: Mapping[int, SpeculativeChunk], records: Sequence[ParamRecord]) -> GradReading:
        """What ``step()`` would consume of the early chunks' gradients, read now: may run while the
        worker still runs early kernels (it only reads gradients, as they do)."""
        reading = GradReading()
        for s in sorted({s for spec in launched.values() for s in spec.slots}):
            p = records[s].param
            g = None if p.grad is None else _local(p.grad)
            spec_g = next(spec.grads[s] for spec in launched.values() if s in spec.grads)
            if g is None or g.shape != spec_g.shape or g.dtype != spec_g.dtype or g.device != spec_g.device:
                reading.changed.add(s)
            else:
                reading.grads[s] = g
        keys = [k for spec in launched.values() for k in spec.views if k[0] in reading.grads]
        for on_device in (False, True):  # host views, then device ones: one sync for all of those
            part = [k for k in keys if (reading.grads[k[0]].device.type == "cuda") == on_device]
            if part:
                sums = self._checksums([_view_of(reading.grads[s], a, b) for s, a, b in part]).tolist()
                reading.views.update(zip(part, sums))
        return reading

    def stale_chunks(self, launched: Mapping[int, SpeculativeChunk], records: Sequence[ParamRecord],
                     hyper_now: Callable[[int], Hyper], chunk_group: Callable[[int], int],
                     late_slots: Iterable[int], reading: GradReading | None = None) -> list[int]:
        """The early chunks whose work differs from what this step consumes; only once their
        kernels ran (the worker drained up to them: the host checksums of what they read are
        made there). ``reading``: :meth:`read_now`'s, when it was taken earlier in this
        ``step()``."""
        if reading is None:
            reading = self.read_now(launched, records)
        changed = set(late_slots) | reading.changed
        recorded: dict[int, list[int]] = {}  # id(checksums tensor) -> its values (one read each)
        for key, now in reading.views.items():
            was = self._sums.get(key)
            if was is None:
                changed.add(key[0])
                continue
            sums, i = was
            values = recorded.get(id(sums))
            if values is None:
                values = recorded[id(sums)] = sums.tolist()
            if values[i] != now:
                changed.add(key[0])
        dev_slots: list[int] = []
        dev_now: list[Tensor] = []
        dev_was: list[Tensor] = []
        device = [s for s in reading.grads if s in self._device_sums]
        if device:
            for s, v in zip(device, self._checksums([reading.grads[s] for s in device])):
                was, done = self._device_sums[s]
                # The launch's checksum is on its stream: ours waits for it on the device.
                torch.cuda.current_stream(v.device).wait_event(done)
                dev_slots.append(s)
                dev_now.append(v)
                dev_was.append(was)
            # one host-device sync for all device checksums, not two per parameter
            differs = (torch.stack(dev_now) != torch.stack(dev_was)).tolist()
            changed.update(s for s, d in zip(dev_slots, differs) if d)
        stale = []
        now_of: dict[int, Hyper] = {}  # per group, on the host: no device sync per chunk
        for c, spec in sorted(launched.items()):
            group = chunk_group(c)
            if group not in now_of:
                now_of[group] = on_host(hyper_now(group))
            if (not spec.job.kernel_ran or changed.intersection(spec.slots)
                    or not same_hyper(spec.job.hyper, now_of[group])):
                stale.append(c)
        return stale

    def restore(self, chunks: Iterable[int]) -> None:
        """On the worker (after the chunks' kernels): put back the state saved before them."""
        pairs = [pair for c in chunks for pair in self._launched[c].saved]
        if pairs:
            torch._foreach_copy_([s for s, _ in pairs], [b for _, b in pairs])
        for c in chunks:
            self._launched[c].saved = []

    def reset_steps(self) -> None:
        """The step counters back to their values before this window (a step that did not
        happen); only after the pipeline drained."""
        for step, value in self._steps0.values():
            step.copy_(value)

    def close(self) -> None:
        """End the window: forget what it launched and read."""
        self._launched.clear()
        self._steps0.clear()
        self._sums.clear()
        self._device_sums.clear()


def _view_of(g: Tensor, start: int, stop: int) -> Tensor:
    """Elements ``start:stop`` of gradient ``g`` as a kernel read them: ``g`` itself when that is
    all of a contiguous ``g`` (its checksum in memory order is that of the flat view, and no view
    is made), else :func:`grad_slice`."""
    if start == 0 and stop == g.numel() and g.is_contiguous():
        return g
    return grad_slice(g, start, stop)


def checksums_of(kernels: Any) -> Checksums:
    """The checksums of ``KernelSet.checksums`` (``offload.kernels._grad_stats.checksums_``); a
    gradient that is not one dense block of memory (rare) is checksummed from a contiguous copy."""
    checksums_fn = kernels.checksums

    def checksums(tensors: list[Tensor]) -> Tensor:
        dense = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        return checksums_fn(dense)

    return checksums
