"""AdamW kernels on one chunk of host slabs.

Three kernels share one keyword-only calling convention (lists of per-view tensors, the step
tensors of their parameters, ``steps_to_increment``, :class:`Hyper`):

* :func:`fused_adamw_` ("torch"): torch's fused CPU AdamW on fp32 master, grad and moments;
* :func:`mixed_precision_adamw_` ("fused-mp", bf16/fp16 parameters): the single-pass kernel of
  :mod:`offload.kernels._fused_mp`: reads the bf16/fp16 gradient, updates the fp32 master and moments,
  writes the bf16/fp16 weight;
* :func:`native_adamw_f32_` ("fused-mp", fp32 parameters): the same extension's fp32 entry point,
  one parallel region per call with dynamic blocks (torch's kernel runs one ``parallel_for`` per
  tensor with a fixed split), bitwise equal to torch's fused kernel on the verified builds.

:func:`torch_mp_adamw_` is the torch path with fused-mp's signature (upcast, torch's kernel,
downcast): the reference the fused-mp tests and benchmarks compare against.

torch's fused AdamW is a private torch op, so it is called from exactly one function,
:func:`fused_adamw_`, which mirrors the step-count
handling of ``torch/optim/adam.py::_fused_adam``: the fp32 step tensors are incremented with
``torch._foreach_add_(steps, 1)`` right before the fused call, and a CPU ``lr`` tensor is passed
through unchanged. With the same inputs the result is bitwise equal to
``torch.optim.AdamW(fused=True)`` on the same tensors.

Gradient transforms (:class:`Hyper`'s ``grad_scale``, ``grad_coef``, ``found_inf``), honoured by
every kernel of :class:`KernelSet`, bitwise:

* ``grad_scale`` s: the gradient divided by s in fp32, as ``torch._fused_adamw_(grad_scale=s)``
  does on an fp32 (or upcast) gradient;
* ``grad_coef`` c: then multiplied by c, the product rounded to the gradient's dtype, as
  ``torch._foreach_mul_(grads, c)`` stores it (checked against torch on random bit patterns,
  subnormals, infinities and NaNs: equal except NaN payloads, which differ between torch's own
  vector and scalar paths); both given: ``round_to_grad_dtype((g / s) * c)``;
* ``found_inf`` 1: no update; the step tensors end where they were (``_fused_adam``'s
  ``_foreach_add_(steps, 1)`` then ``_foreach_sub_(steps, found_inf)``); 0: an ordinary step.

The gradients themselves are never written (torch's fused kernel writes ``g / s`` back into the
gradient it is given; a speculative step validates gradients by content, so ours only read).
The native kernels apply the transforms as they load each element (no extra pass); the torch
kernel, which cannot, works on a copy in a reusable per-thread buffer (one chunk of fp32, plus
one of bf16/fp16 where ``grad_dtypes`` names a gradient upcast from one).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from offload.kernels._rounding import round_moments_, sr_key
from offload.kernels._fused_mp import (
    Rounding,
    StepOptions,
    bitwise_matches_torch,
    call_f32_unchecked,
    call_steps_unchecked,
    fused_mp_available,
)
from offload.kernels._build import ExtensionLoader
from offload.kernels._grad_stats import checksums_, grad_stats_
from offload.kernels._outputs import native_copy_, speculation_outputs, swap_storages_

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_KERNELS",
    "Hyper",
    "KernelSet",
    "ChecksumKernel",
    "StatsKernel",
    "check_grad_transform",
    "fused_adamw_",
    "mixed_precision_adamw_",
    "native_adamw_f32_",
    "native_options",
    "new_step_tensor",
]


@dataclass(frozen=True, slots=True)
class Hyper:
    """AdamW hyper-parameters of one param group, read when a chunk is launched."""

    lr: float | Tensor
    beta1: float
    beta2: float
    weight_decay: float
    eps: float
    grad_coef: Tensor | None = None
    """A 0-d fp32 CPU tensor multiplied into every gradient before the update, as
    ``torch._foreach_mul_(grads, coef)`` does it (the product rounded to the gradient's dtype):
    the gradient-clipping coefficient of ``CPUOffloadAdamW.clip_grad_norm_``. The gradients
    themselves are never written. None: 1."""
    grad_scale: Tensor | None = None
    """As ``torch._fused_adamw_``'s ``grad_scale`` (``GradScaler.step``): gradients divided by it."""
    found_inf: Tensor | None = None
    """As ``torch._fused_adamw_``'s ``found_inf``: 1 skips the update and leaves the step tensors
    as they were, 0 is an ordinary step (any other value raises). The optimizer may skip the whole
    step before any kernel runs; the kernels honour it either way."""


_LOWP = (torch.bfloat16, torch.float16)


def _scalar(value: Tensor | None, name: str) -> float | None:
    """The fp32 value of a one-element fp32 CPU tensor (None stays None); ValueError otherwise."""
    if value is None:
        return None
    if (not isinstance(value, Tensor) or value.numel() != 1 or value.dtype != torch.float32
            or value.device.type != "cpu"):
        what = (f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
                if isinstance(value, Tensor) else f"a {type(value).__name__}")
        raise ValueError(f"Hyper.{name} is {what}: expected a one-element torch.float32 CPU tensor")
    return float(value.item())


def check_grad_transform(hyper: Hyper) -> tuple[float | None, float | None, bool]:
    """``(grad_scale, grad_coef, skip)`` of ``hyper`` as Python floats (None: not given) and whether
    ``found_inf`` skips the update; ValueError for a tensor that is not a one-element fp32 CPU
    tensor, or a ``found_inf`` other than 0 or 1."""
    scale = _scalar(hyper.grad_scale, "grad_scale")
    coef = _scalar(hyper.grad_coef, "grad_coef")
    found = _scalar(hyper.found_inf, "found_inf")
    if found is not None and found not in (0.0, 1.0):
        raise ValueError(f"Hyper.found_inf is {found!r}: expected 0.0 or 1.0 (GradScaler's values)")
    return scale, coef, found == 1.0


def _skip_step(steps_to_increment: Sequence[Tensor], found_inf: Tensor) -> None:
    """An overflow step: the step tensors as ``_fused_adam`` leaves them (+1, then -found_inf)."""
    if steps_to_increment:
        steps = list(steps_to_increment)
        torch._foreach_add_(steps, 1)
        torch._foreach_sub_(steps, [found_inf] * len(steps))


class _GradBuffers(threading.local):
    """Per-thread flat buffers the torch kernel's transformed gradients are written into; grown
    to the largest chunk seen, never shrunk (one chunk of fp32, one per low-precision dtype)."""

    def __init__(self) -> None:
        self.flat: dict[torch.dtype, Tensor] = {}

    def views(self, dtype: torch.dtype, sizes: Sequence[int]) -> list[Tensor]:
        align = 16  # elements: every view starts on a 64-byte boundary of the fp32 buffer
        starts, total = [], 0
        for n in sizes:
            starts.append(total)
            total += -(-n // align) * align
        flat = self.flat.get(dtype)
        if flat is None or flat.numel() < total:
            flat = self.flat[dtype] = torch.empty(total, dtype=dtype)
        return [flat[a : a + n] for a, n in zip(starts, sizes)]


_BUFFERS = _GradBuffers()


def _transformed(grads: Sequence[Tensor], scale: Tensor | None, coef: Tensor | None,
                 grad_dtypes: Sequence[torch.dtype]) -> list[Tensor]:
    """Copies of ``grads`` (fp32) with the transforms of the module doc applied, except a lone
    ``scale``, which is left for torch's kernel to apply to the copy."""
    views = [v.view(g.shape) for v, g in
             zip(_BUFFERS.views(torch.float32, [g.numel() for g in grads]), grads)]
    torch._foreach_copy_(views, list(grads))
    if coef is None:
        return views
    if scale is not None:
        torch._foreach_div_(views, scale)
    lowp = [i for i, dt in enumerate(grad_dtypes) if dt in _LOWP]
    upcast = set(lowp)
    full = [v for i, v in enumerate(views) if i not in upcast] if lowp else views
    if full:
        torch._foreach_mul_(full, coef)
    for dt in _LOWP:  # gradients upcast from bf16/fp16: the product rounded as torch rounds it
        idx = [i for i in lowp if grad_dtypes[i] == dt]
        if not idx:
            continue
        wide = [views[i] for i in idx]
        small = [v.view(w.shape) for v, w in zip(_BUFFERS.views(dt, [w.numel() for w in wide]), wide)]
        if scale is None:  # exactly the bf16/fp16 gradient, multiplied as torch multiplies it
            torch._foreach_copy_(small, wide)
            torch._foreach_mul_(small, coef)
        else:  # (g / s) * c in fp32, rounded once
            torch._foreach_mul_(wide, coef)
            torch._foreach_copy_(small, wide)
        torch._foreach_copy_(wide, small)
    return views


def new_step_tensor(value: float = 0.0) -> Tensor:
    """A step counter shaped and typed like torch's fused AdamW keeps it (0-d fp32), on the host."""
    return torch.tensor(float(value), dtype=torch.float32)


def fused_adamw_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    state_steps: Sequence[Tensor],
    *,
    steps_to_increment: Sequence[Tensor],
    hyper: Hyper,
    grad_dtypes: Sequence[torch.dtype] = (),
    rounding: Rounding | None = None,
) -> None:
    """One decoupled-weight-decay Adam update of host fp32 tensors, in place (bf16 moments: upcast,
    updated in fp32, rounded to nearest-even as they are stored back: ``state_dtype``).

    ``state_steps[i]`` is the step tensor of the parameter ``params[i]`` is a view of; a chunk may
    hold several views of one parameter across calls, so only ``steps_to_increment`` (each
    parameter's step tensor, once per optimizer step) is incremented here, before the update,
    exactly as ``_fused_adam`` does with ``torch._foreach_add_(device_state_steps, 1)``.

    ``hyper``'s gradient transforms apply as the module doc says, to copies: ``grads`` are only
    read. ``grad_dtypes``: empty, or per gradient the dtype it had before it was upcast into the
    fp32 tensor given here (a bf16/fp16 gradient of the torch kernel): with ``grad_coef`` the
    product is rounded to that dtype, as torch's ``_foreach_mul_`` on the original gradient rounds
    it. Without it an upcast gradient's product would stay unrounded, so a caller passing upcast
    gradients with ``grad_coef`` must give it.
    """
    scale_v, coef_v, skip = check_grad_transform(hyper)
    if grad_dtypes and len(grad_dtypes) != len(grads):
        raise ValueError(f"fused_adamw_: grad_dtypes has {len(grad_dtypes)} entries: expected "
                         f"{len(grads)} (one per gradient) or none")
    if not params:
        return
    if skip:
        _skip_step(steps_to_increment, hyper.found_inf)  # type: ignore[arg-type]
        return
    grad_scale = hyper.grad_scale
    if scale_v is not None or coef_v is not None:
        grads = _transformed(grads, grad_scale, hyper.grad_coef, grad_dtypes)
        if coef_v is not None:
            grad_scale = None  # applied by _transformed, before the coefficient
    if steps_to_increment:
        torch._foreach_add_(list(steps_to_increment), 1)
    lr = hyper.lr
    if isinstance(lr, Tensor) and lr.device.type != "cpu":
        lr = lr.to("cpu")
    stored = None
    if exp_avgs and exp_avgs[0].dtype != torch.float32:  # bf16 moments: the fp32 update, then rounded
        stored = (list(exp_avgs), list(exp_avg_sqs))
        exp_avgs = [m.to(torch.float32) for m in exp_avgs]
        exp_avg_sqs = [m.to(torch.float32) for m in exp_avg_sqs]
    torch._fused_adamw_(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        [],  # max_exp_avg_sqs: amsgrad is not supported
        list(state_steps),
        amsgrad=False,
        lr=lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        maximize=False,
        grad_scale=grad_scale,
        found_inf=None,  # 1 was handled above; 0 changes nothing (no _foreach_sub_ needed)
    )
    if stored is not None and rounding is not None:  # stochastically, as the native kernels
        seed, slots, starts = rounding
        for i, (ea, eas) in enumerate(zip(*stored)):
            round_moments_(ea, eas, exp_avgs[i], exp_avg_sqs[i],
                           key=sr_key(seed, float(state_steps[i]), slots[i]), start=starts[i])
    elif stored is not None:  # rounded to nearest-even, as the native kernels store them
        torch._foreach_copy_(stored[0], list(exp_avgs))
        torch._foreach_copy_(stored[1], list(exp_avg_sqs))


def native_options(hyper: Hyper, steps_to_increment: Sequence[Tensor],
                   rounding: Rounding | None = None) -> StepOptions | None:
    """The native kernels' one record of a call (:class:`StepOptions`): ``hyper`` as the floats
    the kernel reads, and ``rounding``; None where ``found_inf`` skips the step (done here)."""
    scale, coef, skip = check_grad_transform(hyper)
    if skip:
        _skip_step(steps_to_increment, hyper.found_inf)  # type: ignore[arg-type]
        return None
    lr = hyper.lr
    return StepOptions(lr=float(lr.item()) if isinstance(lr, Tensor) else float(lr), beta1=hyper.beta1,
                       beta2=hyper.beta2, eps=hyper.eps, weight_decay=hyper.weight_decay,
                       grad_scale=scale, grad_coef=coef, rounding=rounding)


def native_adamw_f32_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    state_steps: Sequence[Tensor],
    *,
    steps_to_increment: Sequence[Tensor],
    hyper: Hyper,
    outs: Sequence[Tensor] = (),
    into: Sequence[Tensor] = (),
    checksums: Tensor | None = None,
    rounding: Rounding | None = None,
    loader: ExtensionLoader | None = None,
) -> None:
    """:func:`fused_adamw_`'s update of fp32 tensors by the native kernel, in one call per chunk
    (``rounding``: bf16 moments rounded stochastically, ``offload.kernels._rounding``).

    ``params[i]`` is updated in place (it is its own master: a parameter of a CPU model, or a
    master slab view), or out of place into ``into``; ``outs``, if given, receive a copy of each
    updated parameter. ``into`` and ``checksums``: see :func:`speculation_outputs`. ``loader``: whose extension runs (None: the
    process's). Raises ``FusedMPUnavailable`` when the kernel could not be built.
    """
    options = native_options(hyper, steps_to_increment, rounding)
    if options is None:
        speculation_outputs(grads, params, exp_avgs, exp_avg_sqs, into, checksums)
        return
    call_f32_unchecked(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(state_steps),
        outs=list(outs), steps_to_increment=list(steps_to_increment), options=options,
        into=list(into), checksums=checksums, loader=loader,
    )


