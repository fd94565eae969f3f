"""A job's kernel operands and calls: which tensor each kernel reads and writes for each item.

Shared by both transports. The operands avoid copies and views where they can: a whole parameter
goes to the fused-mp kernel as it is (a view made per parameter per step costs Python time while
the memory bus idles, see :mod:`offload.pipeline._pipeline`), a parameter that is its own master is
updated in place, and the moments come from the per-chunk :class:`SlabListCache`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import Tensor

from offload.pipeline._buffers import SlabListCache
import torch

from offload.pipeline._jobs import Call, CallSteps, ChunkJob
from offload.state._items import KIND_F32, KIND_MP, KIND_TORCH, Item, ItemKind, follows_weights
from offload.kernels._adamw import KernelSet
from offload.kernels._follow import follow_weights
from offload.state._slabs import HostSlabs

__all__ = [
    "build_calls",
    "torch_grads",
    "call_steps",
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


def _copy_first(fn: Callable[..., None], dsts: list[Tensor], srcs: list[Tensor]) -> Callable[..., None]:
    """``fn`` run after ``dsts[i] = srcs[i]``: torch's kernel updates in place, so out of place is
    a copy of the committed state into the second generation, then the update there."""

    def call(*args: Any, **kwargs: Any) -> None:
        torch._foreach_copy_(dsts, srcs)
        fn(*args, **kwargs)

    return call


def _follow_first(fn: Callable[..., None], masters: list[Tensor], weights: list[Tensor]) -> Callable[..., None]:
    """``fn`` run after the masters follow their live weights (torch's kernel; the native one
    does it in its pass): ``offload.kernels._follow.follow_weights``."""

    def call(*args: Any, **kwargs: Any) -> None:
        follow_weights(masters, weights)
        fn(*args, **kwargs)

    return call


def call_steps(items: list[Item], calls: list[Call]) -> list[CallSteps]:
    """Per call of :func:`build_calls`: the slots and step tensors of its items, in order."""
    if len(calls) == 1:
        return [([it.view.slot for it in items], [it.step for it in items])]
    out = []
    for kind, _, _ in calls:
        its = [it for it in items if it.kind == kind]
        out.append(([it.view.slot for it in its], [it.step for it in its]))
    return out


def build_calls(
    job: ChunkJob,
    slabs: HostSlabs,
    lists: SlabListCache,
    grads: list[Tensor],
    lowp_out: Callable[[Item], Tensor],
    f32_out: Callable[[Item], Tensor | None] | None,
    kernels: KernelSet,
    *,
    host_weights: bool,
) -> list[Call]:
    """The kernel calls of ``job``, one per kind of item it holds (usually one).

    ``grads[i]``: the gradient operand of item ``i``; ``lowp_out(item)``: where a KIND_MP item's
    low-precision weight goes. Moments come from the per-chunk cache; masters are the parameter
    itself for own-master items (see :func:`master_operand`). ``f32_out(item)``, if given: where a
    KIND_F32 item's new weight is also written (CUDA: the ring slot the h2d copy reads), or None
    (only in place). The functions called are those of ``kernels``.

    ``job.into_next``: the update goes out of place, from the committed slabs into the second
    generation (``HostSlabs.next_view``): the native kernels read the one and write the other
    (``into=``); torch's kernel, which updates in place, gets the second generation's views after
    a copy of the committed state into them.

    With ``host_weights`` (the transport's: the parameters are host tensors), items of a
    low-precision parameter (:func:`follows_weights`) first compare their masters with the live
    weights (an edit through ``.data``: ``offload.state._edits``): the native kernel
    in its pass (``follow=True`` where it writes the weights itself, else ``seen=``), torch's
    kernel by :func:`offload.kernels._follow.follow_weights` before it runs.
    """
    items = job.items
    kinds = {it.kind for it in items}
    groups: list[tuple[ItemKind, list[Item], list[Tensor]]]
    if len(kinds) == 1:
        groups = [(kinds.pop(), items, grads)]
    else:
        groups = []
        for kind in sorted(kinds):
            idx = [i for i, it in enumerate(items) if it.kind == kind]
            groups.append((kind, [items[i] for i in idx], [grads[i] for i in idx]))
    calls: list[Call] = []
    out_of_place = job.into_next
    seed = slabs.rounding_seed
    for kind, its, gs in groups:
        # stochastic rounding of bf16 moments: the random bits are keyed on each view's parameter
        # and element indices (offload.kernels._rounding)
        rounding = None if seed is None else (seed, [it.view.slot for it in its], [it.view.start for it in its])
        slab = lists.get(job.chunk, its, ("exp_avg", "exp_avg_sq"))
        masters = [master_operand(it, slabs) for it in its]
        steps = [it.step for it in its]
        into: list[Tensor] = []
        if out_of_place:
            nxt = lists.get(job.chunk, its, ("exp_avg", "exp_avg_sq"), nxt=True)
            nxt_masters = [master_operand(it, slabs, nxt=True) for it in its]
            if kind == KIND_TORCH:  # in place on the second generation, after a copy into it
                copy_to = [*nxt_masters, *nxt["exp_avg"], *nxt["exp_avg_sq"]]
                copy_from = [*(m.view(-1) for m in masters), *slab["exp_avg"], *slab["exp_avg_sq"]]
                masters, slab = nxt_masters, nxt
            else:
                into = [t for trio in zip(nxt_masters, nxt["exp_avg"], nxt["exp_avg_sq"]) for t in trio]
        if kind == KIND_MP:
            outs = [lowp_out(it) for it in its]
            fn: Any = kernels.mixed_precision_adamw
            if into:
                fn = functools.partial(fn, into=into)
            if rounding is not None:
                fn = functools.partial(fn, rounding=rounding)
            if follows_weights(its[0], host_weights):
                fn = (functools.partial(fn, follow=True) if job.materialize
                      else functools.partial(fn, seen=[param_operand(it) for it in its]))
            calls.append((kind, fn, (outs, gs, masters, slab["exp_avg"], slab["exp_avg_sq"], steps)))
        else:
            fn = kernels.native_adamw_f32 if kind == KIND_F32 else kernels.fused_adamw
            # an own master is the parameter itself: nothing to copy it into
            f32_outs = ([f32_out(it) if slabs.slots[it.view.slot].master_offset >= 0 else None for it in its]
                        if kind == KIND_F32 and f32_out is not None else [])
            if f32_outs and all(o is not None for o in f32_outs):
                fn = functools.partial(kernels.native_adamw_f32, outs=f32_outs)
            if rounding is not None:
                fn = functools.partial(fn, rounding=rounding)
            follow = [i for i, it in enumerate(its) if kind == KIND_TORCH and follows_weights(it, host_weights)]
            if follow:
                fn = _follow_first(fn, [masters[i].view(-1) for i in follow], [param_view(its[i]) for i in follow])
            if into:
                fn = functools.partial(fn, into=into)
            elif out_of_place:
                fn = _copy_first(fn, copy_to, copy_from)
            calls.append((kind, fn, (masters, gs, slab["exp_avg"], slab["exp_avg_sq"], steps)))
    return calls


def torch_grads(job: ChunkJob, sources: list[Tensor], upcast: list[int], scratch: Any) -> list[Tensor]:
    """The gradient operands of ``job``'s items from ``sources`` (each item's gradient where the
    kernel could read it): those in ``upcast`` (low-precision gradients of torch's kernel) copied
    into fp32 ``scratch`` views. With a clip coefficient (``hyper.grad_coef``) and any upcast,
    every torch-kernel operand is the product, made here: a low-precision gradient multiplied in
    its own dtype (torch's ``_foreach_mul_`` rounds there) and then upcast, an fp32 one into the
    scratch too; ``job.coef_in_grads`` tells the worker its torch calls run without the
    coefficient. (Without an upcast the torch kernel takes the coefficient itself.)"""
    grads = list(sources)
    coef = job.hyper.grad_coef
    if coef is not None and upcast:
        upcast = [i for i, it in enumerate(job.items) if it.kind == KIND_TORCH]
    if not upcast:
        return grads
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
    job.coef_in_grads = coef is not None
    return grads
