"""``overlap_backward``'s launcher: it starts chunks from the backward hooks as speculations
and, at ``step()``, commits them or undoes them (``offload.overlap._hooks`` says when a chunk's
gradients are all in, ``offload.overlap._speculation`` keeps the step counters and checks what
each chunk consumed).

A :class:`Launcher` lives as long as its optimizer. It is handed each layout and pipeline
(:meth:`Launcher.bind`: the host state it speculates on, the worker it submits to) and the
settings in force; of the optimizer itself it reads only what torch's ``Optimizer`` owns,
``state`` and ``param_groups`` (:class:`OptimizerState`), through a weak reference: the hooks
run between the optimizer's calls, when nothing hands them these, ``load_state_dict`` replaces
both, and the hooks live on the model's parameters and must not keep the optimizer alive. The optimizer asks it three things:
:meth:`Launcher.start_step` (which early chunks stand, and which slab segments were updated out
of place: the step commits them by a swap, :meth:`Launcher.finish_step`), :meth:`Launcher.abandon` (drop every early chunk: a
step that does not happen; the committed state was never written), :meth:`Launcher.end_step`
(the window closes, the grad scale used is remembered for the next speculation).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Callable, Protocol

import torch
from torch import Tensor

from offload._settings import OffloadSettings
from offload.overlap._hooks import GradHooks
from offload.overlap._speculation import Checksums, Speculation, SpeculativeChunk, same_hyper
from offload.pipeline._jobs import ChunkJob
from offload.pipeline._pipeline import Pipeline
from offload.pipeline._step import commit_generations, keep_views, part_stepped, write_job
from offload.state._edits import reseed
from offload.state._groups import hyper_of
from offload.state._items import fresh_items
from offload.state._layout import HostLayout
from offload.state._slabs import Chunk, StorageSwap

logger = logging.getLogger(__name__)

__all__ = ["PAUSE_AFTER_STALE_STEPS", "Launcher", "OptimizerState", "ddp_comm_hook"]

#: Steps in a row that redid every early chunk before speculation pauses (one is a changed lr or a
#: first clip; three in a row is a loop that clips every step, where early work only costs).
PAUSE_AFTER_STALE_STEPS = 3


class OptimizerState(Protocol):
    """What a :class:`Launcher` reads of its optimizer (torch's ``Optimizer`` owns both)."""

    state: Any
    param_groups: list[dict[str, Any]]


class Launcher:
    """The backward hooks, early launches and speculation of one optimizer (see module doc)."""

    def __init__(self, opt: OptimizerState, *, checksums: Checksums, settings: OffloadSettings) -> None:
        """``opt``: the optimizer (held weakly; its ``state`` and ``param_groups`` are read);
        ``settings``: the settings in force (set :attr:`settings` again when they change)."""
        self._opt = weakref.ref(opt)
        self._checksums = checksums
        self.settings = settings
        """The optimizer's settings in force (kernel and threads of the early jobs)."""
        self.external = False
        """Gradients come from a DDP comm hook (:func:`ddp_comm_hook`), not the autograd hooks."""
        self.paused = False
        """Speculation is paused (:meth:`_count_stale`): chunks run in ``step()`` until a step
        that would have committed."""
        self._stale_steps = 0  # steps in a row that redid every early chunk
        self._segments: set[int] = set()  # slab segments a chunk of this window was launched in
        self._committed: list[ChunkJob] = []  # the early jobs that stand (start_step)
        self._writes: list[ChunkJob] = []  # their weight writes, submitted by start_step
        self._grad_scale: Tensor | None = None  # the scale the last step used (GradScaler)
        self.layout: HostLayout | None = None
        self.pipeline: Pipeline | None = None
        self.hooks: GradHooks | None = None
        self.speculation = Speculation(checksums)
        self._lr_host: Tensor | None = None  # pinned, per chunk: a CUDA lr copied at launch
        self._prepared: tuple[int, int] | None = None  # (slabs, slots with state) prepare() last saw

    def bind(self, layout: HostLayout, pipeline: Pipeline) -> None:
        """A new layout (the first, or after a relayout): hooks on its parameters (the hook counts
        learned so far are kept: they live in the records), a new speculation for its chunks."""
        calibrated = self.hooks is not None and self.hooks.calibrated
        if self.hooks is not None:
            self.hooks.remove_hooks()
        self.layout, self.pipeline = layout, pipeline
        self.speculation = Speculation(self._checksums)
        self.hooks = GradHooks(layout.records, self._start_early, calibrated=calibrated)
        self.hooks.external = self.external
        self.hooks.set_chunks(layout.chunks)
        self._prepared = None
        self.prepare()

    def prepare(self) -> None:
        """Outside backward (a new layout, the end of a ``step()``, speculation switched on): the
        second generation of every segment whose chunks may start during the next backward
        (speculable, a parameter there has state), so no hook zero-fills it (12 bytes per element:
        seconds for a 7B model, inside backward). Nothing once every such segment has one. Also a
        CUDA lr's pinned places (:meth:`_lr_place`), for the same reason: page-locking synchronises
        the device, which a backward hook must not do."""
        layout = self.layout
        if layout is None:
            return
        self._reserve_lr()
        if not self.settings.speculate:
            return
        slabs = layout.slabs
        seen = (id(slabs), slabs.used.count(1))  # (a C count: no per-parameter Python each step)
        if seen == self._prepared:
            return
        self._prepared = seen
        pending = {seg for seg, ok in enumerate(slabs.speculable) if ok and not slabs.has_next(seg)}
        if pending:
            slabs.ensure_next(sorted({s.segment for s in slabs.slots if s.segment in pending and slabs.used[s.index]}))

    def rechunked(self) -> None:
        """The layout's chunks changed (another ``chunk_numel``): count the new ones."""
        assert self.hooks is not None and self.layout is not None
        self.hooks.set_chunks(self.layout.chunks)
        self.speculation.forget_layout()
        self._reserve_lr()

    def _reserve_lr(self) -> None:
        """Between steps: the pinned block of :meth:`_lr_place` for the current chunks, when a
        param group's lr is a tensor on the model's CUDA device (else nothing), so no hook makes it."""
        opt, layout = self._opt(), self.layout
        if opt is None or layout is None:
            return
        lrs = [g["lr"] for g in opt.param_groups if self._on_model_cuda(g.get("lr"))]
        if lrs:
            self._lr_block(len(layout.chunks), lrs[0].dtype)

    def _on_model_cuda(self, lr: Any) -> bool:
        """``lr`` is a tensor on the model's CUDA device (its copy can follow the chunk's ready event)."""
        assert self.layout is not None
        return isinstance(lr, Tensor) and lr.device.type == "cuda" and lr.device == self.layout.registry.device

    def _lr_block(self, n: int, dtype: torch.dtype) -> Tensor:
        if self._lr_host is None or self._lr_host.numel() < n or self._lr_host.dtype != dtype:
            self._lr_host = torch.empty(n, dtype=dtype, pin_memory=True)
        return self._lr_host

    def set_external(self) -> None:
        """Gradients arrive from DDP's comm hook from now on (``attach_ddp``)."""
        self.external = True
        if self.hooks is not None:
            self.hooks.external = True

    def remove_hooks(self) -> None:
        if self.hooks is not None:
            self.hooks.remove_hooks()

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        assert self.hooks is not None
        with self.hooks.accumulating():
            yield

    def has_launched(self) -> bool:
        """Some chunk of this window started during backward."""
        return self.speculation.has_launched()

    def late_edits(self) -> list[int]:
        """Slots of early chunks whose parameter was edited after the chunk started."""
        assert self.layout is not None
        return self.speculation.late_edits(self.layout.records)

    # ------------------------------------------------------------ from a backward hook
    def _start_early(self, chunk: Chunk, grads: dict[int, Tensor]) -> None:
        """Submit ``chunk``'s d2h + kernel as a speculation (under the hooks' lock)."""
        opt, layout, pipeline = self._opt(), self.layout, self.pipeline
        if opt is None or layout is None or pipeline is None or self.paused or not self.settings.speculate:
            return
        records, state = layout.records, opt.state
        if any(not state.get(records[slot].param) for slot in grads):
            return  # a parameter without state yet: step() runs the chunk
        if not layout.slabs.speculable[chunk.segment]:
            return  # past speculation_limit (no second generation there): step() runs the chunk
        reseed(records, layout.slabs, grads)  # an edit since the last step: the master follows it
        # The segment's second generation, where the early kernel writes: made outside backward
        # (prepare), so this finds it (12 bytes per element of the segment, kept from step to step).
        layout.slabs.ensure_next((chunk.segment,))
        self._segments.add(chunk.segment)
        group = opt.param_groups[chunk.group]
        hyper = replace(hyper_of(group, lr_into=self._lr_place(chunk, group["lr"])), grad_scale=self._grad_scale)
        items = fresh_items(chunk, grads, records, state, kernel=self.settings.kernel)
        ready, threads = pipeline.transport.ready_event(), self.backward_threads()
        job = self.speculation.launch(
            chunk, items, grads, records, state, host_weights=pipeline.transport.host_weights,
            job=lambda before_kernel: ChunkJob(
                chunk=chunk.index, items=items, hyper=hyper, threads=threads, update=True, materialize=False,
                into_next=True, done=threading.Event(), ready_event=ready, before_kernel=before_kernel))
        pipeline.submit(job)

    def backward_threads(self) -> int:
        """Intra-op threads of a chunk started during backward: ``settings.backward_threads``,
        never above ``settings.threads`` (the thread plan's budget), which it defaults to."""
        threads = self.settings.threads or 1
        return min(self.settings.backward_threads or threads, threads)

    def _lr_place(self, chunk: Chunk, lr: Any) -> Tensor | None:
        """For a CUDA lr: the pinned host place of ``chunk``'s copy (one block per layout, a place
        per chunk: a chunk launches once per window and the last window's jobs have drained), so
        the hook queues the copy before the chunk's ready event instead of waiting for it. An lr
        on another device than the model's: None (a blocking copy), since the ready event is
        recorded on the model's device and would not order a copy queued on the lr's."""
        assert self.layout is not None
        if not self._on_model_cuda(lr):
            return None
        # Made between steps (_reserve_lr); here only if groups' lrs differ in dtype.
        return self._lr_block(len(self.layout.chunks), lr.dtype)[chunk.index]

    # ------------------------------------------------------------ step()
    def start_step(self, *, hyper_now: Callable[[int], Any], late: Sequence[int], threads: int,
                   event: Any) -> tuple[dict[int, ChunkJob], int, set[int]]:
        """At ``step()``: judge the early chunks in the order they started and write the weights of
        each that stands as soon as it is known (``write_job``, ``Pipeline.write_committed``;
        ``event``: the step's ready event), so they land while the worker runs the last early
        kernels and the next chunk's gradients are read; returns (the early chunks that
        stand, how many were launched, the slab segments that were updated out of place).
        ``step()`` recomputes the others from the committed state, runs every chunk of those
        segments out of place too, and :meth:`finish_step` commits them by a swap."""
        opt, layout, pipeline = self._opt(), self.layout, self.pipeline
        assert opt is not None and layout is not None and pipeline is not None and self.hooks is not None
        self.hooks.end_window()
        launched = self.speculation.take()
        if launched:
            # Backward is over: an early kernel the worker has not started yet runs with the
            # drain's threads (read once, when the worker takes the job; either count is exact).
            pipeline.set_threads(threads)
        if not launched:
            if self.paused and self._would_commit(opt.param_groups, hyper_now):
                self.paused, self._stale_steps = False, 0
                logger.info("overlap_backward: speculation resumes (this step's hyper-parameters, clip "
                            "coefficient and grad scale are those an early chunk would have used)")
            return {}, 0, set()
        if self._step_counts_change(layout, opt.state, launched):
            self.abandon("step() (a gradient dropped or a step tensor replaced after backward)")
            return {}, len(launched), set()
        # Each chunk's gradients are read while the worker still runs the later early kernels
        # (both only read gradients) and compared once its own kernel ran.
        reading = self.speculation.read_now(launched, layout.records)
        groups = {c.index: c.group for c in layout.chunks}
        committed: dict[int, ChunkJob] = {}
        stale: list[int] = []
        for c, is_stale in self.speculation.verdicts(launched, layout.records, hyper_now, groups.__getitem__,
                                                     late, reading, wait=pipeline.wait_for):
            if is_stale:
                stale.append(c)
            else:
                committed[c] = launched[c].job
                self._writes.append(write_job(launched[c].job, threads=threads, event=event))
                pipeline.write_committed(self._writes[-1])
        self.speculation.publish_steps()  # every early kernel ran (verdicts waited for each)
        if stale:
            logger.debug("overlap_backward: %d of %d early chunks redone in step()", len(stale), len(launched))
        self._count_stale(len(stale) == len(launched))
        self._committed = list(committed.values())
        return committed, len(launched), set(self._segments)

    def _count_stale(self, all_stale: bool) -> None:
        """Pause speculating after :data:`PAUSE_AFTER_STALE_STEPS` steps in a row that redid every
        early chunk: then the early work is pure cost (clipping on every step: no chunk launched
        during backward knows the coefficient)."""
        self._stale_steps = self._stale_steps + 1 if all_stale else 0
        if self._stale_steps >= PAUSE_AFTER_STALE_STEPS and not self.paused:
            self.paused = True
            logger.info("overlap_backward: speculation paused: %d steps in a row redid every chunk started "
                        "during backward (a clip coefficient, a changed lr or grad scale, or gradients "
                        "changed after backward); it resumes at the first step that would have committed",
                        self._stale_steps)

    def _would_commit(self, param_groups: Sequence[dict[str, Any]], hyper_now: Callable[[int], Any]) -> bool:
        """Would a chunk launched during this backward have committed, as far as the step's
        hyper-parameters tell (the lr at backward, the last step's grad scale, no clip
        coefficient)? Changes of the gradients themselves cannot be told without speculating."""
        return all(same_hyper(replace(hyper_of(g), grad_scale=self._grad_scale), hyper_now(i))
                   for i, g in enumerate(param_groups))

    @staticmethod
    def _step_counts_change(layout: HostLayout, state: Any, launched: dict[int, SpeculativeChunk]) -> bool:
        """Would undoing only the stale chunks leave a step counter wrong? Yes when a parameter an
        early kernel counted has no gradient now (step() must not count it) or its step tensor
        was replaced (the early kernel counted the old one): then every early chunk is undone."""
        records = layout.records
        for spec in launched.values():
            for s in spec.slots:
                p = records[s].param
                st = state.get(p)
                if p.grad is None or not st or st.get("step") is not spec.steps[s]:
                    return True
        return False

    def abandon(self, what: str) -> None:
        """Drop every early chunk of the window (a step that does not happen, or not as they saw
        it: ``what`` was called between backward and ``step()``): the committed state was never
        written, the step counters go back to where the last step left them; the next ``step()``
        runs the chunks in full."""
        if not self.speculation.has_launched():
            return
        assert self.hooks is not None and self.pipeline is not None and self.layout is not None
        self.hooks.end_window()
        result = self.pipeline.drain()  # the early jobs are done, their step counts forgotten
        self.speculation.reset_steps()
        self.layout.items.release_grads()
        self.end_step(grad_scale=self._grad_scale)
        if result.error is not None:  # nothing of it remains; step() meets it again if it lasts
            logger.warning("CPUOffloadAdamW: a chunk started during backward failed (%s: %s); undone "
                           "at %s", type(result.error).__name__, result.error, what)

    def fail_start(self, what: str) -> list[int]:
        """``step()`` failed before its own jobs: where committed chunks' weights were submitted
        already, those chunks keep their update (state copied from the second generation, their
        parameters' counted steps), as an update in place that failed part-way would have; the
        rest is dropped (:meth:`abandon`). Returns the slots that left part-stepped
        (``part_stepped``)."""
        mixed: list[int] = []
        if self._writes:
            assert self.pipeline is not None and self.layout is not None
            result = self.pipeline.drain()
            done = [j for j in self._writes if j.progress.materialized]
            mixed = part_stepped(self.layout, [], self._writes, failed=True)
            keep_views(self.layout, [it.view for j in done for it in j.items])
            self.speculation.reset_steps()
            self.speculation.publish_steps({it.view.slot for j in done for it in j.items})
            self.layout.items.release_grads()
            self.end_step(grad_scale=self._grad_scale)
            if result.error is not None:
                logger.warning("CPUOffloadAdamW: a chunk failed while step() failed (%s: %s)",
                               type(result.error).__name__, result.error)
        self.abandon(what)
        return mixed

    def finish_step(self, *, segments: set[int], grads: Mapping[int, Tensor], updates: Sequence[ChunkJob],
                    error: bool, swap: StorageSwap | None, grad_scale: Tensor | None) -> list[int]:
        """After ``step()``'s drain (``updates``: its jobs; ``error``: one failed): commit the
        ``segments`` updated out of place (``commit_generations``), and close the window. Nothing
        of the step landed (no update ran, no committed weights written): the early chunks are
        dropped and the step counters put back. Returns the slots a failure left part-stepped
        (``part_stepped``)."""
        failed = error and not any(j.progress.kernel_ran for j in updates) and not any(
            j.progress.materialized for j in self._writes)
        mixed = part_stepped(self.layout, updates, self._writes, failed=failed) if error else []
        if segments:
            assert self.layout is not None
            commit_generations(self.layout, segments, grads, [*self._committed, *updates],
                               error=error, failed=failed, swap=swap)
        self.end_step(grad_scale=grad_scale, failed=failed)
        self.prepare()  # (the first step made the state: the next backward may start chunks)
        return mixed

    def end_step(self, *, grad_scale: Tensor | None, failed: bool = False) -> None:
        """The window closes; ``grad_scale``: what this step divided by (speculated next time);
        ``failed``: the step failed before any update (after its drain): the early chunks are
        dropped (their generation is not committed) and the step counters put back, so the state
        is the last step's."""
        if failed:
            self.speculation.reset_steps()
            grad_scale = self._grad_scale
        self.speculation.close()
        self._segments.clear()
        self._committed, self._writes = [], []
        if grad_scale is not None:
            grad_scale = grad_scale.detach().to("cpu", torch.float32).reshape(()).clone()
        self._grad_scale = grad_scale


def ddp_comm_hook(launcher: Launcher) -> Callable[[Any, Any], Any]:
    """A DDP communication hook for ``CPUOffloadAdamW.attach_ddp``: DDP's own reduction (each
    gradient multiplied by the reciprocal of the group's size, then summed over the group DDP was
    given), then, as each bucket's reduced gradients exist, hand them to the optimizer's overlap,
    so a chunk starts on the gradients ``step()`` will see (the autograd hooks fire before the
    all-reduce; a chunk started there is redone).

    torch's ``allreduce_hook`` divides instead, which differs from DDP without a hook in the last
    bit where the size is not a power of two (3 ranks: 34 tensors off by 1.5e-8), and falls back
    to the WORLD group when the hook state is None. DDP's reducer multiplies a gradient copied into
    its bucket by the reciprocal (``mul_out``) and divides one already in it (``div_``, with
    ``gradient_as_bucket_view=True`` after the first step); ``attach_ddp`` refuses that mode where
    the two differ."""
    import torch.distributed as dist

    ref = weakref.ref(launcher)
    # id(param) -> slot of the registry it was made for (held, so a later registry at the same
    # address is never taken for it)
    cache: list[Any] = [None, {}]

    def hook(process_group, bucket):  # type: ignore[no-untyped-def]  # DDP refuses string annotations
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        buffer.mul_(1.0 / dist.get_world_size(group))
        fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
        params, grads = bucket.parameters(), bucket.gradients()

        def reduced(f: Any) -> Any:
            early = ref()
            if early is not None and early.layout is not None and early.hooks is not None:
                registry, hooks = early.layout.registry, early.hooks
                if cache[0] is not registry:
                    cache[:] = [registry, {id(r.param): r.slot for r in registry.records}]
                slots = cache[1]
                for p, g in zip(params, grads):
                    slot = slots.get(id(p))
                    if slot is not None:
                        hooks.on_grad(slot, g.view(p.shape), external=True)
            return f.value()[0]

        return fut.then(reduced)

    return hook
