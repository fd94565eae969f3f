"""A chunk's work items for one step, and which kernel updates each of them.

An :class:`Item` is one view of a chunk with the tensors the pipeline reads and
writes for it (parameter, gradient, step) and its kernel kind. :func:`item_kind` is the one place
that picks an item's kernel; :func:`new_item` the one place that makes an Item.

Per-step Python must not grow per tensor where a chunk can be described once: a model of ~20,000
small tensors spent ~90 ms per step building Items and hashing parameters for their state. So
:class:`ItemCache` makes the Items of a chunk once per chunk layout, kernel and state generation
(a new state entry anywhere starts a new generation: Items hold step tensors) and reuses them; a
step only sets each one's gradient. A view without a gradient, or with a gradient of another
dtype than its parameter, takes the general path (fresh Items for this step only).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
from torch import Tensor

from offload.state._params import ParamRecord
from offload.state._slabs import Chunk, View

logger = logging.getLogger(__name__)

__all__ = ["KIND_F32", "KIND_MP", "KIND_TORCH", "LOWP_DTYPES", "CachedItems", "Item", "ItemCache", "ItemKind",
           "follows_weights", "item_kind", "new_item"]

class ItemKind(IntEnum):
    """The kernel that updates an item (chosen by the optimizer, read by the pipeline)."""

    TORCH = 0
    """torch's fused AdamW on fp32 master, gradient (upcast when needed) and moments."""
    MP = 1
    """fused-mp's mixed-precision entry point: a bf16/fp16 parameter with a gradient of its dtype."""
    F32 = 2
    """fused-mp's fp32 entry point: an fp32 parameter with an fp32 gradient."""


KIND_TORCH, KIND_MP, KIND_F32 = ItemKind.TORCH, ItemKind.MP, ItemKind.F32


@dataclass(slots=True)
class Item:
    """One view of a chunk, with the tensors it reads and writes for this step."""

    view: View
    """The elements of one parameter the item covers."""
    param: Tensor
    """The model parameter (written by materialize)."""
    grad: Tensor | None
    """The parameter's gradient captured when the job was made (read by d2h)."""
    step: Tensor
    """The parameter's fp32 step tensor."""
    kind: ItemKind = KIND_TORCH
    """Which kernel updates the item. Truthy for the native kernel (MP and F32)."""


#: Parameter dtypes the fused-mp kernel's mixed-precision entry updates (fp32 has its own entry).
LOWP_DTYPES = (torch.bfloat16, torch.float16)


def follows_weights(it: Item, host_weights: bool) -> bool:
    """Whether the item's kernel compares its fp32 master with the live weight (an edit through
    ``.data`` that no version counter shows, ``offload.state._edits``): a low-precision parameter
    (its master is separate) whose weights the kernel can read, those of a transport with
    ``host_weights`` (``offload.pipeline._transport.Transport``; a CUDA model's are on the device)."""
    return host_weights and it.param.dtype in LOWP_DTYPES


def item_kind(kernel: str, param_dtype: torch.dtype, grad_dtype: torch.dtype | None) -> ItemKind:
    """Which kernel updates a parameter this step (an Item kind): with ``kernel="fused-mp"`` its
    mixed-precision entry for bf16/fp16 with a same-dtype gradient, its fp32 entry for fp32 with
    an fp32 gradient; else torch's kernel (``grad_dtype`` None: not known yet, torch's)."""
    if kernel != "fused-mp" or grad_dtype is None or grad_dtype != param_dtype:
        return KIND_TORCH
    if param_dtype in LOWP_DTYPES:
        return KIND_MP
    return KIND_F32 if param_dtype == torch.float32 else KIND_TORCH


def new_item(view: View, *, param: Tensor, grad: Tensor | None, step: Tensor,
             kind: ItemKind) -> Item:
    """The Item of ``view`` (the one place Items are made; ``kind`` from :func:`item_kind`)."""
    return Item(view=view, param=param, grad=grad, step=step, kind=kind)


