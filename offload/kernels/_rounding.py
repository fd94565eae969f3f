"""Stochastic rounding of bf16 moments (``CPUOffloadAdamW(state_rounding="stochastic")``), with torch ops.

The native kernels do this in their pass (``csrc/rounding.h``: ``sr_key``, ``sr_hash``,
``sr_round``); this module is the same function for torch's kernel, bit for bit. Element ``j``
(< 2**32) of the parameter in slot ``slot`` gets 32 random bits ``h = sr_hash(key, j)`` with
``key = sr_key(seed, step, slot)``: they depend on the seed, the step, the parameter and the
element only, so a step gives the same bits for any thread count, chunk size, speculation or
kernel. ``exp_avg`` uses the low 16 bits of ``h``, ``exp_avg_sq`` the high 16: added to the fp32
value's bits, then the low 16 bits dropped, the value rounds away from zero with probability
equal to the dropped fraction (a NaN stays NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor

from offload.kernels._grad_stats import _splitmix64

__all__ = ["round_moments_", "sr_hash", "sr_key"]

_M64 = (1 << 64) - 1


def sr_key(seed: int, step: float, slot: int) -> int:
    """The 32-bit key of one parameter's elements at one step (``step``: the step count after
    this step's increment, a whole number)."""
    inner = _splitmix64(((int(step) << 32) ^ slot) & _M64)
    return _splitmix64((seed ^ inner) & _M64) & 0xFFFFFFFF


def _i32(x: int) -> int:
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x


def sr_hash(key: int, start: int, n: int) -> Tensor:
    """``sr_hash(key, j)`` for ``j = start .. start + n - 1`` (modulo 2**32): murmur3's 32-bit
    finaliser (logical shifts, wrapping products), as int64 values in [0, 2**32)."""
    x = (torch.arange(start, start + n, dtype=torch.int64) & 0xFFFFFFFF) ^ (key & 0xFFFFFFFF)
    for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x = x ^ (x >> shift)
        x = (x * mul) & 0xFFFFFFFF  # (an int64 product that wraps keeps its low 32 bits)
    return x ^ (x >> 16)


def _round(values: Tensor, r16: Tensor) -> Tensor:
    bits = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = (bits + r16.to(torch.int64)) & 0xFFFF0000
    t = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)
    return torch.where(torch.isnan(values), values, t)


@torch.no_grad()
def round_moments_(exp_avg: Tensor, exp_avg_sq: Tensor, new_exp_avg: Tensor, new_exp_avg_sq: Tensor, *,
                   key: int, start: int) -> None:
    """Store the fp32 ``new_*`` moments (flat, one view of a parameter whose first element is
    element ``start`` of it) into the bf16 ``exp_avg``/``exp_avg_sq``, stochastically rounded."""
    h = sr_hash(key, start, new_exp_avg.numel())
    exp_avg.view(-1).copy_(_round(new_exp_avg.reshape(-1), h & 0xFFFF))
    exp_avg_sq.view(-1).copy_(_round(new_exp_avg_sq.reshape(-1), (h >> 16) & 0xFFFF))
