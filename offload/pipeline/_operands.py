"""A job's kernel operands: which tensor each kernel reads and writes for each item.

Shared by both transports and by :mod:`offload.pipeline._calls`, which makes the kernel calls from
them. The operands avoid copies and views where they can: a whole parameter goes to the fused-mp
kernel as it is (a view made per parameter per step costs Python time while the memory bus idles,
see :mod:`offload.pipeline._pipeline`), a parameter that is its own master is updated in place,
and the moments come from the per-chunk ``SlabListCache``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from offload.pipeline._jobs import ChunkJob
from offload.state._items import KIND_TORCH, Item
from offload.state._slabs import HostSlabs

__all__ = [
    "torch_grads",
    "flat",
    "grad_operand",
    "grad_slice",
    "master_operand",
    "param_operand",
    "param_view",
]


def flat(t: Tensor) -> Tensor:
    """``t`` detached and flat (a view where it is contiguous, else a copy)."""
    t = t.detach()
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def grad_slice(g: Tensor, start: int, stop: int) -> Tensor:
    """Elements ``start:stop`` of gradient ``g``, flat and dense (what the kernels read): a view
    where ``g`` is contiguous, else a copy. ``reshape`` keeps an expanded gradient a view with
    stride 0 (``p.grad = torch.ones(1).expand_as(p)``, which torch's AdamW takes), so the slice
    is copied: only the slice there, all of ``g`` where it does not flatten to a view (transposed)."""
    part = flat(g)[start:stop]
    return part if part.is_contiguous() else part.contiguous()


def param_view(it: Item) -> Tensor:
    """The item's elements of its parameter, flat (a view)."""
    return it.param.detach().view(-1)[it.view.start : it.view.stop]


def grad_operand(it: Item) -> Tensor:
    """The item's gradient as the fused-mp kernel reads it: the gradient itself when the item
    covers all of it and it is contiguous (the kernel reads any shape, and a view made per
    parameter per step costs Python time while the memory bus idles), else a flat slice (a
    dense copy, for a non-contiguous gradient: :func:`grad_slice`)."""
    g = it.grad
    assert g is not None  # jobs with update=True only hold items with a gradient
    if it.view.whole and g.is_contiguous():
        return g
    return grad_slice(g, it.view.start, it.view.stop)


def param_operand(it: Item) -> Tensor:
    """The item's parameter as the fused-mp kernel writes it: the parameter itself for a whole
    one, else a flat view. Never a copy: ``step()`` checked the parameter is contiguous, and a
    non-contiguous one makes ``view`` raise rather than the update land in a temporary."""
    return it.param if it.view.whole else param_view(it)


def master_operand(it: Item, slabs: HostSlabs, *, nxt: bool = False) -> Tensor:
    """The tensor the kernel updates as the item's fp32 master: the parameter itself when it is
    its own master (an fp32 parameter of a CPU model), else its master slab view; ``nxt``: where
    its new master goes out of place (the second generation; an own master's scratch place)."""
    if nxt:
        return slabs.next_view("master", it.view)
    if slabs.slots[it.view.slot].master_offset < 0:
        return param_operand(it)
    return slabs.view("master", it.view)


def torch_grads(job: ChunkJob, sources: list[Tensor], upcast: list[int], scratch: Any) -> tuple[list[Tensor], bool]:
    """The gradient operands of ``job``'s items from ``sources`` (each item's gradient where the
    kernel could read it): those in ``upcast`` (low-precision gradients of torch's kernel) copied
    into fp32 ``scratch`` views. With a clip coefficient (``hyper.grad_coef``) and any upcast,
    every torch-kernel operand is the product, made here: a low-precision gradient multiplied in
    its own dtype (torch's ``_foreach_mul_`` rounds there) and then upcast, an fp32 one into the
    scratch too. Returns the operands and whether they hold the coefficient already (the
    transport notes it in ``JobProgress.coef_in_grads``: the worker's torch calls then run
    without it). (Without an upcast the torch kernel takes the coefficient itself.)"""
    grads = list(sources)
    coef = job.hyper.grad_coef
    if coef is not None and upcast:
        upcast = [i for i, it in enumerate(job.items) if it.kind == KIND_TORCH]
    if not upcast:
        return grads, False
    views = scratch.views([job.items[i].view.numel for i in upcast])
    for i, dst in zip(upcast, views):
        src = sources[i]
        if coef is None:
            dst.copy_(src)
        elif src.dtype == torch.float32:
            torch.mul(src, coef, out=dst)
        else:
            dst.copy_(torch.mul(src, coef))
        grads[i] = dst
    return grads, coef is not None
