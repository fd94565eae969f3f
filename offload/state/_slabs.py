"""Flat host slabs (fp32 master weights, exp_avg, exp_avg_sq) and their chunking.

Each param group owns three contiguous fp32 slabs; a parameter occupies ``[offset, offset +
numel)`` of the moment slabs and ``[master_offset, master_offset + numel)`` of the master slab,
each offset a multiple of :data:`_ALIGN` (cache-line and SIMD aligned). A parameter that is its
own master (an fp32 parameter of a model on the CPU: the kernel updates it in place) has no place
in the master slab: host state is 8 bytes per parameter then, 12 otherwise. There is no gradient
slab: kernels read gradients where they are (CPU) or from chunk-sized staging (upcasts, CUDA),
which saved 4 bytes per parameter. Measured (``python -m bench.bandwidth``, 50M GPT, 2-core VM): RSS
growth of construction + first step 8.01 bytes/param for fp32 (torch's AdamW: 8.00), 12.00 for
bf16 (it was 17.6 for fp32 with the master and gradient slabs).

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

SlabKind = Literal["master", "exp_avg", "exp_avg_sq"]
SLAB_KINDS: tuple[SlabKind, ...] = ("master", "exp_avg", "exp_avg_sq")


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
    master_offset: int = -1
    """Offset in the group's master slab; -1 when the parameter is its own master."""

    @property
    def own_master(self) -> bool:
        return self.master_offset < 0


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


def plan_chunks(
    slots: list[ParamSlot], chunk_numel: int, *, align: int | None = None
) -> tuple[Chunk, ...]:
    """Split the parameters into chunks of at most ``chunk_numel`` elements (see module doc).

    A chunk holds whole small parameters and pieces of large ones; a piece that does not end at its
    parameter's end has a multiple of ``align`` elements (default :data:`_ALIGN`), so every piece
    starts aligned. Another ``align`` is for tests that show why the rule exists (1: pieces start
    anywhere, and bitwise equality with torch's per-parameter kernel is lost).
    """
    if align is None:
        align = _ALIGN
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"align={align!r}: expected an int >= 1")
    if chunk_numel < align:
        raise ValueError(f"chunk_numel={chunk_numel}: expected >= {align}")
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
                take = (room // align) * align
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
    """The fp32 slabs of every param group, and views into them.

    ``own_master[g][i]``: parameter ``i`` of group ``g`` is its own master (no master slab place).
    """

    def __init__(
        self, shapes_per_group: list[list[torch.Size]], own_master: list[list[bool]] | None = None,
        *, zero: bool = True,
    ) -> None:
        slots: list[ParamSlot] = []
        self._slabs: list[dict[SlabKind, Tensor]] = []
        for g, shapes in enumerate(shapes_per_group):
            offset = moffset = 0
            for i, shape in enumerate(shapes):
                numel = int(torch.Size(shape).numel())
                own = bool(own_master[g][i]) if own_master is not None else False
                slots.append(ParamSlot(len(slots), g, offset, numel, torch.Size(shape),
                                       -1 if own else moffset))
                offset = _round_up(offset + numel, _ALIGN)
                if not own:
                    moffset = _round_up(moffset + numel, _ALIGN)
            new = torch.zeros if zero else torch.empty  # empty: untouched pages, see first_touch
            self._slabs.append({
                "master": new(moffset, dtype=torch.float32),
                "exp_avg": new(offset, dtype=torch.float32),
                "exp_avg_sq": new(offset, dtype=torch.float32),
            })
        self.slots: tuple[ParamSlot, ...] = tuple(slots)
        #: Per slot: its place was ever given to a parameter's state (until then it holds the
        #: zeros it was made with: a model of ~20,000 small tensors spent ~2 s of its first step
        #: zeroing moments that were zero already).
        self.used = bytearray(len(slots))
        # view() is on the step's hot path (several calls per parameter per step); the slabs are
        # never reallocated, so each view tensor is made once and reused.
        self._views: dict[tuple[SlabKind, int, int, int], Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for slabs in self._slabs for t in slabs.values())

    def slabs(self) -> list[Tensor]:
        """Every slab tensor (for first-touch and memory accounting)."""
        return [t for slabs in self._slabs for t in slabs.values()]

    def first_touch(self) -> None:
        """Zero every slab (keeps ``used``: the slabs hold zeros either way) with the calling thread's intra-op threads: on slabs made with
        ``zero=False`` this is the first write of each page, which places it on the NUMA node of
        the CPU that wrote it (Linux's default local policy)."""
        for t in self.slabs():
            t.zero_()

    def _base(self, kind: SlabKind, s: ParamSlot) -> int:
        if kind != "master":
            return s.offset
        if s.master_offset < 0:
            raise KeyError(f"parameter {s.index} is its own master: it has no master slab view")
        return s.master_offset

    def flat(self, kind: SlabKind, slot: int) -> Tensor:
        """The whole parameter ``slot`` in slab ``kind``, flat."""
        s = self.slots[slot]
        base = self._base(kind, s)
        return self._slabs[s.group][kind][base : base + s.numel]

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
            base = self._base(kind, s)
            t = self._views[key] = self._slabs[s.group][kind][base + v.start : base + v.stop]
        return t
