"""A job's kernel calls, made here and nowhere else (:class:`CallBuilder`).

A call is (kind, kernel function with its keyword options bound, positional tensor lists): one
per kind of item a job holds (usually one). The worker adds the steps to increment and the
hyper-parameters when it calls it. The builder makes a job's calls in one of two ways, from the
same :func:`build_calls`:

* :meth:`CallBuilder.in_place`, on the submitting thread (``HostTransport.prepare``): a host job
  whose kernels read every gradient where it is and write every parameter themselves. Its calls
  are known before the worker takes it, so they are made while the worker runs the previous
  kernel with the GIL released, from a template made once per chunk item list (the optimizer
  reuses those from step to step): a step only puts in its gradients and remakes the views of
  pieces of parameters. Measured on a 2-core VM, 125M bf16 model, 4 Mi-element chunks, the
  worker's Python between two kernel calls was 0.2-0.45 ms, 8-15% of the step, before this and
  the other hot-path trims of :mod:`offload.pipeline._pipeline`.
* :meth:`CallBuilder.build`, on the worker once d2h ran (every other job, and one whose
  preparation at submit failed): from the gradient operands the transport made and the outputs
  it names (``Transport.lowp_out``, ``f32_out``).

Both give bitwise the same calls for a job both can make (``tests/test_fused_mp_optimizer.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from offload.kernels._adamw import KernelSet
from offload.kernels._follow import follow_weights
from offload.pipeline._buffers import SlabListCache
from offload.pipeline._jobs import Call, CallSteps, ChunkJob, KernelCalls
from offload.pipeline._operands import grad_operand, master_operand, param_operand, param_view
from offload.state._items import KIND_F32, KIND_MP, KIND_TORCH, Item, ItemKind, follows_weights

__all__ = ["CallBuilder", "CallTemplate", "build_calls", "call_steps"]


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
    low-precision weight goes. Moments come from the per-chunk cache ``lists`` (over the slabs);
    masters are the parameter itself for own-master items (see
    :func:`offload.pipeline._operands.master_operand`). ``f32_out(item)``, if given: where a
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
    slabs = lists.slabs
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


@dataclass(slots=True, kw_only=True)
class CallTemplate:
    """The kernel calls of one chunk's reusable item list, without gradients (see
    :meth:`CallBuilder.in_place`)."""

    items: list[Item]
    """The list object the calls were made for (held, so its id is never reused)."""
    direct: bool
    """Every item reads its gradient in place and writes its parameter: calls can be made."""
    calls: list[Call]
    """The call templates (no gradients: they are put in per step)."""
    index: list[list[int] | None]
    """Per call: the items it takes (None: all of them)."""
    partial: list[list[tuple[int, int]]]
    """Per call: (position, item) of the pieces of parameters, whose views are remade per step."""
    whole: list[bool]
    """Per item: it covers its whole parameter."""
    steps: list[CallSteps]
    """Per call: the slots and step tensors of its items."""


class CallBuilder:
    """Makes every kernel call of one pipeline (see the module doc): owned by the ``Pipeline``,
    used by its worker and, at submit, by its transport. ``lists``: the per-chunk slab views
    (shared by the submitting and worker threads); ``kernels``: the functions the calls run."""

    def __init__(self, lists: SlabListCache, kernels: KernelSet) -> None:
        self.lists = lists
        self.kernels = kernels
        self.templates: dict[int, CallTemplate] = {}
        """Per chunk: the template of its last item list (read by tests; :meth:`forget`)."""

    def forget(self) -> None:
        """Drop the templates of the old chunk layout (between steps)."""
        self.templates.clear()

    def build(self, job: ChunkJob, grads: list[Tensor], lowp_out: Callable[[Item], Tensor],
              f32_out: Callable[[Item], Tensor | None], *, host_weights: bool) -> KernelCalls:
        """On the worker, after d2h: ``job``'s calls over ``grads`` (per item, the operand its
        kernel reads) and the transport's outputs (:func:`build_calls`)."""
        calls = build_calls(job, self.lists, grads, lowp_out, f32_out, self.kernels, host_weights=host_weights)
        return KernelCalls(calls, call_steps(job.items, calls))

    def in_place(self, job: ChunkJob, reads_in_place: Callable[[Item], bool], *,
                 host_weights: bool) -> KernelCalls | None:
        """On the submitting thread: the calls of a step's host job (``update``, ``materialize``,
        in place) whose every item reads its gradient where it is (``reads_in_place``) and writes
        its parameter itself, else None (the worker makes them after d2h). The template of a
        chunk's item list is made once; a later step only puts in its gradients."""
        items = job.items
        entry = self.templates.get(job.chunk)
        if entry is None or entry.items is not items:
            entry = self._template(job, reads_in_place, host_weights)
            self.templates[job.chunk] = entry
        if not entry.direct:
            return None
        grads = [g if w and g.is_contiguous() else grad_operand(it)  # type: ignore[union-attr]
                 for it, w, g in zip(items, entry.whole, [it.grad for it in items])]
        calls = []
        for (kind, fn, args), idx, partial in zip(entry.calls, entry.index, entry.partial):
            targs = list(args)
            targs[1] = grads if idx is None else [grads[i] for i in idx]
            if partial:  # pieces of parameters: their views are remade (.data may have changed)
                first = list(args[0])  # the parameter operands (own masters, or KIND_MP outputs)
                for j, i in partial:
                    first[j] = param_operand(items[i])
                targs[0] = first
            calls.append((kind, fn, tuple(targs)))
        return KernelCalls(calls, entry.steps)

    def _template(self, job: ChunkJob, reads_in_place: Callable[[Item], bool], host_weights: bool) -> CallTemplate:
        items = job.items
        slots = self.lists.slabs.slots
        for it in items:
            if not reads_in_place(it) or (it.kind != KIND_MP and slots[it.view.slot].master_offset >= 0):
                return CallTemplate(items=items, direct=False, calls=[], index=[], partial=[], whole=[], steps=[])
        calls = build_calls(job, self.lists, [grad_operand(it) for it in items],
                            param_operand, None, self.kernels, host_weights=host_weights)
        # The templates must not keep this step's gradients alive: their place is filled per step.
        calls = [(kind, fn, (args[0], [], *args[2:])) for kind, fn, args in calls]
        kinds = sorted({it.kind for it in items})
        index: list[list[int] | None] = (
            [None] if len(kinds) == 1 else
            [[i for i, it in enumerate(items) if it.kind == k] for k in kinds]
        )
        partial = []
        for idx in index:
            members = range(len(items)) if idx is None else idx
            partial.append([(j, i) for j, i in enumerate(members) if not items[i].view.whole])
        return CallTemplate(items=items, direct=True, calls=calls, index=index, partial=partial,
                            whole=[it.view.whole for it in items], steps=call_steps(items, calls))
