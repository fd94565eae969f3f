"""``CPUOffloadAdamW``: argument validation, param groups, state_dict, backward hooks.

The math lives in :mod:`offload._kernels`, the slabs and chunking in :mod:`offload._slabs`, the
worker thread and transports in :mod:`offload._pipeline`. This module decides *which* chunk runs
*when* (at ``step()``, or early during backward with ``overlap_backward=True``) and turns the
worker's stage records into :class:`~offload.StepStats`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from copy import deepcopy
from dataclasses import dataclass, replace
from itertools import chain
from types import MappingProxyType
from typing import Any, Callable

import torch
from torch import Tensor
from torch.optim import Optimizer

from offload._dtensor import ShardLayout, as_dtensor, layout_of, local
from offload._edits import WeightEdits
from offload._kernels import Hyper, new_step_tensor
from offload._pipeline import (
    KIND_F32,
    KIND_MP,
    KIND_TORCH,
    ChunkJob,
    HostTransport,
    Item,
    Pipeline,
    StageRecord,
    Transport,
)
from offload._cuda_transport import CudaTransport
from offload._settings import OffloadSettings, StageSpan, StepStats
from offload._slabs import Chunk, HostSlabs, plan_chunks
from autotune import AutotuneConfig, OnlineTuner
from offload._autotune import OffloadTuning
from offload._threads import plan_cpu_threads

logger = logging.getLogger(__name__)

__all__ = ["CPUOffloadAdamW"]

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Parameter dtypes the fused-mp kernel's mixed-precision entry updates (fp32 has its own entry).
_LOWP_DTYPES = (torch.bfloat16, torch.float16)
_STAGES = ("d2h", "adam_kernel", "materialize")
#: Options of torch.optim.AdamW this optimizer does not implement, with the only accepted values.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "amsgrad": (False,),
    "maximize": (False,),
    "capturable": (False,),
    "differentiable": (False,),
    "foreach": (None, False),
    "fused": (None, True),
    "decoupled_weight_decay": (True,),
}


def _check_options(where: str, options: dict[str, Any]) -> None:
    for name, accepted in _UNSUPPORTED.items():
        if name not in options:
            continue
        value = options[name]
        if value not in accepted:
            raise ValueError(
                f"CPUOffloadAdamW does not support {name}={value!r}{where}: expected one of "
                f"{accepted} (the step always runs torch's fused CPU AdamW kernel)"
            )


def _scalar(name: str, value: Any) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name}={value!r}: expected a float or a 1-element tensor")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r}: expected a float")
    return float(value)


def _check_hyper(where: str, group: dict[str, Any]) -> None:
    lr = _scalar("lr", group["lr"])
    if not (math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"lr={group['lr']!r}{where}: expected a finite float >= 0")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas={betas!r}{where}: expected a pair (beta1, beta2)")
    for i, b in enumerate(betas):
        v = _scalar(f"betas[{i}]", b)
        if not 0.0 <= v < 1.0:
            raise ValueError(f"betas[{i}]={b!r}{where}: expected 0 <= beta < 1")
    eps = _scalar("eps", group["eps"])
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"eps={group['eps']!r}{where}: expected a finite float >= 0")
    wd = _scalar("weight_decay", group["weight_decay"])
    if not (math.isfinite(wd) and wd >= 0.0):
        raise ValueError(
            f"weight_decay={group['weight_decay']!r}{where}: expected a finite float >= 0"
        )


def _hyper(group: dict[str, Any]) -> Hyper:
    """The group's hyper-parameters now (an lr scheduler may have changed them since the last step)."""
    lr = group["lr"]
    if isinstance(lr, Tensor):
        lr = lr.detach().to("cpu").reshape(()).clone()
    beta1, beta2 = (_scalar("betas", b) for b in group["betas"])
    return Hyper(
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=_scalar("weight_decay", group["weight_decay"]),
        eps=_scalar("eps", group["eps"]),
    )


@dataclass(slots=True)
class _Launch:
    """A chunk started during backward, and the gradients it read."""

    job: ChunkJob
    grads: dict[int, tuple[Tensor | None, int]]
    """For every parameter of the chunk: its gradient object at launch and that gradient's version."""


class _Overlap:
    """Starts a chunk's d2h + kernel during backward once all its gradients are final.

    The first backward is a calibration: nothing starts early, and the hook firings per parameter
    (outside ``accumulating()``) are counted. Later, a chunk starts when every parameter in it has
    fired as often as counted. A chunk with a parameter that did not fire during calibration never
    starts early (it runs in ``step()``). Counts are re-learned from any backward whose counts
    differ. ``step()`` verifies that no gradient of an early chunk changed after its launch.
    """

    def __init__(self, num_params: int, launch: Callable[[Chunk], _Launch | None]) -> None:
        self._lock = threading.Lock()
        self._launch_fn = launch
        self._n = num_params
        self._fired = [0] * num_params
        self._expected: list[int] | None = None
        self._accumulating = 0
        self._chunks: tuple[Chunk, ...] = ()
        self._chunks_of: list[list[int]] = [[] for _ in range(num_params)]
        self._eligible: list[bool] = []
        self._pending: list[int] = []
        self._launched: dict[int, _Launch] = {}

    def set_chunks(self, chunks: tuple[Chunk, ...]) -> None:
        with self._lock:
            self._chunks = chunks
            self._chunks_of = [[] for _ in range(self._n)]
            for c in chunks:
                for slot in {v.slot for v in c.views}:
                    self._chunks_of[slot].append(c.index)
            self._reset_pending()

    def _reset_pending(self) -> None:
        exp = self._expected
        self._eligible, self._pending = [], []
        for c in self._chunks:
            slots = {v.slot for v in c.views}
            self._eligible.append(exp is not None and all(exp[s] > 0 for s in slots))
            self._pending.append(len(slots))

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        with self._lock:
            self._accumulating += 1
        try:
            yield
        finally:
            with self._lock:
                self._accumulating -= 1

    def has_launched(self) -> bool:
        with self._lock:
            return bool(self._launched)

    def on_grad(self, slot: int) -> None:
        with self._lock:
            if self._accumulating:
                return
            self._fired[slot] += 1
            exp = self._expected
            if exp is None or self._fired[slot] != exp[slot]:
                return
            for c in self._chunks_of[slot]:
                if not self._eligible[c]:
                    continue
                self._pending[c] -= 1
                if self._pending[c] == 0:
                    launch = self._launch_fn(self._chunks[c])
                    if launch is not None:
                        self._launched[c] = launch

    def end_window(self) -> dict[int, _Launch]:
        """At ``step()``: stop early launches for this step, learn counts, return the launches."""
        with self._lock:
            launched, self._launched = self._launched, {}
            fired, self._fired = self._fired, [0] * self._n
            if any(fired) and fired != self._expected:
                if self._expected is not None:
                    logger.debug(
                        "overlap_backward: gradient hook counts changed; re-learned "
                        "(chunks with changed parameters start in step() until then)"
                    )
                self._expected = fired
            self._reset_pending()
            return launched


