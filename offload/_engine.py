"""``HostEngine``: the host state of one ``CPUOffloadAdamW``, kept in step with the model, and
``step()`` run through it.

``CPUOffloadAdamW`` (``offload._optimizer``) is a ``torch.optim.Optimizer`` that holds one engine,
as torch's ``FSDPParamGroup`` holds its ``FSDPParam``s: the optimizer keeps the arguments, the
param groups and ``state`` (torch's ``Optimizer`` owns them; every call here is handed them) and
the public methods; the engine owns the rest. It holds the layout (``HostLayout``: records,
slabs, chunks, items; the only one that writes them, through the layout's own methods), the
pipeline over the device's transport, with ``overlap_backward`` the ``Launcher``, the settings in
force, the NUMA placement, and it collects each step's gradients (:meth:`HostEngine.collect_grads`).
Here: one ``step()`` (the gradients collected, edited weights followed, the early chunks judged,
the rest submitted, the drain, the stats), the masters following weights edited between steps,
the relayouts (``HostLayout.build``) that hand the layout, a new ``Pipeline`` and the
``Launcher`` the state carried over, settings switched between steps, and the mark a step that
failed part-way leaves. The optimizer's entry points but ``step()`` and ``clip_grad_norm_`` first
undo the early chunks (:meth:`HostEngine.abandon_early`).

The engine holds no reference to the optimizer. Its ``Launcher`` holds one, weakly, to read
``state`` and ``param_groups`` from the backward hooks, between the optimizer's calls
(``offload.overlap._launcher``): torch's ``Optimizer`` owns those two attributes, and
``load_state_dict`` (ours, or a framework's) replaces them.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from offload._settings import OffloadSettings
from offload.kernels._adamw import Hyper, Kernel, KernelSet
from offload.overlap._launcher import Launcher, OptimizerState, ddp_comm_hook
from offload.overlap._speculation import checksums_of
from offload.pipeline._cuda_transport import STAGING_SLOTS, CudaTransport, DeviceOps
from offload.pipeline._host_transport import HostTransport
from offload.pipeline._pipeline import Pipeline
from offload.pipeline._signals import DeferredSignals, StepInterrupted
from offload.pipeline._step import StepJobs, part_stepped, submit_step
from offload.pipeline._timings import StatsBuilder
from offload.pipeline._transport import Transport
from offload.state._clip import ClipRequest, NonFiniteNorm, amp_arguments, clip_request
from offload.state._edits import adopt_entries, check_edited_dtype, edited, record, replaced_entries, reseed
from offload.state._groups import hyper_of
from offload.state._items import LOWP_DTYPES
from offload.state._layout import NO_SEEDS, HostLayout, Relaid
from offload.state._masters import cast_seeds, drop_equal_masters, give_masters, loaded_seeds
from offload.state._params import check_grad, raise_bad_grad
from offload.state._placement import NumaPlacement, NumaSwitch
from offload.state._state_io import LoadedState, load_state

__all__ = ["HostEngine", "ring_depth"]

Groups = Sequence[dict[str, Any]]
"""The optimizer's ``param_groups`` (torch's ``Optimizer`` owns them)."""
State = dict[Tensor, dict[str, Any]]
"""The optimizer's ``state`` (torch's ``Optimizer`` owns the dict; the engine fills it)."""


def ring_depth(settings: OffloadSettings) -> int:
    """The CUDA staging rings' slots per direction for ``settings`` (``ring_slots``, None: the
    transport's default)."""
    return STAGING_SLOTS if settings.ring_slots is None else settings.ring_slots