@dataclass(slots=True)
class CachedItems:
    """The reusable Items of one chunk (valid while chunk, kernel and generation are unchanged)."""

    chunk: Chunk
    """The chunk they describe (identity: a new chunk layout makes new chunks)."""
    kernel: str
    """The kernel setting they were made for."""
    gen: int
    """The state generation they were made in."""
    items: list[Item]
    """One per view of the chunk, without gradients between steps."""
    dtypes: list[torch.dtype]
    """Per item: its parameter's dtype (a gradient of another dtype takes the general path)."""
    numel: int
    """Elements of all items."""
    native: bool
    """Some item runs on the native (fused-mp) kernel."""


class ItemCache:
    """The Items of every chunk, made once per layout, kernel and state generation."""

    def __init__(self) -> None:
        self.entries: dict[int, CachedItems] = {}
        """Chunk index -> its cached Items."""
        self.gen = 0
        """State generation: bumped by :meth:`new_state`."""

    def new_state(self) -> None:
        """A state entry was made or replaced: cached Items hold stale step tensors."""
        self.gen += 1

    def clear(self) -> None:
        """Forget every chunk's Items (a new chunk layout or new slabs)."""
        self.entries.clear()

    def release_grads(self) -> None:
        """After a step: reused Items must not keep gradients alive."""
        for cached in self.entries.values():
            for it in cached.items:
                it.grad = None

    def items(self, chunk: Chunk, grads: Mapping[int, Tensor], records: Sequence[ParamRecord],
              state: Mapping[Tensor, dict[str, Any]], *, kernel: str, sharded: bool) -> list[Item]:
        """The chunk's items for this step: those of its views whose parameter has a gradient."""
        cached = self.entries.get(chunk.index)
        gen = self.gen
        if cached is None or not (cached.chunk is chunk and cached.kernel == kernel and cached.gen == gen):
            made = []
            for v in chunk.views:
                rec = records[v.slot]
                p = rec.param
                step = state[p].get("step") if p in state else None
                if step is None:
                    break  # a parameter without state yet: no template until it has one
                param = rec.local()
                # Its kind for a gradient of the parameter's dtype (the reuse condition below).
                kind = item_kind(kernel, p.dtype, p.dtype)
                made.append(new_item(v, param=param, grad=None, step=step, kind=kind))
            else:
                cached = CachedItems(chunk=chunk, kernel=kernel, gen=gen, items=made,
                                     dtypes=[it.param.dtype for it in made],
                                     numel=sum(it.view.numel for it in made),
                                     native=any(it.kind for it in made))
                self.entries[chunk.index] = cached
        if cached is not None and cached.chunk is chunk and cached.gen == gen and cached.kernel == kernel:
            get = grads.get
            for it, dtype in zip(cached.items, cached.dtypes):
                g = get(it.view.slot)
                if g is None or g.dtype != dtype:
                    break
                it.grad = g
                if sharded:  # FSDP2 may give a DTensor a new local tensor (lazy init, load)
                    it.param = records[it.view.slot].local()
            else:
                return cached.items
        return fresh_items(chunk, grads, records, state, kernel=kernel)

    def summary(self, chunk: Chunk, items: list[Item]) -> tuple[int, bool]:
        """(elements, any item on the native kernel) of a job's items; computed once for the
        reused item list of a chunk."""
        cached = self.entries.get(chunk.index)
        if cached is not None and cached.items is items:
            return cached.numel, cached.native
        return sum(it.view.numel for it in items), any(it.kind for it in items)


def fresh_items(chunk: Chunk, grads: Mapping[int, Tensor], records: Sequence[ParamRecord],
                state: Mapping[Tensor, dict[str, Any]], *, kernel: str) -> list[Item]:
    """Items of this step only, for the views of ``chunk`` whose parameter has a gradient in
    ``grads``."""
    items = []
    for v in chunk.views:
        g = grads.get(v.slot)
        if g is None:
            continue
        rec = records[v.slot]
        p = rec.param
        items.append(new_item(v, param=rec.local(), grad=g, step=state[p]["step"],
                              kind=item_kind(kernel, p.dtype, g.dtype)))
    return items
