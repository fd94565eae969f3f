"""The pipeline's reusable buffers: low-precision outputs per parameter, the chunk-sized fp32
scratch for upcasts, and the cache of a chunk's slab view lists.

All three exist so the per-chunk hot path allocates nothing and makes no view twice: a view made
per parameter per step costs Python time while the memory bus idles (see :mod:`offload.pipeline._pipeline`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from offload.state._items import Item
from offload.state._slabs import HostSlabs, SlabKind, View

__all__ = ["STAGING_ALIGN", "LowpBuffers", "Scratch", "SlabListCache"]

#: Byte alignment of each view inside a pinned staging buffer or the scratch buffer.
STAGING_ALIGN = 64


class LowpBuffers:
    """One host buffer per parameter, of the parameter's dtype, made on first use.

    Holds the fused-mp kernel's low-precision output until materialize copies it into the
    parameter (parameters on the CPU; the CUDA transport keeps pinned places instead,
    :class:`offload.pipeline._pinned.LowpPlaces`).
    """

    def __init__(self) -> None:
        self._bufs: dict[int, Tensor] = {}

    def view(self, it: Item, *, for_write: bool) -> Tensor:
        """``it``'s elements of its parameter's buffer (``for_write``: no copy reads it any more,
        on the host always so)."""
        slot = it.view.slot
        buf = self._bufs.get(slot)
        if buf is None:
            buf = self.new(it)
            self._bufs[slot] = buf
        return buf[it.view.start : it.view.stop]

    def new(self, it: Item) -> Tensor:
        """A new buffer for the whole parameter of ``it``."""
        return torch.empty(it.param.numel(), dtype=it.param.dtype)


class Scratch:
    """One chunk-sized fp32 buffer, reused chunk after chunk, for gradients a kernel cannot read
    where they are (a bf16/fp16 gradient on the torch kernel): the worker upcasts into it right
    before the chunk's kernel, so one buffer serves every chunk (no full-size gradient slab)."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.float32)

    def views(self, numels: list[int]) -> list[Tensor]:
        offsets, total = [], 0
        for n in numels:
            offsets.append(total)
            total += -(-n // (STAGING_ALIGN // 4)) * (STAGING_ALIGN // 4)
        if self._buf.numel() < total:
            self._buf = torch.empty(total, dtype=torch.float32)
        return [self._buf[o : o + n] for o, n in zip(offsets, numels)]


@dataclass(slots=True)
class _SlabLists:
    views: tuple[View, ...]
    lists: dict[str, list[Tensor]]


class SlabListCache:
    """The slab views a kernel call of one chunk takes, per kind and in item order, made once per
    chunk and reused while the chunk's items are the same views. Used by the submitting thread
    and by the worker; a dict get/set is atomic, and either writer stores a correct entry."""

    def __init__(self, slabs: HostSlabs) -> None:
        self.slabs = slabs
        self._entries: dict[tuple[int, tuple[str, ...], bool], _SlabLists] = {}

    def clear(self) -> None:
        self._entries.clear()

    def get(self, chunk: int, items: list[Item], kinds: tuple[SlabKind, ...], *,
            nxt: bool = False) -> dict[str, list[Tensor]]:
        """The views of ``kinds`` per item: of the committed slabs, or (``nxt``) of the second
        generation."""
        views = tuple(it.view for it in items)
        key = (chunk, kinds, nxt)
        got = self._entries.get(key)
        if got is None or got.views != views:
            view = self.slabs.next_view if nxt else self.slabs.view
            got = _SlabLists(views, {k: [view(k, v) for v in views] for k in kinds})
            self._entries[key] = got
        return got.lists