class HostEngine:
    """The host state, pipeline and launcher of one ``CPUOffloadAdamW`` and the step run through
    them (see the module doc)."""

    def __init__(self, layout: HostLayout, *, settings: OffloadSettings, kernels: KernelSet,
                 device_ops: DeviceOps | None, device_timeout_s: float, numa: NumaSwitch,
                 placement: NumaPlacement | None, owner: OptimizerState, name: str) -> None:
        """``layout``: the first layout (built by the optimizer, after ``numa`` bound it where
        ``bind_numa`` is on: ``placement``, whose pages the worker first touches); ``settings``:
        resolved (threads an int, the kernel chosen); ``owner``: the optimizer, for the
        ``Launcher`` only (held weakly there, see the module doc); ``name``: the worker thread's."""
        self.layout = layout
        """The host state (one ``HostLayout``; a relayout replaces it)."""
        self.kernels = kernels
        self.settings = settings
        """The settings in force (``threads`` resolved to an int, ``kernel`` chosen)."""
        self.device_ops = device_ops
        self.device_timeout_s = device_timeout_s
        self.numa = numa
        self._name = name
        self.pipeline = self._new_pipeline()
        if placement is not None:  # the pages land on the node of the CPUs that run the kernels
            self.pipeline.on_worker(functools.partial(placement.first_touch, layout.slabs),
                                    threads=settings.threads)
        self.in_step = False
        """``step()`` is running (every other entry point refuses)."""
        self.broken: str | None = None
        """Why the optimizer refuses to go on (a step left a mixed state), or None."""
        self.stats: StatsBuilder | None = None
        """The stage times of the last step (built on demand)."""
        self.clip: ClipRequest | None = None
        """Set by ``clip_grad_norm_``, taken by the next step."""
        self.overlap: Launcher | None = None
        """With ``overlap_backward``: the launcher of chunks during backward."""
        self.swap: Kernel | None = kernels.storage_swap() if layout.overlap_backward else None
        """How a step that updated out of place commits (``overlap_backward``): the native
        storage swap, or None (no extension: a copy)."""
        if layout.overlap_backward:
            self.overlap = Launcher(owner, checksums=checksums_of(kernels), settings=settings)
            self.overlap.bind(layout, self.pipeline)

    # ---------------------------------------------------------------- pipeline and relayouts
    def _new_pipeline(self) -> Pipeline:
        """A worker for the current layout, over the transport of the parameters' device (the CUDA
        one also for CPU parameters where device operations were handed in: ``device_ops=``)."""
        transport: Transport
        device = self.layout.registry.device
        if device.type == "cuda" or self.device_ops is not None:
            own = next((s.index for s in self.layout.slabs.slots if s.own_master), None)
            if own is not None:  # (only CPU fp32 parameters are their own masters)
                raise ValueError(
                    f"device_ops= with parameters on the CPU: {self.layout.records[own].name} is fp32, its own "
                    "master there, and the CUDA path needs a master place for every parameter; expected "
                    "bf16/fp16 parameters (or parameters on a CUDA device)")
            transport = CudaTransport(device, slots=ring_depth(self.settings), ops=self.device_ops,
                                      timeout_s=self.device_timeout_s)
        else:
            transport = HostTransport(copy=self.kernels.copy)
        pipeline = Pipeline(self.layout.slabs, transport, name=self._name, kernels=self.kernels)
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
        layout, settings = self.layout, self.settings
        locals_ = [rec.local() for rec in layout.records]
        places = {}
        if layout.overlap_backward and settings.speculate and settings.kernel == "fused-mp":
            slabs = layout.slabs
            places = {slot: (t.numel(), t.dtype) for slot, t in enumerate(locals_)
                      if t.dtype in LOWP_DTYPES and t.numel() and slabs.speculable[slabs.slots[slot].segment]}
        pipeline.reserve(layout.chunks, [t.dtype for t in locals_], places)

    def relayout(self, groups: Groups, state: State, seeds: Mapping[int, Tensor] = NO_SEEDS) -> Relaid:
        """A new layout for the current ``groups``, with the state carried over (after
        ``add_param_group``, a master place given or dropped, parameters re-bound in
        ``param_groups``: ``HostLayout.build``) and put into ``state``, and a worker and hooks for
        it. ``seeds``: the fp32 values of slots that were their own master and now get a master
        place."""
        relaid = HostLayout.build(groups, state, previous=self.layout, seeds=seeds,
                                  chunk_numel=self.settings.chunk_numel,
                                  overlap_backward=self.layout.overlap_backward,
                                  speculable=self.layout.speculable, state_dtype=self.layout.state_dtype,
                                  rounding_seed=self.layout.rounding_seed)
        state.clear()
        state.update(relaid.entries)
        record(relaid.layout.records, relaid.migrated)  # their masters were just seeded from them
        self.layout = relaid.layout
        self.pipeline.close()
        self.pipeline = self._new_pipeline()
        if self.overlap is not None:
            self.overlap.bind(self.layout, self.pipeline)
        return relaid

    def load(self, groups: Groups, state: State, entries: LoadedState) -> State:
        """``load_state_dict``'s checked ``entries`` (``check_loaded``) in the slabs: the new
        ``optimizer.state``. A loaded master with bits its parameter lacks (a bf16 run resumed in
        fp32, or the model not loaded yet) needs a master place where the parameter was its own
        master; the next step drops the place again where the parameter then equals it."""
        layout = self.layout
        seeds = loaded_seeds(layout.records, layout.slabs, entries)
        if seeds:
            give_masters(layout.records, seeds)
            layout = self.relayout(groups, state, seeds).layout
        layout.recheck_masters.update(slot for slot, value in entries if "master_param" in value)
        return load_state(entries, layout)

    # ---------------------------------------------------------------- step
    def step(self, groups: Groups, state: State, *, grad_scale: Tensor | None, found_inf: Tensor | None,
             observe: Callable[[], None] | None = None) -> None:
        """One step over ``groups`` (``grad_scale``, ``found_inf``: what ``GradScaler.step`` set on
        the optimizer), then ``observe()`` (the tuner's observation point). A signal whose handler
        raises would leave the step part-way: it is held until the step and the observation are
        done (``offload.pipeline._signals``), then its handler runs and what that raises leaves
        ``step()``. The same signal again cuts the step short."""
        with DeferredSignals() as signals:
            self.in_step = True
            try:
                with torch.no_grad():
                    self._step(groups, state, signals, grad_scale, found_inf)
            except StepInterrupted:
                return  # the held signal's handler runs as the block exits
            finally:
                self.in_step = False
            if observe is not None:
                observe()

    def _step(self, groups: Groups, state: State, signals: DeferredSignals, grad_scale: Tensor | None,
              found_inf: Tensor | None) -> None:
        """The body of ``step()`` (under ``no_grad``): skip a GradScaler overflow; else collect the
        gradients, follow edits, judge the early chunks, submit the rest, drain, commit, stats.
        ``signals``: those held during the step; one that arrives again cuts the step short
        (``StepInterrupted``, raised after the drain; ``offload.pipeline._signals``)."""
        t0 = time.perf_counter()
        threads = self.settings.threads
        assert threads is not None
        clip, self.clip = self.clip, None
        scale, found_inf = amp_arguments(grad_scale, found_inf)
        early = self.overlap
        if found_inf is not None and bool(found_inf.to("cpu").reshape(-1)[0]):
            # GradScaler found inf/nan: nothing changes (torch's fused AdamW skips the same way).
            self.abandon_early("step() (GradScaler overflow)")
            self.collect_grads(state, count_empty=False)  # state for new parameters, as torch makes it
            self.stats = StatsBuilder([], t0, step_s=time.perf_counter() - t0, drain_s=0.0, threads=threads,
                                      chunk_numel=self.settings.chunk_numel, num_chunks=0, numel=0)
            return
        coef = None if clip is None else clip.coef

        hypers: dict[int, Hyper] = {}  # per group, read once per step (a device lr: one sync)

        def hyper_now(group: int) -> Hyper:
            if group not in hypers:
                hypers[group] = replace(hyper_of(groups[group]), grad_coef=coef, grad_scale=scale)
            return hypers[group]

        event = self.pipeline.transport.ready_event()
        # From here until the step's state is consistent again, an exception that escapes the
        # handlers below (one raised asynchronously into this thread) leaves this mark, and the
        # optimizer refuses to go on.
        self.broken = "step() was interrupted part-way by an asynchronous exception"
        try:
            grads = self.collect_grads(state)
            unseen = self.layout.device_weights.changed(self.layout.records, grads)  # CUDA: .data edits
            late = sorted({*early.late_edits(), *unseen}) if early is not None else []
            if late or self.layout.recheck_masters:
                self.abandon_early("step() (weights edited after backward started chunks)")
            # Edits of parameters no early chunk holds (the others were just abandoned): before the
            # early chunks are judged, since a committed chunk's weights are written at once.
            self.follow_edits(groups, state, grads, unseen)
            committed, speculated, out_of_place = early.start_step(
                hyper_now=hyper_now, late=late, threads=threads, event=event) if early is not None else ({}, 0, set())
        except BaseException as exc:
            mixed = early.fail_start("step() (an error)") if early is not None else []
            self.broken = None
            self._mark_mixed(mixed, exc)
            raise

        layout = self.layout
        sub = StepJobs()
        error: BaseException | None = None
        pipeline = self.pipeline
        signals.on_repeat = functools.partial(pipeline.cancel, pipeline.step_index)
        try:
            submit_step(pipeline, layout, committed, grads, state, hyper_now=hyper_now,
                        kernel=self.settings.kernel, threads=threads, event=event, out_of_place=out_of_place,
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
                                      error=error is not None, swap=self.swap, grad_scale=scale)
        else:
            mixed = part_stepped(layout, sub.updates, (), failed=False) if error is not None else []
        self.broken = None
        # (the drain ordered the caller's stream after the weight copies that landed: order_caller)
        if error is not None:
            self._mark_mixed(mixed, error)
            raise error
        record(layout.records, grads)  # our writes bumped the versions
        layout.device_weights.record(layout.records, grads)  # (CUDA, after the copies: no sync)
        t1 = time.perf_counter()
        self.stats = StatsBuilder(
            result.records, t0, step_s=t1 - t0, drain_s=result.wait_s, threads=threads,
            chunk_numel=self.settings.chunk_numel, num_chunks=sub.chunks, numel=sub.numel,
            kernel="fused-mp" if sub.native else "torch", speculated_chunks=speculated,
            committed_chunks=len(committed), speculation_paused=early is not None and early.paused,
            pinned_bytes=result.pinned_bytes, pinned_registrations=result.pinned_registrations)

    def collect_grads(self, state: State, *, count_empty: bool = True) -> dict[int, Tensor]:
        """The gradients of this step by slot (this rank's shards); the first state entry of a
        parameter without one goes into ``state``; ``count_empty``: count the step of an empty
        shard (in no chunk) as torch does."""
        layout = self.layout
        grads: dict[int, Tensor] = {}
        for rec in layout.records:
            param = rec.param
            if param.grad is None:
                continue
            slot = rec.slot
            if rec.layout is not None:  # a DTensor: its gradient must have its placements (not Partial)
                check_grad(rec, param.grad)
            p, g = rec.local(), rec.grad_of(param.grad)
            # .data may have been replaced since construction (contiguity was checked there)
            if g.is_sparse or not p.is_contiguous() or g.device != p.device or g.shape != p.shape:
                raise_bad_grad(slot, p, g)
            st = state[param]
            if not st:
                st.update(layout.first_entry(rec))
            elif st.get("step") is not rec.step:
                layout.replace_step(rec, st.get("step"))  # the user replaced it (as torch's AdamW allows)
            if count_empty and p.numel() == 0:
                state[param]["step"] += 1
            grads[slot] = g
        return grads

    def _mark_mixed(self, slots: Sequence[int], error: BaseException) -> None:
        """A failed step left ``slots`` part-stepped: every later call refuses (:meth:`refuse_broken`)
        until a state dict is loaded, as a checkpoint taken now would hold the mix."""
        if not slots:
            return
        records = self.layout.records
        names = ", ".join(records[s].name for s in slots[:4]) + (f" and {len(slots) - 4} more" if len(slots) > 4 else "")
        self.broken = (f"step() failed part-way ({type(error).__name__}: {error}) and left {len(slots)} "
                       f"parameter(s) part-stepped ({names}): some of their elements, or their master and "
                       "weight, come from different steps")

    def refuse_broken(self, what: str) -> None:
        """``RuntimeError`` while a failed step left a mixed state (``_mark_mixed``)."""
        if self.broken is not None:
            raise RuntimeError(f"CPUOffloadAdamW.{what} refused: {self.broken}; load a checkpoint with "
                               "load_state_dict() (or make a new optimizer) to go on")

    def loaded(self) -> None:
        """A state dict was loaded: whatever a failed step left, it replaced."""
        self.broken = None

    # ---------------------------------------------------------------- edits between steps
    def follow_edits(self, groups: Groups, state: State, grads: dict[int, Tensor],
                     unseen: Sequence[int] = ()) -> None:
        """Parameters edited since our last write: their masters follow them (``offload.state._edits``;
        ``unseen``: device weights whose content changed, ``offload.state._device_edits``); masters
        loaded by ``load_state_dict`` are checked against their parameters."""
        layout = self.layout
        if layout.recheck_masters:
            slots, layout.recheck_masters = layout.recheck_masters, set()
            if drop_equal_masters(layout.records, layout.slabs, slots):
                self.relayout(groups, state)
        self.sync_edits(groups, state, grads)
        if unseen:
            reseed(self.layout.records, self.layout.slabs, (), also=unseen)

    def sync_edits(self, groups: Groups, state: State, slots: Iterable[int]) -> None:
        """The edited parameters among ``slots``: their masters follow them, and their state
        entries are made again (they name the current tensors, and the cached Items and kernel
        calls of their chunks are rebuilt: ``.data`` may be new storage). A parameter that was
        its own master and is no longer fp32 (``model.to(torch.bfloat16)``) first gets a master,
        seeded from its fp32 storage before the change."""
        changed = edited(self.layout.records, slots)
        if not changed:
            return
        for slot in changed:  # model.double(): refused before the casts and the relayout below
            check_edited_dtype(self.layout.records[slot])
        cast = cast_seeds(self.layout.records, self.layout.slabs, state, changed)
        if cast:
            give_masters(self.layout.records, cast)
            self.relayout(groups, state, cast)
        layout = self.layout
        reseed(layout.records, layout.slabs, changed)
        for slot in changed:
            p = layout.records[slot].param
            state[p].update(layout.entry(slot, state[p]["step"]))

    def adopt_replaced_state(self, state: State) -> None:
        """State tensors replaced by assignment since they were made: their values go into the
        slabs (``offload.state._edits.adopt_entries``), after the early chunks (which read the old
        ones) are undone, before any relayout copies the slabs."""
        replaced = replaced_entries(self.layout.records, state)
        if replaced:
            self.abandon_early("a replaced optimizer.state entry")
            adopt_entries(self.layout, state, replaced)

    def abandon_early(self, what: str) -> None:
        """Undo the chunks started during backward (a call between backward and step())."""
        if self.overlap is not None:
            self.overlap.abandon(what)

    # ---------------------------------------------------------------- between steps
    def apply_settings(self, settings: OffloadSettings) -> None:
        """Switch to ``settings`` (resolved: threads an int, the kernel chosen) between steps:
        new chunks, ring depth, pinned blocks, NUMA binding, the launcher's settings."""
        if settings.chunk_numel != self.settings.chunk_numel:
            self.layout.rechunk(settings.chunk_numel)
            if self.overlap is not None:
                self.overlap.rechunked()
            self.pipeline.forget_layout()
        if ring_depth(settings) != ring_depth(self.settings):  # (the host transport ignores it)
            self.pipeline.resize_rings(ring_depth(settings))
        staging = (settings.chunk_numel, ring_depth(settings), settings.kernel, settings.speculate)
        restage = staging != (self.settings.chunk_numel, ring_depth(self.settings), self.settings.kernel,
                              self.settings.speculate)
        if bool(settings.bind_numa) != bool(self.settings.bind_numa):
            if settings.bind_numa:
                self.numa.turn_on(self.layout.host_regions)
            else:
                self.numa.turn_off()
        self.settings = settings
        if self.overlap is not None:
            self.overlap.settings = settings
            self.overlap.prepare()  # (speculate switched on: the second generation now)
        if restage:  # the pinned blocks for them now, not in the next (overlapped) step
            self._reserve_staging(self.pipeline)

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool,
                        foreach: bool | None) -> Tensor:
        """``CPUOffloadAdamW.clip_grad_norm_``: the total norm, and the coefficient kept for the
        next step (:attr:`clip`)."""
        if self.in_step:
            raise RuntimeError("CPUOffloadAdamW.clip_grad_norm_() called while step() is running")
        registry = self.layout.registry
        grads = {r.slot: r.param.grad for r in registry if r.param.grad is not None}
        try:
            self.clip = clip_request(registry.records, grads, max_norm=max_norm, norm_type=norm_type,
                                     error_if_nonfinite=error_if_nonfinite, foreach=foreach,
                                     device=registry.device, grad_stats=self.kernels.grad_stats)
        except NonFiniteNorm:  # the loop skips this step: the early chunks must not show
            self.abandon_early("clip_grad_norm_() (a non-finite norm)")
            raise
        return self.clip.total_norm

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """``CPUOffloadAdamW.accumulating``: the hooks start nothing (nothing without overlap)."""
        if self.overlap is None:
            yield
            return
        with self.overlap.accumulating():
            yield

    def attach_ddp(self, model: Any, group: Any) -> None:
        """``CPUOffloadAdamW.attach_ddp`` (checked there): DDP's comm hook over ``group`` hands
        the reduced gradients to the launcher; from now on they come from it, not from the
        autograd hooks."""
        assert self.overlap is not None
        model.register_comm_hook(group, ddp_comm_hook(self.overlap))
        self.overlap.set_external()

    def close(self) -> None:
        """Remove the backward hooks, stop the worker thread, restore the CPU affinity that
        ``bind_numa`` narrowed."""
        if self.overlap is not None:
            self.overlap.remove_hooks()
        self.pipeline.close()
        self.numa.turn_off()
