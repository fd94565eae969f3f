"""Weights edited where no version counter shows it (``p.data.clamp_()``), followed by content with
torch ops: what the native mixed-precision kernel does in its pass (``seen=``), for torch's kernel
(``offload.pipeline._operands`` calls it before that kernel; ``offload.state._edits`` has the rule).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from offload.kernels._adamw import _BUFFERS

__all__ = ["follow_weights"]


@torch.no_grad()
def follow_weights(masters: Sequence[Tensor], weights: Sequence[Tensor]) -> None:
    """Each element of ``masters[i]`` (fp32, flat) whose value rounded to ``weights[i]``'s dtype
    differs from the weight's takes the weight's value (compared as values: +0 == -0, a NaN never
    equal): an edit of the parameter that no version counter shows (``p.data.clamp_()``) is
    followed as ``offload.state._edits.reseed`` follows the ones they show. The native
    mixed-precision kernel does this in its pass (``seen=``); this is the same with torch ops,
    for torch's kernel. Most steps nothing was edited: the rounded masters (in this thread's reused
    buffer) are compared with the weights bit for bit, as wide words, and only a tensor that
    differs takes the element-wise path (a bf16 comparison and a reduction of its result per
    tensor, slow in torch 2.13 on this CPU, made the torch path's step 2.25x its time on a
    48M-parameter bf16 model; the bit comparison, 1.35x). Bit-equal weights keep their
    masters also where a master is NaN (the native kernel takes the weight's NaN there: only a NaN
    payload differs, as it does between torch's own vector and scalar paths)."""
    if not masters:
        return
    sizes = [m.numel() for m in masters]
    rounded = {dt: _BUFFERS.views(dt, sizes) for dt in {w.dtype for w in weights}}
    for i, (m, w) in enumerate(zip(masters, weights)):
        w = w.reshape(-1)
        low = rounded[w.dtype][i]
        low.copy_(m)
        if _same_bits(low, w):
            continue
        edited = low != w
        m.copy_(torch.where(edited, w.to(torch.float32), m))


def _same_bits(a: Tensor, b: Tensor) -> bool:
    """Whether two contiguous 16-bit tensors of one size hold the same bits (compared as the
    widest integer words both addresses and the size allow: torch.equal stops at the first
    difference and reads 8-byte words at memory speed)."""
    for word, per in ((torch.int64, 4), (torch.int32, 2)):
        if a.numel() % per == 0 and a.data_ptr() % (2 * per) == 0 and b.data_ptr() % (2 * per) == 0:
            return torch.equal(a.view(torch.int16).view(word), b.view(torch.int16).view(word))
    return torch.equal(a.view(torch.int16), b.view(torch.int16))
