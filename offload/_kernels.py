"""AdamW kernels on one chunk of host slabs.

Three kernels share one keyword-only calling convention (lists of per-view tensors, the step
tensors of their parameters, ``steps_to_increment``, :class:`Hyper`):

* :func:`fused_adamw_` ("torch"): torch's fused CPU AdamW on fp32 master, grad and moments;
* :func:`mixed_precision_adamw_` ("fused-mp", bf16/fp16 parameters): the single-pass kernel of
  :mod:`offload._fused_mp`: reads the bf16/fp16 gradient, updates the fp32 master and moments,
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
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from offload._fused_mp import (
    call_f32_unchecked,
    call_steps_unchecked,
    check_hyper,
    check_lists,
    check_step,
    fused_mp_available,
)
from offload._fused_mp_build import ExtensionLoader

__all__ = [
    "DEFAULT_KERNELS",
    "Hyper",
    "KernelSet",
    "fused_adamw_",
    "mixed_precision_adamw_",
    "native_adamw_f32_",
    "new_step_tensor",
    "torch_mp_adamw_",
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
    """As ``torch._fused_adamw_``'s ``found_inf``: nonzero skips the update (the optimizer skips
    the whole step before any kernel runs, so kernels see it only as 0)."""


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
) -> None:
    """One decoupled-weight-decay Adam update of host fp32 tensors, in place.

    ``state_steps[i]`` is the step tensor of the parameter ``params[i]`` is a view of; a chunk may
    hold several views of one parameter across calls, so only ``steps_to_increment`` (each
    parameter's step tensor, once per optimizer step) is incremented here, before the update,
    exactly as ``_fused_adam`` does with ``torch._foreach_add_(device_state_steps, 1)``.
    """
    if not params:
        return
    if steps_to_increment:
        torch._foreach_add_(list(steps_to_increment), 1)
    lr = hyper.lr
    if isinstance(lr, Tensor) and lr.device.type != "cpu":
        lr = lr.to("cpu")
    grads = list(grads)
    if hyper.grad_coef is not None:  # out of place: the caller's gradients are not written
        grads = torch._foreach_mul(grads, hyper.grad_coef)
    elif hyper.grad_scale is not None:  # torch's CPU kernel stores the unscaled gradient back
        grads = [g.clone() for g in grads]
    torch._fused_adamw_(
        list(params),
        grads,
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
        grad_scale=hyper.grad_scale,
        found_inf=hyper.found_inf,
    )


def _hyper_args(hyper: Hyper) -> dict[str, float]:
    lr = hyper.lr
    return {
        "lr": float(lr.item()) if isinstance(lr, Tensor) else float(lr),
        "beta1": hyper.beta1,
        "beta2": hyper.beta2,
        "eps": hyper.eps,
        "weight_decay": hyper.weight_decay,
    }


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
    loader: ExtensionLoader | None = None,
) -> None:
    """:func:`fused_adamw_`'s update of fp32 tensors by the native kernel, in one call per chunk.

    ``params[i]`` is updated in place (it is its own master: a parameter of a CPU model, or a
    master slab view); ``outs``, if given, receive a copy of each updated parameter. ``loader``:
    whose extension runs (None: the process's). Raises ``FusedMPUnavailable`` when the kernel could
    not be built.
    """
    call_f32_unchecked(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(state_steps),
        outs=list(outs), steps_to_increment=list(steps_to_increment), **_hyper_args(hyper),
        loader=loader,
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
    loader: ExtensionLoader | None = None,
) -> None:
    """The fused-mp step of :func:`offload._fused_mp.fused_mp_adamw_steps_` with
    :func:`fused_adamw_`'s step handling: ``steps_to_increment`` are incremented first, then every
    view is updated with its own parameter's step, in one kernel call.

    ``params_lowp[i]`` receives the updated master rounded to the low-precision dtype;
    ``grads_lowp[i]`` is read as is (no fp32 copy). ``loader``: whose extension runs (None: the
    process's). Raises ``FusedMPUnavailable`` when the kernel could not be built (the optimizer
    checks first and keeps the torch path then).
    """
    hyper_args = _hyper_args(hyper)
    dtypes = {(p.dtype, g.dtype) for p, g in zip(params_lowp, grads_lowp)}
    if len(dtypes) <= 1:  # the usual case: one call
        call_steps_unchecked(
            list(params_lowp), list(grads_lowp), list(masters), list(exp_avgs), list(exp_avg_sqs),
            list(state_steps), steps_to_increment=list(steps_to_increment), **hyper_args,
            loader=loader,
        )
        return
    # A chunk mixing bf16 and fp16 parameters: one call per dtype pair (a call takes one of each).
    if steps_to_increment:
        torch._foreach_add_(list(steps_to_increment), 1)
    for pair in sorted(dtypes, key=str):
        idx = [i for i, (p, g) in enumerate(zip(params_lowp, grads_lowp)) if (p.dtype, g.dtype) == pair]
        call_steps_unchecked(
            *([lst[i] for i in idx] for lst in (params_lowp, grads_lowp, masters, exp_avgs,
                                                exp_avg_sqs, state_steps)),
            steps_to_increment=[],
            **hyper_args,
            loader=loader,
        )



@torch.no_grad()
def torch_mp_adamw_(
    params_lowp: Sequence[Tensor],
    grads_lowp: Sequence[Tensor],
    masters: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_buffers: Sequence[Tensor] | None = None,
) -> None:
    """The torch path with ``offload._fused_mp.fused_mp_adamw_``'s signature: the reference of the
    fused-mp tests and benchmarks.

    Upcasts each gradient into an fp32 buffer (``grad_buffers`` when given, else new tensors),
    runs ``torch._fused_adamw_`` on the fp32 masters and moments, and copies the masters into the
    low-precision parameters. Three passes, about 40 bytes per parameter.
    """
    check_lists(
        params_lowp=params_lowp, grads_lowp=grads_lowp, masters=masters, exp_avgs=exp_avgs,
        exp_avg_sqs=exp_avg_sqs,
    )
    check_step(step)
    check_hyper(lr, beta1, beta2, eps, weight_decay)
    if not masters:
        return
    if grad_buffers is None:
        grads32 = [g.to(torch.float32) for g in grads_lowp]
    else:
        grads32 = list(grad_buffers)
        torch._foreach_copy_(grads32, list(grads_lowp))
    steps = [torch.tensor(float(step))] * len(masters)
    fused_adamw_(
        list(masters), grads32, list(exp_avgs), list(exp_avg_sqs), steps, steps_to_increment=(),
        hyper=Hyper(lr=float(lr), beta1=float(beta1), beta2=float(beta2),
                    weight_decay=float(weight_decay), eps=float(eps)),
    )
    torch._foreach_copy_(list(params_lowp), list(masters))

Kernel = Callable[..., None]
"""A kernel of the calling convention above: positional tensor lists, then ``steps_to_increment``
and ``hyper`` (and ``outs`` for the fp32 native kernel) by keyword."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelSet:
    """The kernel functions the pipeline calls, one per item kind (``offload._jobs.ItemKind``),
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
    loader: ExtensionLoader | None = None
    """Builds and loads the native extension: :meth:`available` asks it, and the two native kernels
    left at their defaults run on what it loads. None: the process's loader (built once per
    process, ``offload._fused_mp.process_loader``)."""

    def __post_init__(self) -> None:
        if self.loader is None:
            return
        for name, default in (("mixed_precision_adamw", mixed_precision_adamw_),
                              ("native_adamw_f32", native_adamw_f32_)):
            if getattr(self, name) is default:  # the default kernel, on this set's extension
                object.__setattr__(self, name, functools.partial(default, loader=self.loader))

    def available(self) -> tuple[bool, str]:
        """Whether the native kernels can run here, and why (or why not); see
        ``offload._fused_mp.fused_mp_available`` (the first call builds the extension)."""
        return fused_mp_available(self.loader)


#: The kernels of a pipeline nobody gave other ones.
DEFAULT_KERNELS = KernelSet()
