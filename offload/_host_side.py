"""``HostSide``: the half of ``CPUOffloadAdamW`` that keeps its host state in step with the model
and runs ``step()`` through it.

``CPUOffloadAdamW`` (``offload._optimizer``) derives from it and keeps the arguments, the param
groups, the settings and the public methods. Here: one ``step()`` (the gradients collected, edited
weights followed, the early chunks judged, the rest submitted, the drain, the stats), the masters
following weights edited between steps, and the relayouts (``HostLayout.build``) that hand the
layout, a new ``Pipeline`` and the ``Launcher`` the state carried over. Every entry point but
``step()`` and ``clip_grad_norm_`` first undoes the early chunks (``_check_idle``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from torch import Tensor
from torch.optim import Optimizer

from offload._settings import OffloadSettings
from offload.kernels._adamw import Hyper, Kernel, KernelSet
from offload.overlap._launcher import Launcher
from offload.pipeline._cuda_transport import STAGING_SLOTS, CudaTransport, DeviceOps
from offload.pipeline._host_transport import HostTransport
from offload.pipeline._pipeline import Pipeline
from offload.pipeline._signals import DeferredSignals
from offload.pipeline._step import StepJobs, collect_grads, part_stepped, submit_step
from offload.pipeline._timings import StatsBuilder
from offload.pipeline._transport import Transport
from offload.state._clip import ClipRequest, amp_arguments
from offload.state._edits import adopt_entries, check_edited_dtype, edited, record, replaced_entries, reseed
from offload.state._groups import hyper_of
from offload.state._items import LOWP_DTYPES
from offload.state._layout import NO_SEEDS, HostLayout, Relaid
from offload.state._masters import cast_seeds, drop_equal_masters, give_masters

__all__ = ["HostSide", "ring_depth"]


def ring_depth(settings: OffloadSettings) -> int:
    """The CUDA staging rings' slots per direction for ``settings`` (``ring_slots``, None: the
    transport's default)."""
    return STAGING_SLOTS if settings.ring_slots is None else settings.ring_slots


