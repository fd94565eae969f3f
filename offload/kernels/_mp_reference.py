"""The torch path with ``offload.kernels._fused_mp.fused_mp_adamw_``'s signature: the reference the
fused-mp tests and ``bench.membus.fused_mp`` compare the native kernel with."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from offload.kernels._adamw import Hyper, fused_adamw_
from offload.kernels._fused_mp import check_hyper, check_lists, check_step

__all__ = ["torch_mp_adamw_"]


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
    """The torch path with ``offload.kernels._fused_mp.fused_mp_adamw_``'s signature: the reference of the
    fused-mp tests and benchmarks.

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
                    weight_decay=float(weight_decay), eps=float(eps), grad_scale=grad_scale,
                    grad_coef=grad_coef),
        grad_dtypes=[g.dtype for g in grads_lowp],
    )
    torch._foreach_copy_(list(params_lowp), list(masters))
