"""Flat host slabs (fp32 master weights, exp_avg, exp_avg_sq) and their chunking.

Each param group owns three contiguous fp32 slabs; a parameter occupies ``[offset, offset +
numel)`` of the moment slabs and ``[master_offset, master_offset + numel)`` of the master slab,
each offset a multiple of :data:`_ALIGN` (cache-line and SIMD aligned). A parameter that is its
own master (an fp32 parameter of a model on the CPU: the kernel updates it in place) has no place
in the master slab: host state is 8 bytes per parameter then, 12 otherwise. There is no gradient
slab: kernels read gradients where they are (CPU) or from chunk-sized staging (upcasts, CUDA),
which saved 4 bytes per parameter. Measured (``python -m bench.membus.bandwidth``, 50M GPT, 2-core VM): RSS
growth of construction + first step 8.01 bytes/param for fp32 (torch's AdamW: 8.00), 12.00 for
bf16 (it was 17.6 for fp32 with the master and gradient slabs).

A chunk is a list of :class:`View` s, each a range ``[start, stop)`` *inside one parameter*, with
``start`` a multiple of :data:`_ALIGN`; the parameter's last element always lies in the view that
ends at the parameter's end. Torch's fused CPU AdamW runs a vectorised body and a scalar tail per
tensor (and splits work between threads at 16-element units), with slightly different rounding, so
this rule makes every element take the code path it takes in the per-parameter reference, whatever
the chunk size or thread count. Chunks never cross a param-group or segment boundary.

Segments. A group's slabs are one segment, or two when only its last parameters may speculate
(``speculable``): each segment is a storage of its own, so that the unit a swap commits is exactly
what may speculate, and ``speculation_limit`` bounds the second generation's memory.

Two generations. With ``overlap_backward`` a segment that may speculate gets a second generation
(``next``, made by :meth:`HostSlabs.ensure_next`): a chunk updated during backward reads the
committed slabs and writes its new state there, out of place (the same bytes as in place); a step
that updated a segment that way commits it with :meth:`HostSlabs.swap`, which swaps the memory of
the two generations' storages (no copy: every view of the committed slabs, ``optimizer.state``
included, shows the new state at once). Between backward and ``step()`` the committed slabs are
untouched: ``optimizer.state`` shows the last step, and a redo or an undo needs no restore.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["_ALIGN", "Chunk", "HostSlabs", "ParamSlot", "StorageSwap", "View", "plan_chunks"]

StorageSwap = Callable[[Sequence[Tensor], Sequence[Tensor]], None]
"""``swap(a, b)``: swap the memory of ``a[i]``'s and ``b[i]``'s storages (the native
``swap_storages_``); see :meth:`HostSlabs.swap`."""

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
    """Offset in its segment's master slab; -1 when the parameter is its own master."""
    segment: int = 0
    """The segment of the slabs it lives in (offsets count from the segment's start)."""
    stride: tuple[int, ...] | None = None
    """None: its state is laid out as a contiguous tensor of ``shape``; else these strides (the
    parameter's, ``channels_last``): its place holds the elements in the parameter's memory order,
    and :meth:`HostSlabs.shaped` shows them with the parameter's shape and strides, as
    ``torch.zeros_like(p)`` makes torch's AdamW state."""

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
    """One pipeline unit: views of parameters of a single param group and slab segment."""

    index: int
    group: int
    views: tuple[View, ...]
    segment: int = 0
    """The slab segment its parameters live in."""

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
    segment = slots[0].segment if slots else 0

    def close() -> None:
        nonlocal current, used
        if current:
            chunks.append(Chunk(index=len(chunks), group=group, views=tuple(current), segment=segment))
        current, used = [], 0

    for slot in slots:
        if slot.group != group or slot.segment != segment:
            close()
            group, segment = slot.group, slot.segment
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
    ``moments``: the dtype of ``exp_avg`` and ``exp_avg_sq`` (``state_dtype``: float32, or bfloat16,
    4 bytes per parameter less); masters are float32.
    ``speculable``: elements that may be updated out of place during backward (the last ones in
    param_groups order, whose gradients usually arrive first): 0, none (no second generation);
    None, all; else the last whole parameters that fit in that many (each group split into a
    segment that may speculate and one that may not, see the module doc).
    """

    def __init__(
        self, shapes_per_group: list[list[torch.Size]], own_master: list[list[bool]] | None = None,
        *, zero: bool = True, speculable: int | None = 0,
        strides: list[list[tuple[int, ...] | None]] | None = None, moments: torch.dtype = torch.float32,
    ) -> None:
        numels = [[int(torch.Size(shape).numel()) for shape in shapes] for shapes in shapes_per_group]
        starts = _speculable_starts(numels, speculable)
        slots: list[ParamSlot] = []
        self._slabs: list[dict[SlabKind, Tensor]] = []
        #: Per segment: the chunks in it may update out of place during backward.
        self.speculable: list[bool] = []
        new = torch.zeros if zero else torch.empty  # empty: untouched pages, see first_touch
        for g, shapes in enumerate(shapes_per_group):
            cuts = sorted({0, starts[g], len(shapes)} - {len(shapes)}) if shapes else [0]
            for c, lo in enumerate(cuts):
                hi = cuts[c + 1] if c + 1 < len(cuts) else len(shapes)
                segment = len(self._slabs)
                offset = moffset = 0
                for i in range(lo, hi):
                    own = bool(own_master[g][i]) if own_master is not None else False
                    stride = strides[g][i] if strides is not None else None
                    slots.append(ParamSlot(len(slots), g, offset, numels[g][i], torch.Size(shapes[i]),
                                           -1 if own else moffset, segment, stride))
                    offset = _round_up(offset + numels[g][i], _ALIGN)
                    if not own:
                        moffset = _round_up(moffset + numels[g][i], _ALIGN)
                self._slabs.append({
                    "master": new(moffset, dtype=torch.float32),
                    "exp_avg": new(offset, dtype=moments),
                    "exp_avg_sq": new(offset, dtype=moments),
                })
                self.speculable.append(lo >= starts[g] and hi > lo)
        self.slots: tuple[ParamSlot, ...] = tuple(slots)
        #: Stochastic rounding of bf16 moments: its seed (``state_rounding="stochastic"``), or None
        #: (nearest-even). The kernels key their random bits on it (``offload.kernels._rounding``).
        self.rounding_seed: int | None = None
        #: Per slot: its place was ever given to a parameter's state (until then it holds the
        #: zeros it was made with: a model of ~20,000 small tensors spent ~2 s of its first step
        #: zeroing moments that were zero already).
        self.used = bytearray(len(slots))
        # view() is on the step's hot path (several calls per parameter per step); the slabs are
        # never reallocated, so each view tensor is made once and reused. A swap exchanges the
        # storages' memory, not the tensors: cached views keep their role (committed or next).
        self._views: dict[tuple[SlabKind, int, int, int], Tensor] = {}
        #: Per segment: the second generation of its slabs (None until ensure_next).
        self._next: list[dict[str, Tensor] | None] = [None] * len(self._slabs)
        self._next_views: dict[tuple[SlabKind, int, int, int], Tensor] = {}
        # Own masters (the parameter itself) have no place in the master slab; out of place their
        # new master goes to a scratch place of the second generation ("own"), which step()
        # copies into the parameter when it commits (the weight write), never swapped.
        self._own_offset: dict[int, int] = {}
        self._own_numel = [0] * len(self._slabs)
        for s in self.slots:
            if s.master_offset < 0:
                self._own_offset[s.index] = self._own_numel[s.segment]
                self._own_numel[s.segment] = _round_up(self._own_numel[s.segment] + s.numel, _ALIGN)

    @property
    def nbytes(self) -> int:
        """Host bytes of the committed generation."""
        return sum(t.numel() * t.element_size() for slabs in self._slabs for t in slabs.values())

    @property
    def next_nbytes(self) -> int:
        """Host bytes of the second generation (12 per element of every segment that has one)."""
        return sum(t.numel() * t.element_size() for nxt in self._next if nxt is not None for t in nxt.values())

    def slabs(self) -> list[Tensor]:
        """Every slab tensor (for first-touch and memory accounting)."""
        return [t for slabs in self._slabs for t in slabs.values()]

    def regions(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of every slab tensor, the second generation's too (what a NUMA
        page move covers: ``offload.state._placement``)."""
        tensors = self.slabs() + [t for nxt in self._next if nxt is not None for t in nxt.values()]
        return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.numel()]

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
        return self._slabs[s.segment][kind][base : base + s.numel]

    def shaped(self, kind: SlabKind, slot: int) -> Tensor:
        """The parameter ``slot`` in slab ``kind``, shaped like the parameter (a view; with its
        strides where it is not contiguous: ``ParamSlot.stride``)."""
        s = self.slots[slot]
        flat = self.flat(kind, slot)
        if s.stride is None:
            return flat.view(s.shape)
        return flat.as_strided(s.shape, s.stride, flat.storage_offset())

    def forget_views(self) -> None:
        """Drop the cached views (after the chunk layout changed; they are remade on demand)."""
        self._views.clear()
        self._next_views.clear()

    def view(self, kind: SlabKind, v: View) -> Tensor:
        """Elements ``[v.start, v.stop)`` of parameter ``v.slot`` in slab ``kind`` (a cached view)."""
        key = (kind, v.slot, v.start, v.stop)  # hashing a View runs Python code; a tuple does not
        t = self._views.get(key)
        if t is None:
            s = self.slots[v.slot]
            base = self._base(kind, s)
            t = self._views[key] = self._slabs[s.segment][kind][base + v.start : base + v.stop]
        return t

    # ------------------------------------------------------------ the second generation
    def ensure_next(self, segments: Iterable[int]) -> None:
        """Give each of ``segments`` (speculable ones) its second generation (zeros, like the
        slabs: the place of a slot never used stays zero in both)."""
        for seg in segments:
            if self._next[seg] is None:
                if not self.speculable[seg]:
                    raise RuntimeError(f"segment {seg} may not speculate: it gets no second generation")
                nxt: dict[str, Tensor] = {k: torch.zeros_like(t) for k, t in self._slabs[seg].items()}
                nxt["own"] = torch.zeros(self._own_numel[seg], dtype=torch.float32)
                self._next[seg] = nxt

    def has_next(self, segment: int) -> bool:
        """``segment`` has its second generation (:meth:`ensure_next`)."""
        return self._next[segment] is not None

    def next_view(self, kind: SlabKind, v: View) -> Tensor:
        """:meth:`view` of the second generation (``ensure_next`` made it for the view's segment)."""
        key = (kind, v.slot, v.start, v.stop)
        t = self._next_views.get(key)
        if t is None:
            s = self.slots[v.slot]
            nxt = self._next[s.segment]
            if nxt is None:
                raise RuntimeError(f"parameter {v.slot}'s segment {s.segment} has no second generation")
            slab, base = self._next_place(kind, s)
            t = self._next_views[key] = nxt[slab][base + v.start : base + v.stop]
        return t

    def _next_place(self, kind: SlabKind, s: ParamSlot) -> tuple[str, int]:
        """(tensor of the second generation, offset) of slot ``s``'s ``kind``: an own master's
        scratch place, else the committed layout's."""
        if kind == "master" and s.master_offset < 0:
            return "own", self._own_offset[s.index]
        return kind, self._base(kind, s)

    def next_flat(self, kind: SlabKind, slot: int) -> Tensor:
        """:meth:`flat` of the second generation."""
        s = self.slots[slot]
        nxt = self._next[s.segment]
        if nxt is None:
            raise RuntimeError(f"parameter {slot}'s segment {s.segment} has no second generation")
        slab, base = self._next_place(kind, s)
        return nxt[slab][base : base + s.numel]

    def kinds_of(self, slot: int) -> tuple[SlabKind, ...]:
        """The slabs that hold state of ``slot`` (no master place where it is its own master)."""
        return SLAB_KINDS if self.slots[slot].master_offset >= 0 else ("exp_avg", "exp_avg_sq")

    def carry(self, slots: Iterable[int]) -> None:
        """Copy the committed state of ``slots`` into the second generation (slots a step that
        commits by :meth:`swap` did not update: they keep their state)."""
        dsts: list[Tensor] = []
        srcs: list[Tensor] = []
        for slot in slots:
            for kind in self.kinds_of(slot):
                dsts.append(self.next_flat(kind, slot))
                srcs.append(self.flat(kind, slot))
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def keep(self, views: Iterable[View]) -> None:
        """Copy the second generation of ``views`` into the committed slabs (a step that failed
        part-way: the chunks that ran keep their update, as an update in place would have). An
        own master's new value is the caller's to copy into its parameter."""
        dsts: list[Tensor] = []
        srcs: list[Tensor] = []
        for v in views:
            for kind in self.kinds_of(v.slot):
                dsts.append(self.view(kind, v))
                srcs.append(self.next_view(kind, v))
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def swap(self, segments: Iterable[int], swap: StorageSwap | None) -> None:
        """Make the second generation of ``segments`` the committed one: ``swap`` exchanges the
        two storages' memory (every cached view, ``optimizer.state``'s included, then shows the
        new state; no byte copied); without it (no native extension) the new state is copied into
        the committed slabs (24 bytes per element moved)."""
        a: list[Tensor] = []
        b: list[Tensor] = []
        for seg in segments:
            nxt = self._next[seg]
            if nxt is None:
                raise RuntimeError(f"segment {seg} has no second generation to commit")
            for kind, t in self._slabs[seg].items():
                if t.numel():
                    a.append(t)
                    b.append(nxt[kind])
        if not a:
            return
        if swap is None:
            torch._foreach_copy_(a, b)
        else:
            swap(a, b)


def _speculable_starts(numels: list[list[int]], speculable: int | None) -> list[int]:
    """Per group, the index of its first parameter that may speculate (its length: none): the
    last parameters over all groups, in param_groups order, whose slab places add up to at most
    ``speculable`` elements (None: all of them)."""
    starts = [len(n) for n in numels]
    if speculable is None:
        return [0] * len(numels)
    if speculable == 0:
        return starts
    room = speculable
    for g in range(len(numels) - 1, -1, -1):
        for i in range(len(numels[g]) - 1, -1, -1):
            need = _round_up(numels[g][i], _ALIGN)
            if need > room:
                return starts
            room -= need
            starts[g] = i
    return starts
