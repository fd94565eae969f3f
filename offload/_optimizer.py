"""``CPUOffloadAdamW``: the thin class: arguments, param groups, settings, ``step()``.

A ``torch.optim.Optimizer`` that checks its arguments (``offload._arguments``,
``offload.state._groups``), keeps what torch's ``Optimizer`` owns (``param_groups``, ``state``,
the hooks), follows re-bound ``param_groups``, and holds one engine (``offload._engine.HostEngine``)
that owns the rest: the host state (one ``offload.state.HostLayout``: records, slabs, chunks,
items), the pipeline that runs the step (``offload.pipeline``) and, with ``overlap_backward=True``,
the launcher that starts chunks during backward (``offload.overlap``); one ``step()``, the masters
following edited weights and the relayouts are the engine's. The math is ``offload.kernels``'s, the
thread budget ``offload.threads``'s, the tuner glue ``offload.tuning``'s.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from autotune import OnlineTuner
from offload._arguments import adamw_defaults, check_arguments, check_limit, check_state_dtype
from offload._engine import HostEngine
from offload._settings import OffloadSettings
from offload._stats import StepStats
from offload.kernels._adamw import DEFAULT_KERNELS, KernelSet
from offload.pipeline._cuda_transport import DeviceOps
from offload.pipeline._pipeline import Pipeline
from offload.pipeline._waits import DEVICE_TIMEOUT_S, check_timeout
from offload.state._groups import check_options, check_param_group
from offload.state._layout import HostLayout
from offload.state._params import ParamRegistry, check_params, param_names
from offload.state._placement import NumaBinder, NumaPlacement, NumaSwitch, PageMover
from offload.state._rebind import check_rebound
from offload.state._slabs import HostSlabs
from offload.state._state_io import as_dtensor_state, check_loaded, merged_groups, torch_shaped
from offload.threads._numa import rank_numa_node
from offload.threads._plan import ThreadPlan
from offload.tuning._node_agreement import thread_plan
from offload.tuning._glue import OffloadTuning

logger = logging.getLogger(__name__)

__all__ = ["CPUOffloadAdamW"]


NOT_COPYABLE = (
    "CPUOffloadAdamW cannot be copied, pickled or saved whole (it owns host slabs, a worker thread and "
    "backward hooks): checkpoint opt.state_dict() (torch.save it, deepcopy it) and load_state_dict() it "
    "into a new CPUOffloadAdamW over the new parameters"
)


class CPUOffloadAdamW(Optimizer):
    """AdamW whose fp32 master weights and moments live in host memory; the step runs on the CPU.

    Bitwise equal to ``torch.optim.AdamW(fused=True)`` on fp32 parameters, and to a mixed-precision
    reference (fp32 master updated by that optimizer from the upcast gradient, cast back) on bf16
    or fp16 parameters, whatever the settings. The model's parameters stay where they are (CPU or
    one CUDA device) in their own dtype; ``step()`` updates them in place. DTensor parameters (FSDP2,
    HSDP, tensor and expert parallel: ``Shard``, ``_StridedShard``, ``Replicate`` on any mesh):
    the host state holds this rank's local tensor only (see ``offload.state._dtensor``). Parameters re-bound in ``param_groups``
    (accelerate's FSDP2 swap) are followed, their state carried over (``offload.state._rebind``).

    Args:
        params, lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        settings: speed knobs (threads, chunk size, kernel: "auto" (default), "torch" or
            "fused-mp", the native single-pass kernel, see ``OffloadSettings.kernel``; NUMA
            placement, ``OffloadSettings.bind_numa``); ``threads=None`` uses this rank's
            ``plan_cpu_threads()``, resolved once here (``apply_settings`` with ``threads=None``
            reuses that count). Change them later with :meth:`apply_settings`.
        overlap_backward: start each chunk's d2h and kernel during backward, as soon as all its
            gradients have arrived, as a speculation (``offload.overlap._speculation``): ``step()``
            commits a chunk whose gradients (by content), hyper-parameters, clip coefficient and
            grad scale are those it consumed, and recomputes the others, so the results are
            bitwise those without overlap whatever the loop does between backward and ``step()``
            (clipping, GradScaler, DDP, a changed lr, ``zero_grad()`` and no step). Early chunks
            update out of place into a second generation of the state, which ``step()`` commits
            by a swap (12 bytes per element that may speculate; ``optimizer.state`` shows the
            committed step until then). Use ``with opt.accumulating():`` for all micro-batches
            but the last (else the early chunks of earlier micro-batches are redone).
        speculation_limit: with ``overlap_backward``, only the last parameters (in param_groups
            order: those whose gradients usually arrive first) whose state fits in this many
            elements may start during backward (the others run in ``step()``), which bounds the
            second generation to 12 bytes per such element; None (default): no bound; 0:
            nothing starts early.
        state_dtype, state_rounding, state_rounding_seed: the moments in host memory as
            ``torch.float32`` (default) or ``torch.bfloat16`` (20 instead of 28 bytes per
            parameter per step of a bf16 model; the fp32 update on the upcast moments, which are
            rounded as stored: ``"nearest"``-even, or ``"stochastic"``ally from bits keyed on the
            seed, step, parameter and element; ``docs/optimizer.md``, ``offload.kernels._rounding``).
        amsgrad, maximize, capturable, differentiable, foreach, fused: accepted for signature
            compatibility; anything but the defaults (or ``fused=True``, ``foreach=False``) raises
            ``ValueError``.
        autotune: ``True`` or an ``autotune.AutotuneConfig`` tunes ``threads`` and ``chunk_numel``
            (and ``kernel`` on bf16/fp16 models where fused-mp is bitwise equal to the torch
            path) online during the first steps (``offload.tuning._glue``); the tuner is
            ``self.tuner``.
            Under torch.distributed every local rank must construct the optimizer together.
        plan: the ``ThreadPlan`` to use instead of ``plan_cpu_threads()`` (tests, simulations, a
            plan made once for several optimizers); not with ``settings.threads``.
        numa_binder: with ``settings.bind_numa``, the function that binds this process to its
            NUMA node for a device (default ``bind_rank_numa_node``; tests pass one over a fake
            sysfs root). What the placement did: :attr:`numa_placement`; ``close()`` restores
            the affinity.
        page_mover: what moves the host state's pages to the bound NUMA node in place when
            ``bind_numa`` is switched on between steps: ``mover(addr, nbytes, node)`` over each
            page-aligned slab range (default ``mbind`` with ``MPOL_MF_MOVE``; tests pass a recorder).
        device_ops: the CUDA transport's streams, events, copies and pinned blocks (an
            ``offload.testing.DeviceOps``; None: the real ones on a CUDA device, none on the CPU). Given,
            the step runs the CUDA path over them also for bf16/fp16 CPU parameters (tests).
        device_timeout_s: the longest one host wait on a device event of the CUDA path may take
            (a gradient copy, a staging slot's last copy, a weight copy timed for
            :attr:`last_stats`) before ``step()`` raises a ``RuntimeError`` naming the chunk, the
            event and the timeout, instead of hanging on a dead peer; the optimizer's rule for
            failed steps then applies. None (default): the tuner's ``timeout_s`` where
            ``autotune`` is on, else 300 s (``offload.pipeline._waits.DEVICE_TIMEOUT_S``).
    """

    #: It tunes its own step's threads (``autotune=``): ``tune_step_threads`` refuses to wrap it.
    tunes_own_threads: ClassVar[bool] = True

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        settings: OffloadSettings | None = None,
        overlap_backward: bool = False,
        speculation_limit: int | None = None,
        state_dtype: torch.dtype = torch.float32,
        state_rounding: str = "nearest",
        state_rounding_seed: int = 0,
        amsgrad: bool = False,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        autotune: Any = False,
        plan: ThreadPlan | None = None,
        numa_binder: NumaBinder | None = None,
        page_mover: PageMover | None = None,
        kernels: KernelSet | None = None,
        device_ops: DeviceOps | None = None,
        device_timeout_s: float | None = None,
    ) -> None:
        config = check_arguments(autotune=autotune, settings=settings, plan=plan)
        check_options("", {"amsgrad": amsgrad, "maximize": maximize, "capturable": capturable,
                           "differentiable": differentiable, "foreach": foreach, "fused": fused})
        defaults = adamw_defaults(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        if device_timeout_s is None:
            device_timeout_s = config.timeout_s if config is not None else DEVICE_TIMEOUT_S
        device_timeout_s = check_timeout(device_timeout_s)
        self._constructed = False
        super().__init__(params, defaults)
        self._constructed = True

        settings = settings if settings is not None else OffloadSettings()
        # One record per parameter (DTensor (FSDP2) parameters: the slabs hold this rank's shard).
        registry = ParamRegistry(self.param_groups)
        limit = check_limit(speculation_limit, overlap_backward)
        rounding_seed = check_state_dtype(state_dtype, state_rounding, state_rounding_seed)
        numa = NumaSwitch(registry.device, numa_binder, page_mover)
        placement = numa.bind() if settings.bind_numa else None  # bind first, then allocate untouched
        layout = HostLayout.build(
            self.param_groups, self.state, registry=registry, chunk_numel=settings.chunk_numel,
            overlap_backward=overlap_backward, allocate=HostSlabs if placement is None else placement.allocate,
            speculable=limit, state_dtype=state_dtype, rounding_seed=rounding_seed).layout

        # A tuned optimizer's thread plan, kernel vote and tuner share one node agreement.
        # Where the tuner may switch bind_numa on, the plan also says how many threads each rank
        # may keep once bound (ThreadPlan.bound_threads): every rank's node goes with its mask.
        bind_node = (rank_numa_node(registry.device)
                     if config is not None and plan is None and settings.bind_numa is None else None)
        plan, agreement = thread_plan(config, threads=settings.threads, plan=plan, owner="CPUOffloadAdamW",
                                      bind_node=bind_node)
        self._planned_threads = plan.threads
        kernels = kernels if kernels is not None else DEFAULT_KERNELS
        settings = replace(settings, threads=self._planned_threads, kernel=kernels.resolve(settings.kernel))
        #: Everything but what torch's Optimizer owns: the host state, the pipeline, the launcher.
        self._engine = HostEngine(layout, settings=settings, kernels=kernels, device_ops=device_ops,
                                  device_timeout_s=device_timeout_s, numa=numa, placement=placement,
                                  owner=self, name=f"offload-adamw-{id(self):x}")

        #: The online tuner (``autotune.OnlineTuner``), or None.
        self.tuner: OnlineTuner | None = None
        self._tuning: OffloadTuning | None = None
        if config is not None:
            self._tuning = OffloadTuning.for_optimizer(
                self, config, plan=plan, records=layout.records, slots=layout.slabs.slots,
                groups=len(self.param_groups), device_type=registry.device.type,
                overlap_backward=overlap_backward, state_dtype=state_dtype, agreement=agreement,
                kernels_available=kernels.available,
                cuda_transport=registry.device.type == "cuda" or device_ops is not None)
            self.tuner = self._tuning.tuner
        logger.debug("CPUOffloadAdamW: %d params, %d chunks, %.1f MiB host slabs, device %s, %s",
                     len(registry), len(layout.chunks), layout.slabs.nbytes / 2**20,
                     registry.device, settings)

    # ---------------------------------------------------------------- param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (e.g. progressive unfreezing), between steps, as ``torch.optim.AdamW``.

        The host slabs are laid out again with the new group last; the existing parameters keep
        their master, moments and step, so the numerics stay bitwise those of torch's AdamW given
        the same ``add_param_group`` at the same step. With ``overlap_backward`` the new
        parameters' chunks start in ``step()`` until a backward has counted their hooks. The
        tuner keeps its search space and cache key (the workload at construction); under
        torch.distributed every local rank must add the same group at the same step.
        """
        constructed = getattr(self, "_constructed", True)
        if constructed:
            self._check_idle("add_param_group()")
        where = f" in param group {len(self.param_groups)}"
        param_group, plist, tensors = check_param_group(where, param_group, self.defaults)
        if constructed:
            registry = self._engine.layout.registry
            n = len(registry)
            names = param_names(self.param_groups) + [f"parameter {n + i}{where}" for i in range(len(tensors))]
            check_params(registry.params() + tensors, names)
        super().add_param_group({**param_group, "params": plist})
        if not constructed:
            return
        layout = self._engine.relayout(self.param_groups, self.state).layout
        if self._tuning is not None and self.tuner is not None and self.tuner.state != "locked":
            logger.warning(
                "CPUOffloadAdamW.add_param_group while the tuner is %s: steps measured before "
                "and after the new group are compared as one workload; add groups after the tuner "
                "locked in (opt.tuner.state == 'locked') or pass them to the constructor",
                self.tuner.state,
            )
        logger.info(
            "CPUOffloadAdamW: param group %d added: %d params, %d chunks, %.1f MiB host slabs",
            len(self.param_groups) - 1, len(layout.registry), len(layout.chunks), layout.slabs.nbytes / 2**20,
        )

    def _follow_groups(self) -> None:
        """Parameters re-bound in ``param_groups`` since the last layout (accelerate's FSDP2
        swap, a framework re-wrapping): lay the slabs out for them, their state carried over
        where ``offload.state._rebind`` maps them to a parameter that had state."""
        groups = self.param_groups
        engine = self._engine
        if not engine.layout.bound.changed(groups):
            return
        engine.abandon_early("a param_groups re-bind")  # early chunks of the old layout
        check_rebound(engine.layout.bound, groups, self.defaults, launched=False)
        relaid = engine.relayout(groups, self.state)
        logger.info("CPUOffloadAdamW: param_groups re-bound: %d params, %d with state (%d migrated)",
                    len(relaid.layout.records), len(relaid.entries), len(relaid.migrated))

    def _check_idle(self, what: str, *, adopt: bool = True) -> None:
        """Between steps only; undo early chunks, take replaced state tensors in (``adopt``: not
        for ``load_state_dict``, which replaces the whole state: DCP hands it entries that alias
        the live ones), follow re-bound param groups."""
        if self._engine.in_step:
            raise RuntimeError(f"CPUOffloadAdamW.{what} called while step() is running")
        self._engine.abandon_early(what)
        if adopt:
            self._engine.adopt_replaced_state(self.state)
        self._follow_groups()

    # Read-only views of the engine's parts, for tests and benchmarks (``opt._layout.slabs``).
    @property
    def _layout(self) -> HostLayout:
        return self._engine.layout

    @property
    def _pipeline(self) -> Pipeline:
        return self._engine.pipeline

    @property
    def _overlap(self) -> Any:
        """The engine's ``Launcher`` (``overlap_backward``), or None."""
        return self._engine.overlap

    # ---------------------------------------------------------------- public surface
    @property
    def settings(self) -> OffloadSettings:
        """The settings in force (``threads`` resolved to an int; ``kernel`` is "fused-mp" or
        "torch", never "auto": "torch" where "fused-mp" cannot run here, or for "auto" where it is
        not verified bitwise equal to torch's kernel)."""
        return self._engine.settings

    def apply_settings(self, settings: OffloadSettings) -> None:
        """Change threads / chunk size / kernel / CUDA ring depth / NUMA binding between steps.

        threads and chunk size never change the math; switching the kernel neither where
        ``offload.kernels._fused_mp.bitwise_matches_torch()`` (else within its documented tolerance).
        ``kernel="fused-mp"`` falls back to "torch" where it cannot run (see :attr:`settings`).
        ``bind_numa`` switched on binds the process to its node and moves the host state's pages
        there in place; switched off restores the affinity and leaves the pages where they are
        (None and False are both off; ``offload.state._placement``).
        """
        if not isinstance(settings, OffloadSettings):
            raise TypeError(f"settings={settings!r}: expected an OffloadSettings")
        self._engine.refuse_broken("apply_settings()")
        self._check_idle("apply_settings()")
        if settings.threads is None:
            settings = replace(settings, threads=self._planned_threads)
        self._engine.apply_settings(replace(settings, kernel=self._engine.kernels.resolve(settings.kernel)))

    @property
    def last_stats(self) -> StepStats | None:
        """Stage times of the last ``step()`` (None before the first)."""
        stats = self._engine.stats
        return None if stats is None else stats.build()

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Gradient accumulation with ``overlap_backward=True`` (like DDP's ``no_sync``).

        Run every micro-batch's backward but the last inside this context: its hooks start
        nothing. The last backward, outside it, starts the chunks. Without overlap it does nothing.
        """
        with self._engine.accumulating():
            yield

    @property
    def numa_placement(self) -> NumaPlacement | None:
        """What ``OffloadSettings.bind_numa`` did (None while it is off): the binding, and the order
        of bind, allocation and first touch, or of the bind and the page moves of a switch between
        steps (``offload.state._placement``)."""
        return self._engine.numa.placement

    def close(self) -> None:
        """Stop the worker thread and remove the backward hooks (also done on garbage collection);
        restore the CPU affinity that ``bind_numa`` narrowed."""
        try:  # the tuner (its trace, its short-run warning) first; the engine closes whatever that raises
            if self._tuning is not None:
                self._tuning.close()
                self._tuning = None
        finally:
            self._engine.close()

    def __reduce_ex__(self, protocol: Any) -> Any:
        # copy.copy, copy.deepcopy, pickle and torch.save all come here; torch's Optimizer would
        # carry only defaults, state and param_groups, leaving an object without its host slabs,
        # worker thread or hooks, whose step() then fails far from the copy.
        raise TypeError(NOT_COPYABLE)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(NOT_COPYABLE)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; between backward and ``step()`` it also undoes the chunks started early
        and drops a pending :meth:`clip_grad_norm_` coefficient (the step is skipped)."""
        self._check_idle("zero_grad()")
        self._engine.clip = None
        super().zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's parameters, applied inside the
        next ``step()``'s kernel (``offload.state._clip``): returns the total norm (a float32 tensor
        on the parameters' device; over all ranks and meshes for DTensor parameters); the
        gradients themselves are not modified. Call it after backward, before ``step()``; calling
        it again replaces the coefficient (the gradients were not scaled). ``foreach`` is accepted
        for signature compatibility."""
        return self._engine.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)

    def attach_ddp(self, model: Any) -> None:
        """With ``overlap_backward``: start chunks after DDP's all-reduce of their gradients (it
        registers a comm hook that reduces as DDP itself does, over DDP's own process group,
        ``offload.overlap._launcher``; call before the first backward). Without it DDP stays exact,
        but every chunk started during backward is redone in ``step()``."""
        if self._engine.overlap is None:
            raise ValueError("attach_ddp() needs CPUOffloadAdamW(overlap_backward=True)")
        group = getattr(model, "process_group", None)
        size = torch.distributed.get_world_size(group)
        if getattr(model, "gradient_as_bucket_view", False) and size & (size - 1):
            raise ValueError(
                f"attach_ddp() with DistributedDataParallel(gradient_as_bucket_view=True) on {size} ranks: "
                "DDP then divides some gradients by the size and multiplies others by its reciprocal, which "
                "differ in the last bit unless the size is a power of two; pass gradient_as_bucket_view=False "
                "or do not attach (chunks started during backward are then redone in step(): still exact)")
        self._engine.attach_ddp(model, group)

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.AdamW(fused=True)``'s keys: per parameter ``step``, ``exp_avg``,
        ``exp_avg_sq``, and the fp32 ``master_param`` only for a parameter that is not fp32 (a
        bf16/fp16 weight lacks the master's bits); per group torch's flags, ``fused=True`` and
        ``decoupled_weight_decay=True`` (a torch AdamW loading it runs fused, as this step does).

        For a DTensor parameter the state tensors are DTensors with its mesh, placements
        and global shape over this rank's slab memory (``torch.distributed.checkpoint`` saves,
        loads in place and reshards them; ``torch.save`` and ``copy.deepcopy`` work); ``step`` is
        a plain tensor, as in torch's AdamW.

        Tensors are live views of the host slabs (like torch's optimizers, which return their
        state tensors by reference): copy or save them before the next ``step()``. Weights edited
        since the last step are followed first (``master_param`` is the edited weight), as the
        next step would.
        """
        self._engine.refuse_broken("state_dict()")
        self._check_idle("state_dict()")
        registry = self._engine.layout.registry
        self._engine.sync_edits(self.param_groups, self.state, [r.slot for r in registry if self.state.get(r.param)])
        # torch's state_dict() calls the post-hooks on what it built; they must see (and may
        # replace) the dict returned, after the conversion: they run here instead.
        post_hooks, self._optimizer_state_dict_post_hooks = self._optimizer_state_dict_post_hooks, OrderedDict()
        try:
            sd = torch_shaped(super().state_dict(), self._engine.layout.records)
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        if registry.sharded:
            sd = as_dtensor_state(sd, self._engine.layout.records)
        for post_hook in post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy a state dict (from this class, or ``torch.optim.AdamW``) into the host slabs.

        Without ``master_param`` (a torch AdamW state), the master is the current parameter. A
        loaded ``master_param`` is kept only while it agrees with its parameter: at the next
        ``step()`` (the model may be loaded after the optimizer) one that no longer rounds to
        the parameter (trained or edited since, e.g. by torch's AdamW after our checkpoint) is
        dropped and the parameter wins, with one warning naming how many.
        """
        if self._engine.broken is not None:  # a step failed part-way: whatever it left, the loaded state replaces
            self._engine.pipeline.drain()
        self._check_idle("load_state_dict()", adopt=False)
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups = self.param_groups
        layout = self._engine.layout
        saved_groups, entries = check_loaded(state_dict, groups, self.defaults, layout.registry, layout.slabs)
        self.state = self._engine.load(groups, self.state, entries)
        self.param_groups = merged_groups(groups, saved_groups, self.defaults)
        self._engine.loaded()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # ---------------------------------------------------------------- step
    #: ``GradScaler.step`` hands this optimizer ``grad_scale`` and ``found_inf`` (attributes read
    #: by ``step()``), as it does torch's fused AdamW: unscaled inside the kernel, an overflow step
    #: skipped before any kernel runs.
    _step_supports_amp_scaling = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One AdamW step over every parameter with a gradient (others keep their state)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._engine.in_step:
            raise RuntimeError("CPUOffloadAdamW.step() is already running")
        self._engine.refuse_broken("step()")
        self._engine.adopt_replaced_state(self.state)
        self._follow_groups()
        # The tuner observation point, inside the step's signal block: the one place a tuner sees
        # each step's StepStats; it may call apply_settings there, between steps, at the same
        # step on every rank.
        self._engine.step(self.param_groups, self.state, grad_scale=getattr(self, "grad_scale", None),
                          found_inf=getattr(self, "found_inf", None),
                          observe=self._tuning.after_step if self._tuning is not None else None)
        return loss