def _grad_hook(overlap_ref: weakref.ref[_Overlap], slot: int, _param: Tensor) -> None:
    overlap = overlap_ref()
    if overlap is not None:
        overlap.on_grad(slot)


class _StatsBuilder:
    """Turns stage records into StepStats when first read (CUDA times need their events)."""

    def __init__(self, records: list[StageRecord], t0: float, **fields: Any) -> None:
        self._records, self._t0, self._fields = records, t0, fields
        self._stats: StepStats | None = None

    def build(self) -> StepStats:
        if self._stats is None:
            sums = dict.fromkeys(_STAGES, 0.0)
            spans = []
            for r in self._records:
                r.finalize()
                sums[r.stage] += r.busy_s
                spans.append(StageSpan(r.stage, r.chunk, r.start - self._t0, r.end - self._t0))
            spans.sort(key=lambda s: (s.start_s, s.chunk))
            self._stats = StepStats(
                d2h_s=sums["d2h"],
                adam_kernel_s=sums["adam_kernel"],
                materialize_s=sums["materialize"],
                spans=tuple(spans),
                **self._fields,
            )
            self._records = []
        return self._stats


class CPUOffloadAdamW(Optimizer):
    """AdamW whose fp32 master weights and moments live in host memory; the step runs on the CPU.

    Bitwise equal to ``torch.optim.AdamW(fused=True)`` on fp32 parameters, and to a mixed-precision
    reference (fp32 master updated by that optimizer from the upcast gradient, cast back) on bf16
    or fp16 parameters, whatever the settings. The model's parameters stay where they are (CPU or
    one CUDA device) in their own dtype; ``step()`` updates them in place. Parameters of an FSDP2
    (``fully_shard``) model are DTensors sharded ``Shard(0)`` on a 1-D mesh: the host state holds
    this rank's shard only (see ``offload/_dtensor.py``).

    Args:
        params, lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        settings: speed knobs (threads, chunk size, kernel: "auto" (default), "torch" or
            "fused-mp", the native single-pass kernel, see ``OffloadSettings.kernel``; NUMA
            placement, ``OffloadSettings.bind_numa``); ``threads=None`` uses this rank's
            ``plan_cpu_threads()``, resolved once here (``apply_settings`` with ``threads=None``
            reuses that count). Change them later with :meth:`apply_settings`.
        overlap_backward: start each chunk's d2h and kernel during backward, as soon as all its
            gradients are final (the model's weights are still written only in ``step()``). Every
            backward outside :meth:`accumulating` then commits to the next ``step()``: gradients
            must not be modified between backward and ``step()`` (no gradient clipping, no
            ``GradScaler.unscale_``, no ``zero_grad()``); ``step()`` raises ``RuntimeError`` if one
            was. Use ``with opt.accumulating():`` for all micro-batches but the last.
        amsgrad, maximize, capturable, differentiable, foreach, fused: accepted for signature
            compatibility; anything but the defaults (or ``fused=True``, ``foreach=False``) raises
            ``ValueError``.
        autotune: ``True`` or an ``autotune.AutotuneConfig`` tunes ``threads`` and ``chunk_numel``
            (and ``kernel`` on bf16/fp16 models where fused-mp is bitwise equal to the torch
            path) online during the first steps (``offload/_autotune.py``); the tuner is
            ``self.tuner``.
            Under torch.distributed every local rank must construct the optimizer together.
    """

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
        amsgrad: bool = False,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        autotune: Any = False,
    ) -> None:
        if autotune is True:
            autotune = AutotuneConfig()
        if autotune is not False and autotune is not None and not isinstance(autotune, AutotuneConfig):
            raise TypeError(f"autotune={autotune!r}: expected a bool or an autotune.AutotuneConfig")
        if settings is not None and not isinstance(settings, OffloadSettings):
            raise TypeError(f"settings={settings!r}: expected an OffloadSettings or None")
        options = {
            "amsgrad": amsgrad,
            "maximize": maximize,
            "capturable": capturable,
            "differentiable": differentiable,
            "foreach": foreach,
            "fused": fused,
        }
        _check_options("", options)
        if isinstance(betas, (tuple, list)) and len(betas) == 2:
            betas = (_scalar("betas[0]", betas[0]), _scalar("betas[1]", betas[1]))
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        defaults.update({"amsgrad": False, "maximize": False, "foreach": None})
        defaults.update({"capturable": False, "differentiable": False, "fused": None})
        _check_hyper("", defaults)
        self._constructed = False
        super().__init__(params, defaults)
        self._constructed = True

        self._params: list[Tensor] = [p for g in self.param_groups for p in g["params"]]
        # DTensor (FSDP2) parameters: the slabs hold this rank's shard; see offload/_dtensor.py.
        self._device, self._layouts = self._check_params(self._params, self._param_names())
        self._sharded = any(lay is not None for lay in self._layouts)
        self._slot_of: dict[int, int] = {id(p): i for i, p in enumerate(self._params)}
        #: Slots that keep a master slab place even where they could be their own (_give_masters).
        self._real_masters: set[int] = set()
        self._recheck_masters: set[int] = set()  # see _drop_equal_masters
        self._slabs, self._numa = self._make_slabs(settings, overlap_backward)

        settings = settings if settings is not None else OffloadSettings()
        plan = plan_cpu_threads(threads=settings.threads)
        self._planned_threads = plan.threads
        self._has_lowp = any(p.dtype in _LOWP_DTYPES for p in self._params)
        self._settings = self._resolve_kernel(replace(settings, threads=self._planned_threads))
        self._chunks = plan_chunks(list(self._slabs.slots), self._settings.chunk_numel)
        self._state_gen = 0
        self._step_of: dict[int, Tensor] = {}  # each slot's step tensor when its Items were made
        self._item_cache: dict[int, tuple[Any, ...]] = {}  # see _items

        self._pipeline = self._new_pipeline()
        if self._numa is not None:  # see _make_slabs
            self._pipeline.on_worker(self._slabs.first_touch, threads=self._planned_threads)
        self._in_step = False
        self._edits = WeightEdits()
        self._stats: _StatsBuilder | None = None
        self._early_launches_last_step = 0

        self._overlap: _Overlap | None = None
        self._hook_handles: list[Any] = []
        if overlap_backward:
            self._start_overlap(None)

        #: The online tuner (``autotune.OnlineTuner``), or None.
        self.tuner: OnlineTuner | None = None
        self._tuning: OffloadTuning | None = None
        if isinstance(autotune, AutotuneConfig):
            group_numel = [0] * len(self.param_groups)
            # The search space must be the same on every local rank: size it by the largest shard
            # any rank holds (uneven shards differ by rank); the workload names this rank's shard.
            group_max = [0] * len(self.param_groups)
            for slot in self._slabs.slots:
                group_numel[slot.group] += slot.numel
                layout = self._layouts[slot.index]
                group_max[slot.group] += slot.numel if layout is None else layout.max_local_numel
            sharded = [lay for lay in self._layouts if lay is not None]
            self._tuning = OffloadTuning(
                self,
                autotune,
                plan=plan,
                fixed_threads=plan.source != "plan",
                objective="iteration" if overlap_backward else "step",
                workload={
                    "params": sum(group_numel),
                    "groups": len(group_numel),
                    "dtypes": sorted({str(p.dtype) for p in self._params}),
                    "device": self._device.type,
                    "overlap_backward": bool(overlap_backward),
                    "objective": "iteration" if overlap_backward else "step",
                    **({"sharded_params": len(sharded), "shard_ranks": sharded[0].mesh.size(),
                        "global_params": sum(p.numel() for p in self._params)} if sharded else {}),
                },
                largest_slab=max(group_max, default=0),
                has_lowp=self._has_lowp,
            )
            self.tuner = self._tuning.tuner
        logger.debug(
            "CPUOffloadAdamW: %d params, %d chunks, %.1f MiB host slabs, device %s, %s",
            len(self._params),
            len(self._chunks),
            self._slabs.nbytes / 2**20,
            self._device,
            self._settings,
        )

    def _new_pipeline(self) -> Pipeline:
        transport: Transport
        if self._device.type == "cuda":
            transport = CudaTransport(self._device)
        else:
            transport = HostTransport()
        return Pipeline(self._slabs, transport, name=f"offload-adamw-{id(self):x}")

    def _start_overlap(self, expected: list[int] | None) -> None:
        """Backward hooks on every parameter; ``expected``: hook counts already learned."""
        self._overlap = _Overlap(len(self._params), self._launch_via(weakref.ref(self)))
        self._overlap._expected = expected
        self._overlap.set_chunks(self._chunks)
        ref = weakref.ref(self._overlap)
        for slot, p in enumerate(self._params):
            self._hook_handles.append(
                p.register_post_accumulate_grad_hook(functools.partial(_grad_hook, ref, slot))
            )

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
        _check_options(where, param_group)
        merged = {**self.defaults, **param_group}
        _check_hyper(where, merged)
        if isinstance(param_group.get("betas"), (tuple, list)) and len(param_group["betas"]) == 2:
            param_group = dict(param_group)
            param_group["betas"] = tuple(_scalar("betas", b) for b in param_group["betas"])
        params = param_group["params"]
        plist = [params] if isinstance(params, Tensor) else list(params)
        tensors = [p[1] if isinstance(p, tuple) else p for p in plist]
        if len({id(p) for p in tensors}) != len(tensors):
            raise ValueError(f"a parameter appears twice{where}")
        if constructed:
            names = self._param_names() + [f"parameter {len(self._params) + i}{where}"
                                           for i in range(len(tensors))]
            self._check_params(self._params + tensors, names)
        super().add_param_group({**param_group, "params": plist})
        if not constructed:
            return
        self._relayout()
        if self._tuning is not None and self.tuner is not None and self.tuner.state != "locked":
            logger.warning(
                "CPUOffloadAdamW.add_param_group while the tuner is %s: steps measured before "
                "and after the new group are compared as one workload; add groups after the tuner "
                "locked in (opt.tuner.state == 'locked') or pass them to the constructor",
                self.tuner.state,
            )
        logger.info(
            "CPUOffloadAdamW: param group %d added: %d params, %d chunks, %.1f MiB host slabs",
            len(self.param_groups) - 1, len(self._params), len(self._chunks),
            self._slabs.nbytes / 2**20,
        )

    def _relayout(self, seeds: Mapping[int, Tensor] = MappingProxyType({})) -> None:
        """New slabs, chunks, worker and hooks for the current groups (after ``add_param_group``,
        or :meth:`_give_masters`).

        A new group comes last, so every existing parameter keeps its slot index; its moments and
        master are copied into the new slabs (a slot that was its own master and now has a master
        place takes ``seeds[slot]``) and its state entry points there.
        """
        old = self._slabs
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._device, self._layouts = self._check_params(self._params, self._param_names())
        self._sharded = any(lay is not None for lay in self._layouts)
        self._slot_of = {id(p): i for i, p in enumerate(self._params)}
        shapes = [[local(p).shape for p in g["params"]] for g in self.param_groups]
        self._slabs = HostSlabs(shapes, self._own_masters(self._overlap is not None))
        for slot in range(len(old.slots)):
            p = self._params[slot]
            if not self.state.get(p):
                continue
            for kind in ("exp_avg", "exp_avg_sq"):
                self._slabs.flat(kind, slot).copy_(old.flat(kind, slot))
            if not self._slabs.slots[slot].own_master:
                # A slot only loses its own master through _give_masters, which passes its seed.
                master = seeds[slot] if old.slots[slot].own_master else old.flat("master", slot)
                self._slabs.flat("master", slot).copy_(master.detach().reshape(-1))
            self.state[p].update(self._state_entry(slot, self.state[p]["step"]))
        self._item_cache.clear()
        self._has_lowp = any(p.dtype in _LOWP_DTYPES for p in self._params)
        self._chunks = plan_chunks(list(self._slabs.slots), self._settings.chunk_numel)
        self._pipeline.close()
        self._pipeline = self._new_pipeline()
        if self._overlap is not None:
            for h in self._hook_handles:
                h.remove()
            self._hook_handles = []
            learned = self._overlap._expected
            added = len(self._params) - len(old.slots)
            self._start_overlap(None if learned is None else learned + [0] * added)

    def _param_names(self) -> list[str]:
        """``parameter i`` (with its name when the groups carry ``param_names``), for errors."""
        names = []
        for g in self.param_groups:
            given = g.get("param_names") or [None] * len(g["params"])
            for name in given:
                i = len(names)
                names.append(f"parameter {i}" if name is None else f"parameter {i} ({name!r})")
        return names

    @staticmethod
    def _check_params(params: list[Tensor], names: list[str]) -> tuple[torch.device, list[ShardLayout | None]]:
        """The device of the (local) parameters, and each one's shard layout (None: a plain tensor)."""
        if not params:
            raise ValueError("CPUOffloadAdamW got an empty parameter list")
        layouts = [layout_of(p, name) for p, name in zip(params, names)]
        params = [local(p) for p in params]
        device = params[0].device
        for i, p in enumerate(params):
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError(f"parameter {i} has layout {p.layout}: expected torch.strided")
            if not p.is_floating_point():
                raise ValueError(
                    f"parameter {i} has dtype {p.dtype}: expected a floating point dtype"
                )
            if p.dtype not in _SUPPORTED_DTYPES:
                raise ValueError(
                    f"parameter {i} has dtype {p.dtype}: expected one of {_SUPPORTED_DTYPES}"
                )
            if p.device != device:
                raise ValueError(
                    f"parameter {i} is on {p.device} but parameter 0 is on {device}: expected "
                    "every parameter on one device"
                )
            if not p.is_contiguous():
                raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) is not contiguous")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"parameters are on {device}: expected cpu or cuda")
        return device, layouts

    def _local_param(self, slot: int) -> Tensor:
        """The tensor the step reads and writes for parameter ``slot``: itself, or its local shard."""
        p = self._params[slot]
        return p if self._layouts[slot] is None else local(p)

    # ---------------------------------------------------------------- public surface
    @property
    def settings(self) -> OffloadSettings:
        """The settings in force (``threads`` resolved to an int; ``kernel`` is "fused-mp" or
        "torch", never "auto": "torch" where "fused-mp" cannot run here, or for "auto" where it is
        not verified bitwise equal to torch's kernel)."""
        return self._settings

    def _resolve_kernel(self, settings: OffloadSettings) -> OffloadSettings:
        """The kernel that runs: ``"fused-mp"`` where it can run here, else ``"torch"`` (the
        reason is logged); ``"auto"`` is ``"fused-mp"`` only where it is also bitwise equal to
        torch's kernel on this build (``offload._fused_mp.bitwise_matches_torch``)."""
        if settings.kernel == "torch":
            return settings
        from offload._fused_mp import bitwise_matches_torch, fused_mp_available

        if settings.kernel == "auto" and not bitwise_matches_torch():
            logger.debug("CPUOffloadAdamW: kernel='auto' uses 'torch': fused-mp is not verified "
                         "bitwise equal to torch's kernel on this torch build and CPU")
            return replace(settings, kernel="torch")
        ok, reason = fused_mp_available()  # builds on first use; logs a failure once (WARNING)
        if not ok:
            logger.debug("CPUOffloadAdamW: kernel=%r unavailable, using 'torch': %s",
                         settings.kernel, reason)
            return replace(settings, kernel="torch")
        return replace(settings, kernel="fused-mp")

    def apply_settings(self, settings: OffloadSettings) -> None:
        """Change threads / chunk size / kernel between steps.

        threads and chunk size never change the math; switching the kernel neither where
        ``offload._fused_mp.bitwise_matches_torch()`` (else within its documented tolerance).
        ``kernel="fused-mp"`` falls back to "torch" where it cannot run (see :attr:`settings`).
        """
        if not isinstance(settings, OffloadSettings):
            raise TypeError(f"settings={settings!r}: expected an OffloadSettings")
        self._check_idle("apply_settings()")
        if settings.threads is None:
            settings = replace(settings, threads=self._planned_threads)
        settings = self._resolve_kernel(settings)
        if settings.chunk_numel != self._settings.chunk_numel:
            self._chunks = plan_chunks(list(self._slabs.slots), settings.chunk_numel)
            if self._overlap is not None:
                self._overlap.set_chunks(self._chunks)
            # Cached views of the old layout: a tuner tries several, none should pile up.
            self._slabs.forget_views()
            self._item_cache.clear()
            self._pipeline.forget_layout()
        self._settings = settings

    @property
    def last_stats(self) -> StepStats | None:
        """Stage times of the last ``step()`` (None before the first)."""
        return None if self._stats is None else self._stats.build()

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Gradient accumulation with ``overlap_backward=True`` (like DDP's ``no_sync``).

        Run every micro-batch's backward but the last inside this context: its hooks start
        nothing. The last backward, outside it, starts the chunks. Without overlap it does nothing.
        """
        if self._overlap is None:
            yield
            return
        with self._overlap.accumulating():
            yield

    def close(self) -> None:
        """Stop the worker thread and remove the backward hooks (also done on garbage collection)."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []
        if self._tuning is not None:
            self._tuning.close()
            self._tuning = None
        self._pipeline.close()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._check_idle("zero_grad()")
        super().zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """torch's layout; per parameter: ``step``, ``exp_avg``, ``exp_avg_sq``, ``master_param``.

        For a DTensor (FSDP2) parameter the last three are DTensors with its mesh, placements and
        global shape over this rank's slab views (``torch.distributed.checkpoint`` saves, loads
        in place and reshards them); ``step`` is a plain tensor, as in torch's AdamW.

        Tensors are live views of the host slabs (like torch's optimizers, which return their
        state tensors by reference): copy or save them before the next ``step()``. Weights edited
        since the last step are followed first (``master_param`` is the edited weight), as the
        next step would.
        """
        self._check_idle("state_dict()")
        self._sync_edits([slot for slot, p in enumerate(self._params) if self.state.get(p)])
        sd = super().state_dict()
        if not any(lay is not None for lay in self._layouts):
            return sd
        # DTensor parameters: the moments and master as DTensors over the slab views, with the
        # parameter's mesh and placements, so torch.distributed.checkpoint saves (and reshards)
        # them like torch AdamW's state of the same model. ``step`` stays a plain tensor.
        state = {}
        for key, entry in sd["state"].items():
            layout = self._layouts[key]
            if layout is not None:
                entry = {k: as_dtensor(v, layout) if k != "step" and isinstance(v, Tensor) else v
                         for k, v in entry.items()}
            state[key] = entry
        return {**sd, "state": state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy a state dict (from this class, or ``torch.optim.AdamW``) into the host slabs.

        Without ``master_param`` (a torch AdamW state), the master is the current parameter.
        """
        self._check_idle("load_state_dict()")
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter groups: expected {len(groups)}"
            )
        for i, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    f"loaded state dict's param group {i} has {len(sg['params'])} parameters: "
                    f"expected {len(g['params'])}"
                )
            where = f" in loaded param group {i}"
            _check_options(where, sg)
            _check_hyper(where, {**self.defaults, **sg})
        id_map = dict(
            zip(
                chain.from_iterable(g["params"] for g in saved_groups),
                chain.from_iterable(g["params"] for g in groups),
            )
        )
        entries: list[tuple[int, dict[str, Any]]] = []
        for key, value in state_dict["state"].items():
            if key not in id_map:
                raise ValueError(f"loaded state dict has state for unknown parameter id {key!r}")
            slot = self._slot_of[id(id_map[key])]
            numel = self._slabs.slots[slot].numel
            for name in ("step", "exp_avg", "exp_avg_sq"):
                if name not in value:
                    raise ValueError(f"loaded state of parameter id {key!r} has no {name!r}")
            # DTensor state (a DCP checkpoint, torch AdamW's of an FSDP2 model): this rank's shard.
            value = {k: local(v) if isinstance(v, Tensor) else v for k, v in value.items()}
            for name in ("exp_avg", "exp_avg_sq", "master_param"):
                if name in value and value[name].numel() != numel:
                    raise ValueError(
                        f"loaded {name} of parameter id {key!r} has {value[name].numel()} "
                        f"elements: expected {numel}"
                    )
            entries.append((slot, value))

        # A loaded master with bits its parameter lacks (a bf16 run resumed in fp32, or the model
        # not loaded yet) needs a master place where the parameter was its own master; the next
        # step() drops the place again where the parameter then equals it (_drop_equal_masters).
        seeds = {
            slot: value["master_param"]
            for slot, value in entries
            if self._slabs.slots[slot].own_master and "master_param" in value
            and not torch.equal(value["master_param"].detach().reshape(-1).to(torch.float32),
                                self._local_param(slot).detach().reshape(-1))
        }
        if seeds:
            self._give_masters(seeds)
            self._recheck_masters.update(seeds)
        new_state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        with torch.no_grad():
            for slot, value in entries:
                p = self._params[slot]
                self._load_master(slot, value.get("master_param", self._local_param(slot)))
                self._slabs.flat("exp_avg", slot).copy_(value["exp_avg"].detach().reshape(-1))
                self._slabs.flat("exp_avg_sq", slot).copy_(
                    value["exp_avg_sq"].detach().reshape(-1)
                )
                step = value["step"]
                step = (
                    step.detach().to("cpu", torch.float32).reshape(()).clone()
                    if isinstance(step, Tensor)
                    else new_step_tensor(float(step))
                )
                new_state[p] = self._state_entry(slot, step)
        self.state = new_state

        new_groups = []
        for g, sg in zip(groups, saved_groups):
            sg["params"] = g["params"]
            if "param_names" in g and "param_names" not in sg:
                sg["param_names"] = g["param_names"]
            for k, v in self.defaults.items():
                sg.setdefault(k, v)
            new_groups.append(sg)
        self.param_groups = new_groups
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # ---------------------------------------------------------------- step
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One AdamW step over every parameter with a gradient (others keep their state)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._in_step:
            raise RuntimeError("CPUOffloadAdamW.step() is already running")
        self._in_step = True
        try:
            with torch.no_grad():
                self._step()
        finally:
            self._in_step = False
        # ---- Tuner observation point: the one place a tuner sees each step's StepStats. ----
        # The tuner may call apply_settings here, between steps, at the same step on every rank.
        if self._tuning is not None:
            self._tuning.after_step()
        return loss

    def _step(self) -> None:
        t0 = time.perf_counter()
        launched = self._overlap.end_window() if self._overlap is not None else {}
        self._early_launches_last_step = len(launched)
        if launched:
            self._verify_launches(launched)

        try:
            grads = self._collect_grads()
            self._follow_edits(grads, launched)
        except BaseException:
            if launched:
                self._pipeline.drain()  # early chunks of the aborted step must not leak into the next
            raise

        event = None
        if self._device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
        threads = self._settings.threads
        assert threads is not None
        numel = chunks_run = 0
        used_mp = False
        for chunk in self._chunks:
            early = launched.get(chunk.index)
            if early is not None:
                job = ChunkJob(chunk.index, early.job.items, early.job.hyper, threads, False, True)
            else:
                items = self._items(chunk, grads)
                if not items:
                    continue
                hyper = _hyper(self.param_groups[chunk.group])
                job = ChunkJob(chunk.index, items, hyper, threads, True, True, ready_event=event)
            job.write_event = event
            summary = self._item_summary(chunk, job.items)
            used_mp = used_mp or summary[1]
            numel += summary[0]
            chunks_run += 1
            self._pipeline.submit(job)
        result = self._pipeline.drain()
        for cached in self._item_cache.values():  # reused Items must not keep gradients alive
            for it in cached[3]:
                it.grad = None
        if result.error is not None:
            raise result.error
        if result.last_h2d_event is not None:
            torch.cuda.current_stream(self._device).wait_event(result.last_h2d_event)
        self._edits.record(self._params, grads)  # our writes bumped the versions
        t1 = time.perf_counter()
        self._stats = _StatsBuilder(
            result.records,
            t0,
            step_s=t1 - t0,
            drain_s=result.wait_s,
            threads=threads,
            chunk_numel=self._settings.chunk_numel,
            num_chunks=chunks_run,
            numel=numel,
            kernel="fused-mp" if used_mp else "torch",
        )

    def _collect_grads(self) -> dict[int, Tensor]:
        """The gradients of this step by slot; initialises the state of new parameters."""
        grads: dict[int, Tensor] = {}
        for slot, param in enumerate(self._params):
            if param.grad is None:
                continue
            p, g = self._local_param(slot), local(param.grad)  # DTensors: this rank's shards
            if g.is_sparse:
                raise RuntimeError(
                    f"parameter {slot} has a sparse gradient: CPUOffloadAdamW supports dense only"
                )
            if not p.is_contiguous():  # checked at construction; .data may have been replaced
                raise RuntimeError(
                    f"parameter {slot} (shape {tuple(p.shape)}, strides {p.stride()}) is not "
                    "contiguous: expected a contiguous parameter (the optimizer writes it in place "
                    "through a flat view; was its .data replaced, e.g. by a memory-format change?)"
                )
            if g.device != p.device or g.shape != p.shape:
                raise RuntimeError(
                    f"parameter {slot} ({tuple(p.shape)} on {p.device}) has a gradient of shape "
                    f"{tuple(g.shape)} on {g.device}: expected the parameter's shape and device"
                )
            state = self.state[param]
            if not state:
                self._init_state(slot, param)
            elif state.get("step") is not self._step_of.get(slot):
                # The user replaced the step tensor (as torch's AdamW allows): the cached Items
                # hold the old one.
                self._step_of[slot] = state.get("step")
                self._state_gen += 1
            if p.numel() == 0:  # an empty shard is in no chunk: count its step as torch does
                self.state[param]["step"] += 1
            grads[slot] = g
        return grads

    def _follow_edits(self, grads: dict[int, Tensor], launched: dict[int, _Launch]) -> None:
        """Parameters edited since our last write: their masters follow them (offload/_edits.py).

        Chunks started during backward re-seeded theirs at launch; an edit after that is too late.
        """
        late = self._edits.end_window(self._params)
        if late:
            self._pipeline.drain()  # the early chunks must finish before kernel_ran is read
            mutated = sorted(c for c, launch in launched.items() if launch.job.kernel_ran)
            p = self._params[late[0]]
            raise RuntimeError(
                f"CPUOffloadAdamW(overlap_backward=True): parameter {late[0]} (shape "
                f"{tuple(p.shape)}) was edited in place after its chunk started during backward "
                "and before step(): edit the weights after step() or before backward(), or use "
                "overlap_backward=False. "
                + (
                    f"The optimizer state of the early chunk(s) {mutated} was already advanced "
                    "by this step: restore the optimizer from a checkpoint."
                    if mutated
                    else "No optimizer state was changed."
                )
            )
        if self._recheck_masters:
            self._drop_equal_masters()
        self._sync_edits(grads)

    def _sync_edits(self, slots: Iterable[int]) -> None:
        """The edited parameters among ``slots`` (offload/_edits.py): their masters follow them,
        and their state entries are made again (they name the current tensors, and the cached
        Items and kernel calls of their chunks are rebuilt: ``.data`` may be new storage). A
        parameter that was its own master and is no longer fp32 (``model.to(torch.bfloat16)``)
        first gets a master, seeded from its fp32 storage before the change."""
        edited = self._edits.edited(self._params, slots)
        if not edited:
            return
        cast = {}
        for slot in edited:
            if self._slabs.slots[slot].own_master and self._local_param(slot).dtype != torch.float32:
                cast[slot] = self.state[self._params[slot]]["master_param"]  # the old fp32 tensor
        if cast:
            self._give_masters(cast)
        self._edits.reseed(self._params, self._slabs, edited)
        for slot in edited:
            p = self._params[slot]
            self.state[p].update(self._state_entry(slot, self.state[p]["step"]))

    def _drop_equal_masters(self) -> None:
        """Slots given a master by ``load_state_dict`` (the loaded master differed from the
        parameter) whose parameter now equals it (the model was loaded after the optimizer): the
        parameter is their master again, as before the load."""
        slots, self._recheck_masters = self._recheck_masters, set()
        same = {
            s for s in slots
            if s in self._real_masters
            and self._local_param(s).dtype == torch.float32
            and torch.equal(self._slabs.flat("master", s),
                            self._local_param(s).detach().reshape(-1))
        }
        if same:
            self._real_masters -= same
            self._relayout()

    def _make_slabs(self, settings: OffloadSettings | None, overlap_backward: bool) -> tuple[HostSlabs, Any]:
        """The host slabs; with ``settings.bind_numa`` the process is bound to its NUMA node first
        and the slabs are left untouched for the worker's first touch (the binding, else None)."""
        shapes = [[local(p).shape for p in g["params"]] for g in self.param_groups]
        own = self._own_masters(overlap_backward)
        if settings is None or not settings.bind_numa:
            return HostSlabs(shapes, own), None
        from offload._threads import bind_rank_numa_node

        binding = bind_rank_numa_node(self._device)
        return HostSlabs(shapes, own, zero=False), binding

    def _own_masters(self, overlap_backward: bool) -> list[list[bool]]:
        """Per group and parameter: the parameter is its own fp32 master (no master slab place).

        True for fp32 parameters of a CPU model: the kernels update them in place, so a master
        copy would cost 4 bytes per parameter and two passes per step (a copy in, a copy out)
        for nothing. Not with ``overlap_backward``: a chunk started during backward must not
        change the weights before ``step()``, so it updates a master that ``step()`` copies out.
        """
        own = self._device.type == "cpu" and not overlap_backward
        result, slot = [], 0
        for g in self.param_groups:
            row = []
            for p in g["params"]:
                row.append(own and p.dtype == torch.float32 and slot not in self._real_masters)
                slot += 1
            result.append(row)
        return result

    def _give_masters(self, seeds: dict[int, Tensor]) -> None:
        """Slots that were their own master get a master slab place, seeded from ``seeds`` (fp32,
        flat or shaped), and keep it: a parameter that stopped being fp32 (``model.to(bf16)``),
        or whose loaded ``master_param`` carries bits the parameter lacks (a bf16 run's checkpoint
        resumed in fp32). The slabs are laid out again (a copy of the moments)."""
        logger.info("CPUOffloadAdamW: %d parameter(s) get an fp32 master of their own (a dtype "
                    "change or a loaded master that differs from the parameter)", len(seeds))
        self._real_masters.update(seeds)
        self._relayout(seeds)

    def _init_state(self, slot: int, p: Tensor) -> None:
        slabs = self._slabs
        if not slabs.slots[slot].own_master:
            slabs.flat("master", slot).copy_(self._local_param(slot).detach().reshape(-1))
        if slabs.used[slot]:  # the moments of a slot never used are still the slabs' zeros
            slabs.flat("exp_avg", slot).zero_()
            slabs.flat("exp_avg_sq", slot).zero_()
        slabs.used[slot] = 1
        self.state[p].update(self._state_entry(slot, new_step_tensor()))

    def _state_entry(self, slot: int, step: Tensor) -> dict[str, Tensor]:
        """``master_param`` is the parameter itself where it is its own master (a live tensor
        sharing its storage, like the slab views), so saved state dicts keep their layout.
        Every new entry starts a new state generation (cached Items hold step tensors)."""
        self._state_gen += 1
        self._step_of[slot] = step
        self._slabs.used[slot] = 1
        own = self._slabs.slots[slot].own_master
        return {
            "step": step,
            "exp_avg": self._slabs.shaped("exp_avg", slot),
            "exp_avg_sq": self._slabs.shaped("exp_avg_sq", slot),
            "master_param": (
                self._local_param(slot).detach() if own else self._slabs.shaped("master", slot)
            ),
        }

    def _load_master(self, slot: int, master: Tensor) -> None:
        """A loaded ``master_param`` into the master slab. A parameter that is its own master keeps
        its value: its master is the model's weight, restored with the model (``load_state_dict``
        gave a master place to every such parameter whose loaded master differs from it)."""
        if not self._slabs.slots[slot].own_master:
            self._slabs.flat("master", slot).copy_(master.detach().reshape(-1))

    def _items(self, chunk: Chunk, grads: dict[int, Tensor]) -> list[Item]:
        """The chunk's items for this step: those of its views whose parameter has a gradient.

        Per-step Python must not grow per tensor where a chunk can be described once (a model of
        ~20,000 small tensors spent ~90 ms per step here building Items and hashing parameters
        for their state): the Items of a chunk are made once per layout, kernel and state
        generation and reused; a step only sets each one's gradient. Any view without a gradient,
        or with a gradient of another dtype than its parameter, takes the general path.
        """
        cached = self._item_cache.get(chunk.index)
        kernel, gen = self._settings.kernel, self._state_gen
        if cached is None or not (cached[0] is chunk and cached[1] == kernel and cached[2] == gen):
            items = []
            for v in chunk.views:
                p = self._params[v.slot]
                step = self.state[p].get("step") if p in self.state else None
                if step is None:
                    break  # a parameter without state yet: no template until it has one
                items.append(Item(v, self._local_param(v.slot), None, 0, step, self._fused(p, p)))
            else:
                cached = (chunk, kernel, gen, items, [it.param.dtype for it in items],
                          (sum(it.view.numel for it in items), any(it.fused for it in items)))
                self._item_cache[chunk.index] = cached
        if cached is not None and cached[0] is chunk and cached[2] == gen and cached[1] == kernel:
            items, dtypes = cached[3], cached[4]
            get = grads.get
            for it, dtype in zip(items, dtypes):
                g = get(it.view.slot)
                if g is None or g.dtype != dtype:
                    break
                it.grad = g  # grad_version is read only by jobs started in backward (own Items)
                if self._sharded:  # FSDP2 may give a DTensor a new local tensor (lazy init, load)
                    it.param = self._local_param(it.view.slot)
            else:
                return items
        items = []
        for v in chunk.views:
            g = grads.get(v.slot)
            if g is None:
                continue
            p = self._params[v.slot]
            items.append(Item(v, self._local_param(v.slot), g, g._version, self.state[p]["step"],
                              self._fused(p, g)))
        return items

    def _item_summary(self, chunk: Chunk, items: list[Item]) -> tuple[int, bool]:
        """(elements, any item on the native kernel) of a job's items; computed once for the
        reused item list of a chunk (see :meth:`_items`)."""
        cached = self._item_cache.get(chunk.index)
        if cached is not None and cached[3] is items:
            return cached[5]
        return sum(it.view.numel for it in items), any(it.fused for it in items)

    def _fused(self, p: Tensor, g: Tensor | None) -> int:
        """Which kernel updates ``p`` this step (an ``Item.fused`` kind): with ``kernel="fused-mp"``
        its mixed-precision entry for bf16/fp16 with a same-dtype gradient, its fp32 entry for fp32
        with an fp32 gradient; else torch's kernel."""
        if self._settings.kernel != "fused-mp" or g is None or g.dtype != p.dtype:
            return KIND_TORCH
        if p.dtype in _LOWP_DTYPES:
            return KIND_MP
        return KIND_F32 if p.dtype == torch.float32 else KIND_TORCH

    def _check_idle(self, what: str) -> None:
        if self._in_step:
            raise RuntimeError(f"CPUOffloadAdamW.{what} called while step() is running")
        if self._overlap is not None and self._overlap.has_launched():
            raise RuntimeError(
                f"CPUOffloadAdamW.{what} called after backward() started chunks early "
                "(overlap_backward=True) and before step(): finish the step first"
            )

    # ---------------------------------------------------------------- overlap_backward
    @staticmethod
    def _launch_via(ref: weakref.ref[CPUOffloadAdamW]) -> Callable[[Chunk], _Launch | None]:
        def launch(chunk: Chunk) -> _Launch | None:
            opt = ref()
            return None if opt is None else opt._launch_early(chunk)

        return launch

    def _launch_early(self, chunk: Chunk) -> _Launch | None:
        """Called from a backward hook (under the overlap lock): submit the chunk's d2h + kernel."""
        grads: dict[int, tuple[Tensor | None, int]] = {}
        for slot in {v.slot for v in chunk.views}:
            p = self._params[slot]
            g = None if p.grad is None else local(p.grad)  # FSDP2: the reduce-scattered shard
            if g is None or g.is_sparse or not self.state.get(p):
                return None  # not launchable early; step() runs it
            grads[slot] = (g, g._version)
        self._edits.launch(self._params, self._slabs, grads)
        event = None
        if self._device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
        items = [
            Item(v, self._local_param(v.slot), grads[v.slot][0], grads[v.slot][1],
                 self.state[self._params[v.slot]]["step"],
                 self._fused(self._params[v.slot], grads[v.slot][0]))
            for v in chunk.views
        ]
        job = ChunkJob(
            chunk.index,
            items,
            _hyper(self.param_groups[chunk.group]),
            self._settings.threads or 1,
            update=True,
            materialize=False,
            check_versions=True,
            ready_event=event,
        )
        self._pipeline.submit(job)
        return _Launch(job, grads)

    def _verify_launches(self, launched: dict[int, _Launch]) -> None:
        stale = []
        for c, launch in sorted(launched.items()):
            for slot, (g, version) in launch.grads.items():
                now = self._params[slot].grad
                now = None if now is None else local(now)
                if now is not g or (now is not None and now._version != version):
                    stale.append((c, slot))
        if not stale:
            return
        result = self._pipeline.drain()
        mutated = sorted(c for c, launch in launched.items() if launch.job.kernel_ran)
        chunk, slot = stale[0]
        p = self._params[slot]
        raise RuntimeError(
            f"CPUOffloadAdamW(overlap_backward=True): the gradient of parameter {slot} (shape "
            f"{tuple(p.shape)}) changed after its chunk {chunk} started during backward (e.g. "
            "gradient clipping, GradScaler.unscale_, zero_grad(), or a second backward() outside "
            "opt.accumulating()). "
            + (
                f"The optimizer state of the early chunk(s) {mutated} was already advanced by "
                "this step: restore the optimizer from a checkpoint. "
                if mutated
                else "No optimizer state was changed (the kernels had not run yet). "
            )
            + "The model's parameters were not written. Use opt.accumulating() for gradient "
            "accumulation, or overlap_backward=False to modify gradients before step()."
        ) from result.error
