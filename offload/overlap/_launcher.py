"""``overlap_backward``'s side of the optimizer: launching chunks from backward hooks, and at
``step()`` committing them or undoing them (``offload.overlap._hooks`` counts the hooks,
``offload.overlap._speculation`` keeps the backups and checks what each chunk consumed).

:class:`EarlyWork` is part of ``CPUOffloadAdamW`` (it reads the optimizer's registry, slabs,
state and pipeline, held weakly: the hooks live on the model's parameters and must not keep the
optimizer alive). The optimizer asks it three things: :meth:`EarlyWork.start_step` (which early
chunks stand, with the stale ones already restored on the worker), :meth:`EarlyWork.abandon`
(undo every early chunk: a step that does not happen), :meth:`EarlyWork.end_step` (the window
closes, the grad scale used is remembered for the next speculation).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
from torch import Tensor

from offload.state._groups import hyper_of
from offload.state._items import fresh_items
from offload.pipeline._jobs import ChunkJob
from offload.overlap._hooks import BackwardOverlap
from offload.state._slabs import Chunk
from offload.overlap._speculation import Checksums, Speculation, SpeculativeChunk

if TYPE_CHECKING:
    from offload.state._edits import WeightEdits
    from offload.state._items import ItemCache
    from offload.state._params import ParamRegistry
    from offload.pipeline._pipeline import Pipeline
    from offload._settings import OffloadSettings
    from offload.state._slabs import HostSlabs

logger = logging.getLogger(__name__)

__all__ = ["EarlyWork", "OverlapHost", "ddp_comm_hook"]


class OverlapHost(Protocol):
    """What :class:`EarlyWork` and :func:`ddp_comm_hook` read of ``CPUOffloadAdamW`` (its parts,
    not copies: the optimizer replaces them on a relayout, so they are read at every use)."""

    state: Any
    param_groups: list[dict[str, Any]]
    _registry: ParamRegistry
    _slabs: HostSlabs
    _chunks: tuple[Chunk, ...]
    _edits: WeightEdits
    _settings: OffloadSettings
    _pipeline: Pipeline
    _items: ItemCache
    _overlap: EarlyWork | None

    def _ready_event(self) -> Any: ...


class EarlyWork:
    """The backward hooks, early launches and speculation of one optimizer (see module doc)."""

    def __init__(self, opt: OverlapHost, *, calibrated: bool, checksums: Checksums,
                 limit_numel: int | None, external: bool = False) -> None:
        """``opt``: the optimizer (held weakly); ``calibrated``: its records' hook counts are
        learned already (after a relayout); ``limit_numel``: at most this many elements are
        speculated per step (None: all), which bounds the backup memory at 12 bytes each."""
        self._opt = weakref.ref(opt)
        self.speculation = Speculation(checksums)
        self.speculation.bind(opt._slabs)
        self._limit = limit_numel
        self._numel = 0  # elements launched in this window
        self._grad_scale: Tensor | None = None  # the scale the last step used (GradScaler)
        self.overlap = BackwardOverlap(opt._registry.records, self._start_early, calibrated=calibrated)
        self.overlap.external = external  # gradients come from a DDP comm hook (ddp_comm_hook)
        self.overlap.set_chunks(opt._chunks)

    @property
    def calibrated(self) -> bool:
        return self.overlap.calibrated

    def set_chunks(self, chunks: tuple[Chunk, ...]) -> None:
        self.overlap.set_chunks(chunks)
        self.speculation.forget_layout()

    def remove_hooks(self) -> None:
        self.overlap.remove_hooks()

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        with self.overlap.accumulating():
            yield

    def has_launched(self) -> bool:
        return self.overlap.has_launched()

    # ------------------------------------------------------------ from a backward hook
    def _start_early(self, chunk: Chunk, grads: dict[int, Tensor]) -> ChunkJob | None:
        """Submit ``chunk``'s d2h + kernel as a speculation (under the overlap's lock)."""
        opt = self._opt()
        if opt is None:
            return None
        records = opt._registry.records
        if any(not opt.state.get(records[slot].param) for slot in grads):
            return None  # a parameter without state yet: step() runs the chunk
        if self._limit is not None and self._numel + chunk.numel > self._limit:
            return None  # over the speculation budget: step() runs the chunk
        self._numel += chunk.numel
        opt._edits.launch(records, opt._slabs, grads)
        hyper = replace(hyper_of(opt.param_groups[chunk.group]), grad_scale=self._grad_scale)
        items = fresh_items(chunk, grads, records, opt.state, kernel=opt._settings.kernel)
        job = ChunkJob(chunk=chunk.index, items=items, hyper=hyper, threads=opt._settings.threads or 1,
                       update=True, materialize=False,
                       ready_event=opt._ready_event())
        self.speculation.launch(chunk, job, grads, records, opt.state)
        opt._pipeline.submit(job)
        return job

    # ------------------------------------------------------------ step()
    def start_step(self, *, hyper_now: Callable[[int], Any], late: Sequence[int],
                   threads: int) -> tuple[dict[int, ChunkJob], int]:
        """At ``step()``: (the early chunks that stand, how many were launched). The others were
        restored on the worker; ``step()`` recomputes them from the committed state."""
        opt = self._opt()
        assert opt is not None
        self.overlap.end_window()
        launched = self.speculation.take()
        if not launched:
            return {}, 0
        opt._pipeline.on_worker(lambda: None, threads=1)  # the early kernels (and checksums) ran
        if self._step_counts_change(opt, launched):
            self.abandon("step() (a gradient dropped or a step tensor replaced after backward)",
                         threads=threads)
            return {}, len(launched)
        groups = {c.index: c.group for c in opt._chunks}
        stale = self.speculation.stale_chunks(launched, opt._registry.records, hyper_now,
                                              groups.__getitem__, late)
        if stale:
            opt._pipeline.on_worker(lambda: self.speculation.restore(stale), threads=threads)
            logger.debug("overlap_backward: %d of %d early chunks redone in step()", len(stale), len(launched))
        return {c: s.job for c, s in launched.items() if c not in stale}, len(launched)

    @staticmethod
    def _step_counts_change(opt: OverlapHost, launched: dict[int, SpeculativeChunk]) -> bool:
        """Would undoing only the stale chunks leave a step counter wrong? Yes when a parameter an
        early kernel counted has no gradient now (step() must not count it) or its step tensor
        was replaced (the early kernel counted the old one): then every early chunk is undone."""
        records = opt._registry.records
        for spec in launched.values():
            for s in spec.slots:
                p = records[s].param
                st = opt.state.get(p)
                if p.grad is None or not st or st.get("step") is not spec.steps[s]:
                    return True
        return False

    def abandon(self, what: str, *, threads: int) -> None:
        """Undo every early chunk of the window (a step that does not happen, or not as they saw
        it: ``what`` was called between backward and ``step()``): their state and the step
        counters are back where the last step left them; the next ``step()`` runs them in full."""
        opt = self._opt()
        assert opt is not None
        if not self.overlap.has_launched() and not self.speculation.take():
            return
        self.overlap.end_window()
        launched = self.speculation.take()
        if not launched:
            return
        result = opt._pipeline.drain()  # the early jobs are done, their step counts forgotten
        opt._pipeline.on_worker(lambda: self.speculation.restore(launched), threads=threads)
        self.speculation.reset_steps()
        opt._items.release_grads()
        self.end_step(grad_scale=self._grad_scale)
        if result.error is not None:  # nothing of it remains; step() meets it again if it lasts
            logger.warning("CPUOffloadAdamW: a chunk started during backward failed (%s: %s); undone "
                           "at %s", type(result.error).__name__, result.error, what)

    def end_step(self, *, grad_scale: Tensor | None, failed: bool = False) -> None:
        """The window closes; ``grad_scale``: what this step divided by (speculated next time);
        ``failed``: the step failed before any in-place update (after its drain): the early
        chunks are undone, so the state is the last step's."""
        if failed:
            self.speculation.restore(self.speculation.take())
            self.speculation.reset_steps()
            grad_scale = self._grad_scale
        self.speculation.close()
        self._numel = 0
        if grad_scale is not None:
            grad_scale = grad_scale.detach().to("cpu", torch.float32).reshape(()).clone()
        self._grad_scale = grad_scale


