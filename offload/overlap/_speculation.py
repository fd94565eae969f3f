"""Speculative chunks: work started during backward is a guess, committed or undone at ``step()``.

With ``overlap_backward`` a chunk starts (``offload.overlap._hooks``) as soon as its gradients have
arrived, long before ``step()``. Between backward and ``step()`` a training loop may still change
what the step should consume: clip or unscale the gradients (torch's ``clip_grad_norm_``,
``GradScaler``), all-reduce them (DDP), run another backward, set the learning rate, skip the
step. So an early chunk is a *speculation*, and this module makes it one that is never wrong:

* before its kernel runs, the worker copies the chunk's master and moments into a backup buffer
  of the chunk (kept from step to step: the memory cost of speculation, 12 bytes per speculated
  element) and, for gradients on the host, records a checksum of every gradient it reads (on CUDA
  the checksum is taken on the device at launch, where it is cheap);
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
weighted lanes (elements 32 apart swapped) are not seen. The checksum of a parameter is
taken once per window, at the first early chunk holding it, over its whole gradient (final then:
a chunk starts only when all its parameters' hooks fired).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from offload.state._dtensor import local as _local
from offload.state._edits import stamp
from offload.pipeline._jobs import ChunkJob
from offload.kernels._adamw import Hyper
from offload.state._params import ParamRecord
from offload.state._slabs import SLAB_KINDS, Chunk, HostSlabs

logger = logging.getLogger(__name__)

__all__ = ["Speculation", "SpeculativeChunk", "checksums_of", "same_hyper"]

Checksums = Callable[[list[Tensor]], Tensor]
"""``checksums(tensors)``: a 1-D int64 tensor, one content checksum per tensor."""


def same_hyper(a: Hyper, b: Hyper) -> bool:
    """Would a kernel run with ``a`` give the bits of one run with ``b``?"""
    if (a.beta1, a.beta2, a.weight_decay, a.eps) != (b.beta1, b.beta2, b.weight_decay, b.eps):
        return False
    return (_same_value(a.lr, b.lr) and _same_scale(a.grad_coef, b.grad_coef)
            and _same_scale(a.grad_scale, b.grad_scale))


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
    """(slab view, backup view) pairs filled by the worker before the kernel."""


class Speculation:
    """Backups, checksums and step snapshots of one optimizer's early chunks (see module doc)."""

    def __init__(self, checksums: Checksums) -> None:
        self._checksums = checksums
        self._backup: dict[int, Tensor] = {}  # chunk index -> its backup buffer (3 x numel fp32)
        self._offsets: dict[int, dict[tuple[int, int], int]] = {}  # chunk -> view -> offset
        self._launched: dict[int, SpeculativeChunk] = {}
        self._steps0: dict[int, tuple[Tensor, Tensor]] = {}  # slot -> (step tensor, its value)
        self._sums: dict[int, Tensor] = {}  # slot -> checksum of the gradient read
        self._device_sums: dict[int, tuple[Tensor, Any]] = {}  # CUDA: (checksum at launch, its event)

    @property
    def backup_bytes(self) -> int:
        """Host bytes held by the backup buffers (12 per element of every chunk ever speculated)."""
        return sum(b.numel() * b.element_size() for b in self._backup.values())

    def forget_layout(self) -> None:
        """A new chunk layout or new slabs: the backup buffers describe the old one."""
        assert not self._launched, "forget_layout() with early chunks in flight"
        self._backup.clear()
        self._offsets.clear()

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
        cuda = [s for s in first if grads[s].device.type == "cuda"]
        if cuda:  # enqueued on the stream that produced the gradients: asynchronous, cheap
            sums = self._checksums([grads[s] for s in cuda])
            done = torch.cuda.Event()
            done.record()  # on this thread's stream (a DDP comm hook may run on another one)
            for s, v in zip(cuda, sums):
                self._device_sums[s] = (v, done)
        host = [s for s in first if grads[s].device.type != "cuda"]
        spec = SpeculativeChunk(job, tuple(grads), dict(grads),
                                {s: state[records[s].param]["step"] for s in grads},
                                {s: stamp(records[s]) for s in grads})
        self._launched[chunk.index] = spec
        job.before_kernel = lambda job, spec=spec, host=host, chunk=chunk: self._before_kernel(
            job, spec, host, chunk)

    def bind(self, slabs: HostSlabs) -> None:
        """The slabs the backups copy (set again after every relayout)."""
        self._slabs = slabs

    def _before_kernel(self, job: ChunkJob, spec: SpeculativeChunk, host: list[int], chunk: Chunk) -> None:
        """On the worker, right before the early kernel: checksums of the host gradients first
        (what the kernel is about to read), then the backup of the state it will write."""
        if host:
            sums = self._checksums([spec.grads[s] for s in host])
            for s, v in zip(host, sums):
                self._sums[s] = v
        buf = self._backup.get(chunk.index)
        if buf is None:
            buf = self._backup[chunk.index] = torch.empty(3 * chunk.numel, dtype=torch.float32)
            offsets, pos = {}, 0
            for v in chunk.views:
                offsets[(v.slot, v.start)] = pos
                pos += v.numel
            self._offsets[chunk.index] = offsets
        offsets = self._offsets[chunk.index]
        slabs, pairs = self._slabs, []
        for it in job.items:
            v = it.view
            at = offsets[(v.slot, v.start)]
            for k, kind in enumerate(SLAB_KINDS):
                src = slabs.view(kind, v)
                pairs.append((src, buf[k * chunk.numel + at : k * chunk.numel + at + v.numel]))
        torch._foreach_copy_([b for _, b in pairs], [s for s, _ in pairs])
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

    def stale_chunks(self, launched: Mapping[int, SpeculativeChunk], records: Sequence[ParamRecord],
                     hyper_now: Callable[[int], Hyper], chunk_group: Callable[[int], int],
                     late_slots: Iterable[int]) -> list[int]:
        """The early chunks whose work differs from what this step consumes (after a drain or
        not: reads only what the launch and the worker recorded before each kernel; the caller
        drains before reading a host checksum of a chunk whose kernel may not have run yet)."""
        slots = sorted({s for spec in launched.values() for s in spec.slots})
        changed = set(late_slots)
        now: dict[int, Tensor] = {}
        grads_now: list[Tensor] = []
        for s in slots:
            p = records[s].param
            g = None if p.grad is None else _local(p.grad)
            spec_g = next(spec.grads[s] for spec in launched.values() if s in spec.grads)
            if g is None or g.shape != spec_g.shape or g.dtype != spec_g.dtype or g.device != spec_g.device:
                changed.add(s)
            else:
                now[s] = g
                grads_now.append(g)
        if now:
            dev_slots: list[int] = []
            dev_now: list[Tensor] = []
            dev_was: list[Tensor] = []
            for s, v in zip(now, self._checksums(grads_now)):
                if s in self._device_sums:
                    was, done = self._device_sums[s]
                    # The launch's checksum is on its stream: ours waits for it on the device.
                    torch.cuda.current_stream(v.device).wait_event(done)
                    dev_slots.append(s)
                    dev_now.append(v)
                    dev_was.append(was)
                    continue
                was = self._sums.get(s)
                if was is None or not bool(torch.equal(v.cpu(), was.cpu())):  # host values: no sync
                    changed.add(s)
            if dev_slots:  # one host-device sync for all device checksums, not two per parameter
                differs = (torch.stack(dev_now) != torch.stack(dev_was)).tolist()
                changed.update(s for s, d in zip(dev_slots, differs) if d)
        stale = []
        for c, spec in sorted(launched.items()):
            if (not spec.job.kernel_ran or changed.intersection(spec.slots)
                    or not same_hyper(spec.job.hyper, hyper_now(chunk_group(c)))):
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


def checksums_of(grad_stats: Any) -> Checksums:
    """The checksum half of ``KernelSet.grad_stats`` (``offload.kernels._grad_stats``); a gradient that
    is not one dense block of memory (rare) is checksummed from a contiguous copy."""

    def checksums(tensors: list[Tensor]) -> Tensor:
        dense = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        return grad_stats(dense)[1]

    return checksums