def mixed_precision_adamw_(
    params_lowp: Sequence[Tensor],
    grads_lowp: Sequence[Tensor],
    masters: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    state_steps: Sequence[Tensor],
    *,
    steps_to_increment: Sequence[Tensor],
    hyper: Hyper,
    into: Sequence[Tensor] = (),
    checksums: Tensor | None = None,
    seen: Sequence[Tensor] = (),
    follow: bool = False,
    rounding: Rounding | None = None,
    loader: ExtensionLoader | None = None,
) -> None:
    """The fused-mp step of :func:`offload.kernels._fused_mp.fused_mp_adamw_steps_` with
    :func:`fused_adamw_`'s step handling: ``steps_to_increment`` are incremented first, then every
    view is updated with its own parameter's step, in one kernel call.

    ``params_lowp[i]`` receives the updated master rounded to the low-precision dtype;
    ``grads_lowp[i]`` is read as is (no fp32 copy). ``seen``: none, or per view the weights as
    they are now (the live parameter, which may be ``params_lowp[i]`` itself): an element whose
    master does not round to its weight takes the weight's value first, in the kernel's pass (an
    edit through ``.data`` that no version counter shows: :func:`follow_weights` is the same with
    torch ops); with ``checksums`` their words are added to the gradient's checksum. ``follow``:
    ``seen`` is ``params_lowp`` (the kernel writes the live weights it compares with). ``loader``:
    whose extension runs (None: the process's). ``into`` and ``checksums``: see
    :func:`speculation_outputs`. Raises
    ``FusedMPUnavailable`` when the kernel could not be built (the optimizer checks first and keeps
    the torch path then).
    """
    if follow:
        seen = params_lowp
    options = native_options(hyper, steps_to_increment, rounding)
    if options is None:
        speculation_outputs(grads_lowp, masters, exp_avgs, exp_avg_sqs, into, checksums, seen=seen)
        return
    dtypes = {(p.dtype, g.dtype) for p, g in zip(params_lowp, grads_lowp)}
    if len(dtypes) <= 1:  # the usual case: one call
        call_steps_unchecked(
            list(params_lowp), list(grads_lowp), list(masters), list(exp_avgs), list(exp_avg_sqs),
            list(state_steps), steps_to_increment=list(steps_to_increment), options=options,
            into=list(into), checksums=checksums, seen=list(seen), loader=loader,
        )
        return
    # A chunk mixing bf16 and fp16 parameters: one call per dtype pair (a call takes one of each).
    if steps_to_increment:
        torch._foreach_add_(list(steps_to_increment), 1)
    for pair in sorted(dtypes, key=str):
        idx = [i for i, (p, g) in enumerate(zip(params_lowp, grads_lowp)) if (p.dtype, g.dtype) == pair]
        sums = None if checksums is None else torch.zeros(len(idx), dtype=torch.int64)
        call_steps_unchecked(
            *([lst[i] for i in idx] for lst in (params_lowp, grads_lowp, masters, exp_avgs,
                                                exp_avg_sqs, state_steps)),
            steps_to_increment=[],
            options=options if rounding is None else dataclasses.replace(
                options, rounding=(rounding[0], [rounding[1][i] for i in idx], [rounding[2][i] for i in idx])),
            into=[into[3 * i + k] for i in idx for k in range(3)] if into else [],
            checksums=sums, seen=[seen[i] for i in idx] if seen else [],
            loader=loader,
        )
        if checksums is not None:
            checksums[idx] = sums



