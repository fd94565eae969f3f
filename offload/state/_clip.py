"""Gradient clipping and GradScaler folded into the step: no separate pass over the gradients.

``torch.nn.utils.clip_grad_norm_`` reads every gradient twice before the step reads it again:
once for the norms (``torch._foreach_norm``, about 8 GB/s on the 2-core VM, a quarter of the
memory's speed) and once to multiply it by the coefficient. On that VM, 50M fp32 parameters, it
took 31 ms next to a 34-37 ms AdamW step. :meth:`CPUOffloadAdamW.clip_grad_norm_` computes the
per-tensor norm terms in one pass (float64, fixed blocking: the same bits for any thread count and
chunk size) and hands the coefficient to the next ``step()`` as ``Hyper.grad_coef``: the kernel
multiplies each gradient as it reads it, as torch's ``_foreach_mul_`` would (bitwise, given the
same coefficient), and the gradients stay as they are.

The coefficient is torch's: ``clamp(max_norm / (total_norm + 1e-6), max=1.0)`` in float32, with
the total norm rounded to float32 first. For DTensor parameters the terms are reduced over every
rank holding another shard, replicated mesh dimensions counted once
(``offload.state._dtensor.reduce_norm_terms``).

:func:`amp_arguments` takes what ``GradScaler.step`` hands an optimizer that sets
``_step_supports_amp_scaling``: ``grad_scale`` (divided inside the kernel, as torch's fused AdamW
does) and ``found_inf`` (nonzero: the step is skipped).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from offload.state._dtensor import local, reduce_norm_terms
from offload.state._params import ParamRecord

__all__ = ["ClipRequest", "NonFiniteNorm", "amp_arguments", "clip_request"]


class NonFiniteNorm(RuntimeError):
    """``error_if_nonfinite=True`` and the total norm is inf or nan (torch raises RuntimeError)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ClipRequest:
    """What ``clip_grad_norm_`` computed, for the next ``step()``."""

    total_norm: Tensor
    """The total norm (float32, on the parameters' device), as torch's function returns it."""
    coef: Tensor | None
    """The coefficient the kernel multiplies the gradients by (0-d float32, CPU); None when no
    parameter has a gradient."""


def _check(max_norm: Any, norm_type: Any, error_if_nonfinite: Any, foreach: Any) -> tuple[float, float]:
    try:
        max_norm, norm_type = float(max_norm), float(norm_type)
    except (TypeError, ValueError):
        raise TypeError(f"clip_grad_norm_(max_norm={max_norm!r}, norm_type={norm_type!r}): expected "
                        "numbers") from None
    if math.isnan(max_norm) or max_norm < 0:
        raise ValueError(f"clip_grad_norm_(max_norm={max_norm!r}): expected a number >= 0")
    if math.isnan(norm_type) or norm_type <= 0:
        raise ValueError(f"clip_grad_norm_(norm_type={norm_type!r}): expected a number > 0 or inf")
    if not isinstance(error_if_nonfinite, bool):
        raise TypeError(f"clip_grad_norm_(error_if_nonfinite={error_if_nonfinite!r}): expected a bool")
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"clip_grad_norm_(foreach={foreach!r}): expected None or a bool")
    return max_norm, norm_type


def clip_request(records: Sequence[ParamRecord], grads: Mapping[int, Tensor], *, max_norm: Any,
                 norm_type: Any, error_if_nonfinite: Any, foreach: Any, device: torch.device,
                 grad_stats: Any) -> ClipRequest:
    """The total norm of ``grads`` (slot -> gradient, DTensor or plain) and its coefficient."""
    max_norm, norm_type = _check(max_norm, norm_type, error_if_nonfinite, foreach)
    slots = sorted(grads)
    params = [records[s].param for s in slots]
    dense = [g if g.is_contiguous() else g.contiguous() for g in (local(grads[s]) for s in slots)]
    terms = grad_stats(dense, norm_type=norm_type)[0].to("cpu") if slots else torch.zeros(0, dtype=torch.float64)
    total64 = reduce_norm_terms(params, terms, norm_type) if slots else torch.zeros((), dtype=torch.float64)
    if not math.isinf(norm_type):
        total64 = total64 ** (1.0 / norm_type)
    total = total64.to(torch.float32)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise NonFiniteNorm(
            f"The total norm of order {norm_type} for gradients from the optimizer's parameters is "
            "non-finite, so it cannot be clipped. To disable this error and scale the gradients by "
            "the non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = None
    if slots:  # spelled as torch's clip_grads_with_norm_ (``float / tensor`` is reciprocal * float)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return ClipRequest(total_norm=total.to(device), coef=coef)


def amp_arguments(grad_scale: Tensor | None, found_inf: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """(grad_scale, found_inf) as ``GradScaler.step`` set them on the optimizer (None, None
    without it); the scale as a 0-d float32 CPU tensor (the kernels run on the CPU)."""
    if grad_scale is not None:
        grad_scale = grad_scale.detach().to("cpu", torch.float32).reshape(())
    return grad_scale, found_inf