def ddp_comm_hook(opt: OverlapHost) -> Callable[[Any, Any], Any]:
    """A DDP communication hook for ``CPUOffloadAdamW.attach_ddp``: DDP's all-reduce (torch's
    ``allreduce_hook``: divide by the world size, sum), then, as each bucket's reduced gradients
    exist, hand them to the optimizer's overlap, so a chunk starts on the gradients ``step()``
    will see (the autograd hooks fire before the all-reduce; a chunk started there is redone)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ref = weakref.ref(opt)
    cache: dict[int, dict[int, int]] = {}  # id(registry) -> id(param) -> slot

    def hook(process_group, bucket):  # type: ignore[no-untyped-def]  # DDP refuses string annotations
        fut = allreduce_hook(process_group, bucket)
        params, grads = bucket.parameters(), bucket.gradients()

        def reduced(f: Any) -> Any:
            o = ref()
            early = None if o is None else o._overlap
            if early is not None:
                registry = o._registry
                slots = cache.get(id(registry))
                if slots is None:
                    cache.clear()
                    slots = cache[id(registry)] = {id(r.param): r.slot for r in registry.records}
                for p, g in zip(params, grads):
                    slot = slots.get(id(p))
                    if slot is not None:
                        early.overlap.on_grad(slot, g.view(p.shape), external=True)
            return f.value()

        return fut.then(reduced)

    return hook