class HostSide(Optimizer):
    """The host state, pipeline and launcher of ``CPUOffloadAdamW`` and the step run through them
    (see the module doc); ``CPUOffloadAdamW.__init__`` sets every attribute named here."""

    _layout: HostLayout
    _pipeline: Pipeline
    _overlap: Launcher | None
    _kernels: KernelSet
    _device_ops: DeviceOps | None
    _device_timeout_s: float
    _settings: OffloadSettings
    _swap: Kernel | None
    _clip: ClipRequest | None
    _stats: StatsBuilder | None
    _in_step: bool
    _broken: str | None

    def _new_pipeline(self) -> Pipeline:
        """A worker for the current layout, over the transport of the parameters' device (the CUDA
        one also for CPU parameters where device operations were handed in: ``device_ops=``)."""
        transport: Transport
        device = self._layout.registry.device
        if device.type == "cuda" or self._device_ops is not None:
            own = next((s.index for s in self._layout.slabs.slots if s.own_master), None)
            if own is not None:  # (only CPU fp32 parameters are their own masters)
                raise ValueError(
                    f"device_ops= with parameters on the CPU: {self._layout.records[own].name} is fp32, its own "
                    "master there, and the CUDA path needs a master place for every parameter; expected "
                    "bf16/fp16 parameters (or parameters on a CUDA device)")
            transport = CudaTransport(device, slots=ring_depth(self._settings), ops=self._device_ops,
                                      timeout_s=self._device_timeout_s)
        else:
            transport = HostTransport(copy=self._kernels.copy)
        pipeline = Pipeline(self._layout.slabs, transport, name=f"offload-adamw-{id(self):x}", kernels=self._kernels)
        self._reserve_staging(pipeline)
        return pipeline

    def _reserve_staging(self, pipeline: Pipeline) -> None:
        """The CUDA transport's pinned blocks for the current layout, ring depth and kernel, made
        now on the idle worker (``Pipeline.reserve``): a new pipeline, chunk size, depth or kernel.
        Page-locking synchronises the device (a known hang beside NCCL launches on other ranks),
        so no step makes a block, least of all an early chunk during an overlapped backward;
        the places of early weights are for bf16/fp16 parameters that fused-mp may start early."""
        if isinstance(pipeline.transport, HostTransport):
            return
        layout, settings = self._layout, self._settings
        locals_ = [rec.local() for rec in layout.records]
        places = {}
        if layout.overlap_backward and settings.speculate and settings.kernel == "fused-mp":
            slabs = layout.slabs
            places = {slot: (t.numel(), t.dtype) for slot, t in enumerate(locals_)
                      if t.dtype in LOWP_DTYPES and t.numel() and slabs.speculable[slabs.slots[slot].segment]}
        pipeline.reserve(layout.chunks, [t.dtype for t in locals_], places)

    def _relayout(self, seeds: Mapping[int, Tensor] = NO_SEEDS) -> Relaid:
        """A new layout for the current groups, with the state carried over (after
        ``add_param_group``, a master place given or dropped, parameters re-bound in
        ``param_groups``: ``HostLayout.build``), and a worker and hooks for it. ``seeds``: the fp32
        values of slots that were their own master and now get a master place."""
        relaid = HostLayout.build(self.param_groups, self.state, previous=self._layout, seeds=seeds,
                                  chunk_numel=self._settings.chunk_numel,
                                  overlap_backward=self._layout.overlap_backward,
                                  speculable=self._layout.speculable, state_dtype=self._layout.state_dtype,
                                  rounding_seed=self._layout.rounding_seed)
        self.state.clear()
        self.state.update(relaid.entries)
        record(relaid.layout.records, relaid.migrated)  # their masters were just seeded from them
        self._layout = relaid.layout
        self._pipeline.close()
        self._pipeline = self._new_pipeline()
        if self._overlap is not None:
            self._overlap.bind(self._layout, self._pipeline)
        return relaid

    def _step(self, signals: DeferredSignals) -> None:
        """The body of ``step()`` (under ``no_grad``): skip a GradScaler overflow; else collect the
        gradients, follow edits, judge the early chunks, submit the rest, drain, commit, stats.
        ``signals``: those held during the step; one that arrives again cuts the step short
        (``StepInterrupted``, raised after the drain; ``offload.pipeline._signals``)."""
        t0 = time.perf_counter()
        threads = self._settings.threads
        assert threads is not None
        clip, self._clip = self._clip, None
        scale, found_inf = amp_arguments(self)
        early = self._overlap
        if found_inf is not None and bool(found_inf.to("cpu").reshape(-1)[0]):
            # GradScaler found inf/nan: nothing changes (torch's fused AdamW skips the same way).
            self._abandon_early("step() (GradScaler overflow)")
            collect_grads(self._layout, self.state, count_empty=False)  # state for new parameters, as torch makes it
            self._stats = StatsBuilder([], t0, step_s=time.perf_counter() - t0, drain_s=0.0, threads=threads,
                                       chunk_numel=self._settings.chunk_numel, num_chunks=0, numel=0)
            return
        coef = None if clip is None else clip.coef

        hypers: dict[int, Hyper] = {}  # per group, read once per step (a device lr: one sync)

        def hyper_now(group: int) -> Hyper:
            if group not in hypers:
                hypers[group] = replace(hyper_of(self.param_groups[group]), grad_coef=coef, grad_scale=scale)
            return hypers[group]

        event = self._pipeline.transport.ready_event()
        # From here until the step's state is consistent again, an exception that escapes the
        # handlers below (one raised asynchronously into this thread) leaves this mark, and the
        # optimizer refuses to go on.
        self._broken = "step() was interrupted part-way by an asynchronous exception"
        try:
            grads = collect_grads(self._layout, self.state)
            unseen = self._layout.device_weights.changed(self._layout.records, grads)  # CUDA: .data edits
            late = sorted({*early.late_edits(), *unseen}) if early is not None else []
            if late or self._layout.recheck_masters:
                self._abandon_early("step() (weights edited after backward started chunks)")
            # Edits of parameters no early chunk holds (the others were just abandoned): before the
            # early chunks are judged, since a committed chunk's weights are written at once.
            self._follow_edits(grads, unseen)
            committed, speculated, out_of_place = early.start_step(
                hyper_now=hyper_now, late=late, threads=threads, event=event) if early is not None else ({}, 0, set())
        except BaseException as exc:
            mixed = early.fail_start("step() (an error)") if early is not None else []
            self._broken = None
            self._mark_mixed(mixed, exc)
            raise

        layout = self._layout
        sub = StepJobs()
        error: BaseException | None = None
        pipeline = self._pipeline
        signals.on_repeat = functools.partial(pipeline.cancel, pipeline.step_index)
        try:
            submit_step(pipeline, layout, committed, grads, self.state, hyper_now=hyper_now,
                        kernel=self._settings.kernel, threads=threads, event=event, out_of_place=out_of_place,
                        out=sub)
            result = pipeline.drain()
        except BaseException as exc:  # on this thread: the worker finishes what was queued first
            error = exc
            result = pipeline.drain()
        finally:
            signals.on_repeat = None
        error = error or result.error
        layout.items.release_grads()
        if early is not None:  # commits the out-of-place segments; a step where nothing landed drops them
            mixed = early.finish_step(segments=out_of_place, grads=grads, updates=sub.updates,
                                      error=error is not None, swap=self._swap, grad_scale=scale)
        else:
            mixed = part_stepped(layout, sub.updates, (), failed=False) if error is not None else []
        self._broken = None
        # (the drain ordered the caller's stream after the weight copies that landed: order_caller)
        if error is not None:
            self._mark_mixed(mixed, error)
            raise error
        record(layout.records, grads)  # our writes bumped the versions
        layout.device_weights.record(layout.records, grads)  # (CUDA, after the copies: no sync)
        t1 = time.perf_counter()
        self._stats = StatsBuilder(
            result.records, t0, step_s=t1 - t0, drain_s=result.wait_s, threads=threads,
            chunk_numel=self._settings.chunk_numel, num_chunks=sub.chunks, numel=sub.numel,
            kernel="fused-mp" if sub.native else "torch", speculated_chunks=speculated,
            committed_chunks=len(committed), speculation_paused=early is not None and early.paused,
            pinned_bytes=result.pinned_bytes, pinned_registrations=result.pinned_registrations)

    def _mark_mixed(self, slots: Sequence[int], error: BaseException) -> None:
        """A failed step left ``slots`` part-stepped: every later call refuses (``_refuse_broken``)
        until a state dict is loaded, as a checkpoint taken now would hold the mix."""
        if not slots:
            return
        records = self._layout.records
        names = ", ".join(records[s].name for s in slots[:4]) + (f" and {len(slots) - 4} more" if len(slots) > 4 else "")
        self._broken = (f"step() failed part-way ({type(error).__name__}: {error}) and left {len(slots)} "
                        f"parameter(s) part-stepped ({names}): some of their elements, or their master and "
                        "weight, come from different steps")

    def _refuse_broken(self, what: str) -> None:
        """``RuntimeError`` while a failed step left a mixed state (``_mark_mixed``)."""
        if self._broken is not None:
            raise RuntimeError(f"CPUOffloadAdamW.{what} refused: {self._broken}; load a checkpoint with "
                               "load_state_dict() (or make a new optimizer) to go on")

    def _follow_edits(self, grads: dict[int, Tensor], unseen: Sequence[int] = ()) -> None:
        """Parameters edited since our last write: their masters follow them (``offload.state._edits``;
        ``unseen``: device weights whose content changed, ``offload.state._device_edits``); masters
        loaded by ``load_state_dict`` are checked against their parameters."""
        layout = self._layout
        if layout.recheck_masters:
            slots, layout.recheck_masters = layout.recheck_masters, set()
            if drop_equal_masters(layout.records, layout.slabs, slots):
                self._relayout()
        self._sync_edits(grads)
        if unseen:
            reseed(self._layout.records, self._layout.slabs, (), also=unseen)

    def _sync_edits(self, slots: Iterable[int]) -> None:
        """The edited parameters among ``slots``: their masters follow them, and their state
        entries are made again (they name the current tensors, and the cached Items and kernel
        calls of their chunks are rebuilt: ``.data`` may be new storage). A parameter that was
        its own master and is no longer fp32 (``model.to(torch.bfloat16)``) first gets a master,
        seeded from its fp32 storage before the change."""
        changed = edited(self._layout.records, slots)
        if not changed:
            return
        for slot in changed:  # model.double(): refused before the casts and the relayout below
            check_edited_dtype(self._layout.records[slot])
        cast = cast_seeds(self._layout.records, self._layout.slabs, self.state, changed)
        if cast:
            give_masters(self._layout.records, cast)
            self._relayout(cast)
        layout = self._layout
        reseed(layout.records, layout.slabs, changed)
        for slot in changed:
            p = layout.records[slot].param
            self.state[p].update(layout.entry(slot, self.state[p]["step"]))

    def _check_idle(self, what: str, *, adopt: bool = True) -> None:
        """Between steps only; undo early chunks, take replaced state tensors in (``adopt``: not
        for ``load_state_dict``, which replaces the whole state: DCP hands it entries that alias
        the live ones), follow re-bound param groups."""
        if self._in_step:
            raise RuntimeError(f"CPUOffloadAdamW.{what} called while step() is running")
        self._abandon_early(what)
        if adopt:
            self._adopt_replaced_state()
        self._follow_groups()

    def _adopt_replaced_state(self) -> None:
        """State tensors replaced by assignment since they were made: their values go into the
        slabs (``offload.state._edits.adopt_entries``), after the early chunks (which read the old
        ones) are undone, before any relayout copies the slabs."""
        replaced = replaced_entries(self._layout.records, self.state)
        if replaced:
            self._abandon_early("a replaced optimizer.state entry")
            adopt_entries(self._layout, self.state, replaced)

    def _abandon_early(self, what: str) -> None:
        """Undo the chunks started during backward (a call between backward and step())."""
        if self._overlap is not None:
            self._overlap.abandon(what)
