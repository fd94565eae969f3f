"""Flat host slabs (fp32 master weights, exp_avg, exp_avg_sq, grad) and their chunking.

Each param group owns four contiguous fp32 slabs; a parameter occupies ``[offset, offset +
numel)`` of each, with ``offset`` a multiple of :data:`_ALIGN` (cache-line and SIMD aligned).

A chunk is a list of :class:`View` s, each a range ``[start, stop)`` *inside one parameter*, with
``start`` a multiple of :data:`_ALIGN`; the parameter's last element always lies in the view that
ends at the parameter's end. Torch's fused CPU AdamW runs a vectorised body and a scalar tail per
tensor (and splits work between threads at 16-element units), with slightly different rounding, so
this rule makes every element take the code path it takes in the per-parameter reference, whatever
the chunk size or thread count. Chunks never cross a param-group boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["_ALIGN", "Chunk", "HostSlabs", "ParamSlot", "View", "plan_chunks"]

#: Alignment, in elements, of every view start inside its parameter and of every parameter inside
#: its slab. A multiple of every SIMD width torch's CPU kernels use for fp32 (AVX-512: 16) and of
#: the 16-element units its ``parallel_for`` splits on.
_ALIGN = 64

SlabKind = Literal["master", "exp_avg", "exp_avg_sq", "grad"]
SLAB_KINDS: tuple[SlabKind, ...] = ("master", "exp_avg", "exp_avg_sq", "grad")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """Where one parameter lives in its group's slabs."""

    index: int
    """Position of the parameter over all groups, in param_groups order."""
    group: int
    offset: int
    numel: int
    shape: torch.Size


@dataclass(frozen=True, slots=True)
class View:
    """Elements ``[start, stop)`` of parameter ``slot`` (flattened)."""

    slot: int
    start: int
    stop: int
    whole: bool = False
    """The view covers the whole parameter."""

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class Chunk:
    """One pipeline unit: views of parameters of a single param group."""

    index: int
    group: int
    views: tuple[View, ...]

    @property
    def numel(self) -> int:
        return sum(v.numel for v in self.views)


def plan_chunks(slots: list[ParamSlot], chunk_numel: int) -> tuple[Chunk, ...]:
    """Split the parameters into chunks of at most ``chunk_numel`` elements (see module doc).

    A chunk holds whole small parameters and pieces of large ones; a piece that does not end at its
    parameter's end has a multiple of ``_ALIGN`` elements, so every piece starts aligned.
    """
    if chunk_numel < _ALIGN:
        raise ValueError(f"chunk_numel={chunk_numel}: expected >= {_ALIGN}")
    chunks: list[Chunk] = []
    current: list[View] = []
    used = 0
    group = slots[0].group if slots else 0

    def close() -> None:
        nonlocal current, used
        if current:
            chunks.append(Chunk(index=len(chunks), group=group, views=tuple(current)))
        current, used = [], 0

    for slot in slots:
        if slot.group != group:
            close()
            group = slot.group
        start = 0
        while start < slot.numel:
            remaining = slot.numel - start
            room = chunk_numel - used
            if remaining <= room:
                current.append(View(slot.index, start, slot.numel, whole=start == 0))
                used += remaining
                start = slot.numel
            else:
                take = (room // _ALIGN) * _ALIGN
                if take == 0:
                    close()
                    continue
                current.append(View(slot.index, start, start + take))
                start += take
                close()
        if used >= chunk_numel:
            close()
    close()
    return tuple(chunks)


class HostSlabs:
    """The four fp32 slabs of every param group, and views into them."""

    def __init__(self, shapes_per_group: list[list[torch.Size]]) -> None:
        slots: list[ParamSlot] = []
        self._slabs: list[dict[SlabKind, Tensor]] = []
        for g, shapes in enumerate(shapes_per_group):
            offset = 0
            for shape in shapes:
                numel = int(torch.Size(shape).numel())
                slots.append(ParamSlot(len(slots), g, offset, numel, torch.Size(shape)))
                offset = _round_up(offset + numel, _ALIGN)
            self._slabs.append(
                {kind: torch.zeros(offset, dtype=torch.float32) for kind in SLAB_KINDS}
            )
        self.slots: tuple[ParamSlot, ...] = tuple(slots)
        # view() is on the step's hot path (several calls per parameter per step); the slabs are
        # never reallocated, so each view tensor is made once and reused.
        self._views: dict[tuple[SlabKind, int, int, int], Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for slabs in self._slabs for t in slabs.values())

    def flat(self, kind: SlabKind, slot: int) -> Tensor:
        """The whole parameter ``slot`` in slab ``kind``, flat."""
        s = self.slots[slot]
        return self._slabs[s.group][kind][s.offset : s.offset + s.numel]

    def shaped(self, kind: SlabKind, slot: int) -> Tensor:
        """The parameter ``slot`` in slab ``kind``, shaped like the parameter (a view)."""
        return self.flat(kind, slot).view(self.slots[slot].shape)

    def forget_views(self) -> None:
        """Drop the cached views (after the chunk layout changed; they are remade on demand)."""
        self._views.clear()

    def view(self, kind: SlabKind, v: View) -> Tensor:
        """Elements ``[v.start, v.stop)`` of parameter ``v.slot`` in slab ``kind`` (a cached view)."""
        key = (kind, v.slot, v.start, v.stop)  # hashing a View runs Python code; a tuple does not
        t = self._views.get(key)
        if t is None:
            s = self.slots[v.slot]
            base = s.offset
            t = self._views[key] = self._slabs[s.group][kind][base + v.start : base + v.stop]
        return t
