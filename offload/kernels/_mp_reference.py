"""The torch path of the mixed-precision step (upcast, torch's fused AdamW, downcast): the reference
the fused-mp tests and ``bench.membus.fused_mp`` compare the native kernel
(``offload.kernels._fused_mp.fused_mp_adamw_steps_``, ``csrc/mp_adamw.h``) with."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from offload.kernels._adamw import Hyper, fused_adamw_
from offload.kernels._fused_mp import check_hyper, check_lists

__all__ = ["torch_mp_adamw_"]


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"torch_mp_adamw_: step={step!r}: expected an int >= 1")


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
    grad_scale: Tensor | None = None,
    grad_coef: Tensor | None = None,
) -> None:
    """The torch path of the mixed-precision step: the reference of the fused-mp tests and
    benchmarks. ``step``: the step number after this update (1 on the first step), the same for
    every tensor (what each tensor's step tensor holds after the increments, for
    ``offload.kernels._fused_mp.fused_mp_adamw_steps_``).

    Upcasts each gradient into an fp32 buffer (``grad_buffers`` when given, else new tensors),
    runs ``torch._fused_adamw_`` on the fp32 masters and moments, and copies the masters into the
    low-precision parameters. Three passes, about 40 bytes per parameter. ``grad_scale``,
    ``grad_coef``: as :class:`Hyper`'s, applied by :func:`fused_adamw_` to the upcast gradients
    (rounded to their low-precision dtype, as the module doc says).
    """
    check_lists(
        params_lowp=params_lowp, grads_lowp=grads_lowp, masters=masters, exp_avgs=exp_avgs,
        exp_avg_sqs=exp_avg_sqs,
    )
    _check_step(step)
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
                    weight_decay=float(weight_decay), eps=float(eps), grad_scale=grad_scale,
                    grad_coef=grad_coef),
        grad_dtypes=[g.dtype for g in grads_lowp],
    )
    torch._foreach_copy_(list(params_lowp), list(masters))