Kernel = Callable[..., None]
"""A kernel of the calling convention above: positional tensor lists, then ``steps_to_increment``
and ``hyper`` (and ``outs`` for the fp32 native kernel) by keyword."""

StatsKernel = Callable[..., tuple[Tensor, Tensor]]
ChecksumKernel = Callable[..., Tensor]
"""``offload.kernels._grad_stats.grad_stats_``'s signature: ``(tensors, *, norm_type=2.0)`` ->
``(terms float64, checksums int64)``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelSet:
    """The kernel functions the pipeline calls, one per item kind (``offload.pipeline._jobs.ItemKind``),
    and the loader of the native extension two of them run on.

    The pipeline and everything under it call kernels only through the set they were given, so a
    test spies on a kernel or makes one fail by passing a set (``KernelSet(fused_adamw=spy)``), or
    makes the native kernel unavailable (``KernelSet(loader=<a loader of a missing source>)``),
    instead of patching module globals.
    """

    fused_adamw: Kernel = fused_adamw_
    """Items of kind TORCH: torch's fused AdamW on fp32 master, gradient and moments."""
    mixed_precision_adamw: Kernel = mixed_precision_adamw_
    """Items of kind MP: the single-pass bf16/fp16 kernel (fused-mp)."""
    native_adamw_f32: Kernel = native_adamw_f32_
    """Items of kind F32: fused-mp's fp32 entry point (also takes ``outs=``)."""
    grad_stats: StatsKernel = grad_stats_
    """Per-tensor norm terms and content checksums of gradients (clipping): the native pass
    where the extension is built, else the torch reference."""
    checksums: ChecksumKernel = checksums_
    """Per-tensor content checksums alone (speculation checks: no norm work), the checksums of
    ``grad_stats``."""
    copy: Kernel = native_copy_
    """The native kernels' weight copies (``dsts``, ``srcs``; see :func:`native_copy_`)."""
    swap: Kernel = swap_storages_
    """A speculation's commit: swaps the memory of two generations' storages (``a``, ``b``; see
    :func:`offload.kernels._outputs.swap_storages_`); :meth:`storage_swap` says whether it runs."""
    loader: ExtensionLoader | None = None
    """Builds and loads the native extension: :meth:`available` asks it, and the two native kernels
    and ``grad_stats`` left at their defaults run on what it loads. None: the process's loader
    (built once per process, ``offload.kernels._fused_mp.process_loader``)."""

    def __post_init__(self) -> None:
        if self.loader is None:
            return
        defaults: tuple[tuple[str, Callable[..., object]], ...] = (
            ("mixed_precision_adamw", mixed_precision_adamw_),
            ("native_adamw_f32", native_adamw_f32_), ("grad_stats", grad_stats_),
            ("checksums", checksums_), ("copy", native_copy_), ("swap", swap_storages_))
        for name, default in defaults:
            if getattr(self, name) is default:  # the default kernel, on this set's extension
                object.__setattr__(self, name, functools.partial(default, loader=self.loader))

    def available(self) -> tuple[bool, str]:
        """Whether the native kernels can run here, and why (or why not); see
        ``offload.kernels._fused_mp.fused_mp_available`` (the first call builds the extension)."""
        return fused_mp_available(self.loader)

    def storage_swap(self) -> Kernel | None:
        """:attr:`swap` where the native extension runs here, else None (``HostSlabs.swap`` then
        copies the new generation into the committed one)."""
        if self.swap is not swap_storages_ and not isinstance(self.swap, functools.partial):
            return self.swap  # a test's own swap
        return self.swap if self.available()[0] else None

    def resolve(self, kernel: str) -> str:
        """The kernel that runs for the setting ``kernel``: ``"fused-mp"`` where it can run here
        (:meth:`available`), else ``"torch"`` (the reason is logged); ``"auto"`` is ``"fused-mp"``
        only where it is also bitwise equal to torch's kernel on this build
        (``offload.kernels._fused_mp.bitwise_matches_torch``)."""
        if kernel == "torch":
            return kernel
        if kernel == "auto" and not bitwise_matches_torch():
            logger.debug("CPUOffloadAdamW: kernel='auto' uses 'torch': fused-mp is not verified "
                         "bitwise equal to torch's kernel on this torch build and CPU")
            return "torch"
        ok, reason = self.available()  # builds on first use; logs a failure once (WARNING)
        if not ok:
            logger.debug("CPUOffloadAdamW: kernel=%r unavailable, using 'torch': %s", kernel, reason)
            return "torch"
        return "fused-mp"


#: The kernels of a pipeline nobody gave other ones.
DEFAULT_KERNELS = KernelSet()
