"""Speculative chunks: work started during backward is a guess, committed or undone at ``step()``.

With ``overlap_backward`` a chunk starts (``offload.overlap._hooks``) as soon as its gradients have
arrived, long before ``step()``. Between backward and ``step()`` a training loop may still change
what the step should consume: clip or unscale the gradients (torch's ``clip_grad_norm_``,
``GradScaler``), all-reduce them (DDP), run another backward, set the learning rate, skip the
step. So an early chunk is a *speculation*, and this module makes it one that is never wrong:

* the chunk's kernel runs out of place: it reads the committed master and moments and writes
  the new ones into the second generation of the slabs (``HostSlabs.next_view``), the same 28
  bytes per element as the plain step (``offload.state._slabs``); ``optimizer.state`` keeps
  showing the committed generation until ``step()`` swaps it. The native kernels also checksum
  every gradient piece they read, in the same pass (``checksums``); items of torch's kernel take
  a copy of the gradient and a checksum pass first, then a copy of the committed state into the
  second generation, which they update in place. A CUDA gradient is checksummed from the staged
  host copy the chunk consumed, after that copy landed: by the native kernel in its pass, for
  torch's kernel by the transport before its kernel (or the upcast) reads it
  (``CudaTransport.finish_d2h``). So a gradient changed while the copy was pending and changed
  back (A -> B -> A) is not taken for A, and the hook does no device work;
* at ``step()`` :meth:`Speculation.verdicts` compares what each early chunk consumed with
  what the step would consume: the gradients' *content* (a checksum of every word, read again
  now: version counters miss in-place ops through a DTensor and GradScaler's CPU unscale, and
  multiplying by 1.0 changes nothing), the group's hyper-parameters, the clip coefficient and the
  grad scale;
* a chunk that agrees is committed as it is; one that does not is recomputed in ``step()`` from
  the committed state, out of place like every other chunk of its param group in that step
  (nothing to restore: the committed generation was never written). ``step()`` then swaps the
  generations of those groups (``HostSlabs.swap``). A step that does not happen (``zero_grad``,
  an overflow, ``state_dict()`` before ``step()``) only puts the step counters back.

The checksum is a lane-weighted 64-bit sum of the gradient's words (``offload.kernels._grad_stats``,
one native pass on the CPU, torch ops on a device): any change of one element changes it, and so
do sign flips and swapped neighbours; changes that cancel within every lane and across the
weighted lanes (elements 32 apart swapped) are not seen. It is per view (the elements of one
parameter a chunk reads, ``grad_slice``), the same function on the host and on a device (bitwise
the same value for the same bytes). At ``step()`` the gradients' checksums are read again (CUDA
ones on their device, one sync for all) while the worker still runs the last early kernels, and
compared once they are done.

A native kernel checksums a private copy of each piece (at most 16 Ki elements) and updates from
that copy; an item of torch's kernel on the host gets a copy of its gradient here, which is
checksummed and which its kernel reads; a CUDA gradient's staged copy is written only by its
device-to-host copy, which has ended when it is checksummed. Either way what was checksummed is
what was consumed, even while another thread writes the gradient (a change and its undo,
A -> B -> A, is then redone, not committed as A).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import Tensor

from offload.state._edits import stamp
from offload.state._items import KIND_TORCH, Item, ItemKind, follows_weights
from offload.pipeline._jobs import ChunkJob
from offload.pipeline._operands import grad_slice, param_view
from offload.kernels._adamw import Hyper
from offload.state._params import ParamRecord
from offload.state._slabs import Chunk

logger = logging.getLogger(__name__)

__all__ = ["GradReading", "Speculation", "SpeculativeChunk", "checksums_of", "same_hyper"]

Checksums = Callable[[list[Tensor]], Tensor]
"""``checksums(tensors)``: a 1-D int64 tensor, one content checksum per tensor."""
ViewKey = tuple[int, int, int]
"""(slot, start, stop): the elements of one parameter's gradient an early item read."""
BeforeKernel = Callable[[ChunkJob], dict[ItemKind, Tensor]]
"""What the worker calls right before an early job's kernel (``ChunkJob.before_kernel``)."""
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
    """What one early chunk consumed."""

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
    views: list[ViewKey] = field(default_factory=list)
    """The gradient views the chunk read, each with the checksum of what its kernel consumed
    (a CUDA gradient's: of its staged copy)."""
    weighted: set[ViewKey] = field(default_factory=set)
    """The views whose checksum also holds the words of the weights the kernel compared its
    masters with (``offload.state._items.follows_weights``): an edit through ``.data`` after the
    chunk started makes it stale."""


@dataclass(slots=True)
class GradReading:
    """The gradients an early chunk's parameters have at ``step()`` (:meth:`Speculation.read_now`)."""

    changed: set[int] = field(default_factory=set)
    """Slots whose gradient is gone or another tensor shape, dtype or device than the one read."""
    grads: dict[int, Tensor] = field(default_factory=dict)
    """The others' gradients (local tensors)."""
    views: dict[ViewKey, int] = field(default_factory=dict)
    """Per CUDA view (read by its kernel from a staged copy): the checksum of the gradient now
    (host views are read chunk by chunk, :meth:`Speculation.verdicts`)."""


class Speculation:
    """Checksums and step snapshots of one optimizer's early chunks (see module doc)."""

    def __init__(self, checksums: Checksums) -> None:
        self._checksums = checksums
        self._keys: dict[int, dict[tuple[int, int], ViewKey]] = {}  # chunk -> view -> its key
        self._launched: dict[int, SpeculativeChunk] = {}
        # slot -> (its step tensor, its value before the window, the copy the early kernels count)
        self._steps: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        self._step_bufs: tuple[list[Tensor], list[Tensor]] | None = None  # per slot: before, counted
        self._sums: dict[ViewKey, tuple[Tensor, int]] = {}  # view -> (checksums, index) of what its kernel read

    def forget_layout(self) -> None:
        """A new chunk layout or new slabs: the view keys describe the old one."""
        assert not self._launched, "forget_layout() with early chunks in flight"
        self._keys.clear()

    # -------------------------------------------------------------- launch (backward hook)
    def launch(self, chunk: Chunk, items: list[Item], grads: Mapping[int, Tensor],
               records: Sequence[ParamRecord], state: Mapping[Tensor, dict[str, Any]], *,
               host_weights: bool, job: Callable[[BeforeKernel], ChunkJob]) -> ChunkJob:
        """On the launching thread, before the job is submitted: the step counters the early
        kernels count (copies: ``optimizer.state`` keeps the committed count until
        :meth:`publish_steps`), put in ``items`` (the chunk's fresh ones); returns the job
        ``job(before_kernel)`` makes, whose worker calls ``before_kernel`` for the checksums
        (:meth:`_before_kernel`)."""
        first = [s for s in grads if s not in self._steps]
        if first:
            # One copy per chunk into this speculation's own step tensors (0-d views of two
            # buffers, made once per layout): a clone per parameter held the trainer's thread
            # (512 tensors: ~4.5 ms per backward).
            before, counted = self._step_views(len(records))
            reals = [state[records[s].param]["step"] for s in first]
            torch._foreach_copy_([before[s] for s in first], reals)
            torch._foreach_copy_([counted[s] for s in first], reals)
            for s, step in zip(first, reals):
                self._steps[s] = (step, before[s], counted[s])
        for it in items:  # fresh Items of this job: each counts its parameter's copy
            it.step = self._steps[it.view.slot][2]

        def before_kernel(job: ChunkJob) -> dict[ItemKind, Tensor]:
            return self._before_kernel(job, spec, chunk)  # (spec: bound below, before any submit)

        made = job(before_kernel)
        # No checksum here (no device work in a hook): every gradient view is checksummed on the
        # worker from what its kernel consumes (_before_kernel).
        spec = SpeculativeChunk(made, tuple(grads), dict(grads),
                                {s: state[records[s].param]["step"] for s in grads},
                                {s: stamp(records[s]) for s in grads})
        spec.views = [(it.view.slot, it.view.start, it.view.stop) for it in items]
        spec.weighted = {(it.view.slot, it.view.start, it.view.stop) for it in items
                         if it.grad is not None and follows_weights(it, host_weights)}
        self._launched[chunk.index] = spec
        return made

    def _step_views(self, n: int) -> tuple[list[Tensor], list[Tensor]]:
        """Per slot, a 0-d fp32 view of each of two buffers: the step count before the window,
        and the one the early kernels count (a Speculation lives as long as its layout)."""
        if self._step_bufs is None or len(self._step_bufs[0]) < n:
            before, counted = torch.zeros(n, dtype=torch.float32), torch.zeros(n, dtype=torch.float32)
            self._step_bufs = (list(before.unbind()), list(counted.unbind()))
        return self._step_bufs

    def _view_keys(self, chunk: Chunk) -> dict[tuple[int, int], ViewKey]:
        """Per view of the chunk, its key, made once per chunk layout (tuples made anew for every
        item of every early job held the GIL against the trainer's thread)."""
        keys = self._keys.get(chunk.index)
        if keys is None:
            keys = self._keys[chunk.index] = {(v.slot, v.start): (v.slot, v.start, v.stop) for v in chunk.views}
        return keys

    def _before_kernel(self, job: ChunkJob, spec: SpeculativeChunk, chunk: Chunk) -> dict[ItemKind, Tensor]:
        """On the worker, right before the early kernel (and before the transport reads or
        upcasts any gradient): where the checksums of the gradient views it reads go, returned
        per item kind (the worker keeps them in ``job.progress.speculate``). Items of a native
        kernel get them from their kernel call, CUDA items of torch's kernel from the transport,
        of the staged copy once it landed; host items of torch's kernel are checksummed here,
        first."""
        keys = self._view_keys(chunk)
        summed: list[tuple[ViewKey, Tensor]] = []
        weights: list[tuple[int, Tensor]] = []  # (index in summed, the weights torch's kernel compares with)
        in_pass: dict[ItemKind, list[ViewKey]] = {}  # per kind: the views checksummed where they are consumed
        snapshots: dict[int, Tensor] = {}  # slot -> the copy torch's kernel reads (host gradients)
        for it in job.items:
            v = it.view
            key = keys[(v.slot, v.start)]
            if it.grad is None:
                continue
            if it.kind != KIND_TORCH or it.grad.device.type == "cuda":
                # checksummed in the pass that consumes it: the native kernel's, or (torch's kernel
                # on CUDA) the transport's over the staged copy, after the copy and before any read
                in_pass.setdefault(it.kind, []).append(key)
                continue
            # a host item of torch's kernel reads its gradient later: it reads a copy taken now, the
            # copy that is checksummed (a change and its undo in between, A -> B -> A, would
            # otherwise commit what B gave: 15 of 20 loaded runs of the races check)
            snapshot = snapshots.get(v.slot)
            if snapshot is None:
                snapshot = snapshots[v.slot] = it.grad.clone()
            it.grad = snapshot
            if key in spec.weighted:
                weights.append((len(summed), param_view(it)))
            summed.append((key, grad_slice(snapshot, v.start, v.stop)))
        if summed:
            sums = self._checksums([g for _, g in summed])
            if weights:  # (read microseconds before follow_weights reads them, on this thread)
                sums[[i for i, _ in weights]] += self._checksums([w for _, w in weights])
            for i, (key, _) in enumerate(summed):
                self._sums[key] = (sums, i)
        places: dict[ItemKind, Tensor] = {}
        for kind, kind_keys in in_pass.items():
            sums = torch.zeros(len(kind_keys), dtype=torch.int64)
            places[kind] = sums
            for i, key in enumerate(kind_keys):
                self._sums[key] = (sums, i)
        return places

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
        """What ``step()`` would consume of the early chunks' gradients: which are gone or of
        another shape, dtype or device, and the checksums of device views (one sync for all). The
        host views are read chunk by chunk in :meth:`verdicts`. May run while the worker still
        runs early kernels (it only reads gradients, as they do)."""
        reading = GradReading()
        for s in sorted({s for spec in launched.values() for s in spec.slots}):
            p = records[s].param
            g = None if p.grad is None else records[s].grad_of(p.grad)
            spec_g = next(spec.grads[s] for spec in launched.values() if s in spec.grads)
            if g is None or g.shape != spec_g.shape or g.dtype != spec_g.dtype or g.device != spec_g.device:
                reading.changed.add(s)
            else:
                reading.grads[s] = g
        device = [k for spec in launched.values() for k in spec.views
                  if k[0] in reading.grads and reading.grads[k[0]].device.type == "cuda"]
        if device:
            sums = self._checksums([_view_of(reading.grads[s], a, b) for s, a, b in device]).tolist()
            reading.views.update(zip(device, sums))
        return reading

    def verdicts(self, launched: Mapping[int, SpeculativeChunk], records: Sequence[ParamRecord],
                 hyper_now: Callable[[int], Hyper], chunk_group: Callable[[int], int],
                 late_slots: Iterable[int], reading: GradReading,
                 wait: Callable[[ChunkJob], None]) -> Iterator[tuple[int, bool]]:
        """(chunk, stale) for every early chunk, in the order they started (the order their kernels
        finish), as soon as it is known: its host gradient views are checksummed now, then, once
        its kernel ran (``wait(job)``: the worker made the checksums of what it read in that pass),
        compared; so the caller can write a committed chunk's weights while the last kernels run. Stale: its work differs from what this step
        consumes (gradient content, shape, hyper-parameters, clip coefficient, grad scale, an edit
        after launch) or its kernel did not run."""
        changed = set(late_slots) | reading.changed
        now_of: dict[int, Hyper] = {}  # per group, on the host: no device sync per chunk
        values: dict[int, list[int]] = {}  # id(checksums tensor) -> its values (one read each)

        def recorded(key: ViewKey, now: int) -> bool:  # the early kernel's checksum of key is now
            was = self._sums.get(key)
            if was is None:
                return False
            sums, i = was
            got = values.get(id(sums))
            if got is None:
                got = values[id(sums)] = sums.tolist()
            return got[i] == now

        for c, spec in launched.items():
            keys = [k for k in spec.views if k[0] in reading.grads and k not in reading.views]
            now = self._now(keys, reading, spec.weighted, records) if keys else []
            if spec.job.done is not None:
                wait(spec.job)
            stale_views = {k[0] for k, v in zip(keys, now) if not recorded(k, v)}
            stale_views |= {k[0] for k in spec.views if k in reading.views and not recorded(k, reading.views[k])}
            group = chunk_group(c)
            if group not in now_of:
                now_of[group] = on_host(hyper_now(group))
            yield c, bool(not spec.job.progress.kernel_ran or changed.intersection(spec.slots) or stale_views
                          or not same_hyper(spec.job.hyper, now_of[group]))

    def _now(self, keys: list[ViewKey], reading: GradReading, weighted: set[ViewKey],
             records: Sequence[ParamRecord]) -> list[int]:
        """The checksums of ``keys`` as the step would consume them now: the gradient views, plus
        the live weights' words for the ``weighted`` ones (as their kernels added them)."""
        sums = self._checksums([_view_of(reading.grads[s], a, b) for s, a, b in keys])
        idx = [i for i, k in enumerate(keys) if k in weighted]
        if idx:
            flat = {s: records[s].local().detach().reshape(-1) for s in {keys[i][0] for i in idx}}
            sums[idx] += self._checksums([flat[keys[i][0]][keys[i][1]:keys[i][2]] for i in idx])
        return sums.tolist()

    def publish_steps(self, slots: Collection[int] | None = None) -> None:
        """At ``step()``, once the early kernels ran: the step counters (of ``slots``; None: all)
        take what they counted (a chunk recomputed in ``step()`` then counts no step again: the
        worker counts each parameter once per step)."""
        for s, (step, _, counted) in self._steps.items():
            if slots is None or s in slots:
                step.copy_(counted)

    def reset_steps(self) -> None:
        """The step counters back to their values before this window (a step that did not
        happen); only after the pipeline drained."""
        for step, value, _ in self._steps.values():
            step.copy_(value)

    def close(self) -> None:
        """End the window: forget what it launched and read."""
        self._launched.clear()
        self._steps.clear()
        self._sums.clear()


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
