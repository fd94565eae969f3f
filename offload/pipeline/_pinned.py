"""The CUDA transport's page-locked host memory: a few blocks of exact size, counted.

torch's pinned allocator (``torch.empty(..., pin_memory=True)``) rounds every request up to a
power of two and keeps what it allocated for good: about 1.4x the bytes asked for on average, up
to 2x (64 bytes of padding put an 8 MiB ring slot into a 16 MiB block), and one ``cudaHostAlloc``
per request (users of other offload systems report 10-20 minutes in 800 per-parameter pinned
allocations, and 1.78x the host memory). Here every block
comes from :meth:`DeviceOps.pin <offload.pipeline._cuda_transport.DeviceOps>` (real: plain host
memory registered with ``cudaHostRegister``, page-aligned, rounded up to a page only) and goes back
through ``unpin`` after the last copy that touches it completed. :class:`PinnedPool` counts the
bytes held and the registrations made, which each step reports (``StepStats.pinned_bytes``,
``pinned_registrations``).

Two users, both sized once per chunk layout, between steps: page-locking synchronises the device
(a known hang beside NCCL launches on several ranks), so no block is made during a step, least of
all by an early chunk during an overlapped backward (issue 40). The optimizer has the worker make
them while it is idle, whenever a pipeline, a chunk size, a ring depth or a kernel is set
(``CudaTransport.reserve``, :meth:`Ring.reserve`, :meth:`LowpPlaces.reserve`):

* :class:`Ring`: one block per slot, as large as the largest chunk's staging (replaced for a new
  chunk layout, slots added or given back for a new depth, ``OffloadSettings.ring_slots``, each
  after its last copy). Used without a reservation (a pipeline alone, in tests), or by a chunk
  larger than reserved, a slot still grows at its next use, and every slot at the step's end.
* :class:`LowpPlaces`: where a chunk started during backward keeps its low-precision weights until
  ``step()`` writes them (fused-mp on bf16/fp16 parameters with ``overlap_backward``). One block
  for every such parameter, reserved with the rings; without a reservation, made at the end of the
  first step in which the transport met them (:meth:`LowpPlaces.note` on every update job,
  :meth:`LowpPlaces.settle` at the step's end), and a parameter not foreseen gets its place, with
  every other candidate's, in one more block.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from offload.pipeline._jobs import ChunkJob
from offload.pipeline._waits import EventWait
from offload.state._items import KIND_MP, LOWP_DTYPES, Item
from offload.state._slabs import HostSlabs

__all__ = ["PIN_ALIGN", "LowpPlaces", "PinOps", "PinnedPool", "Ring"]

#: Byte alignment of each place inside a pinned block (cache line; a multiple of every itemsize).
PIN_ALIGN = 64


def aligned(nbytes: int) -> int:
    return -(-nbytes // PIN_ALIGN) * PIN_ALIGN


class PinOps(Protocol):
    """The two device operations the pool needs (part of ``DeviceOps``)."""

    def pin(self, nbytes: int) -> Tensor:
        """A page-locked uint8 host tensor of ``nbytes`` bytes: one registration."""
        ...

    def unpin(self, buf: Tensor) -> None:
        """Give back a tensor :meth:`pin` returned (no copy may touch it any more)."""
        ...


class PinnedPool:
    """Every pinned block of one transport, with the bytes held and the registrations made."""

    def __init__(self, ops: PinOps) -> None:
        self._ops = ops
        self.nbytes = 0
        """Bytes of the blocks held now."""
        self.registrations = 0
        """Blocks registered so far (never decreases)."""

    def new(self, nbytes: int) -> Tensor:
        buf = self._ops.pin(max(nbytes, 1))
        self.registrations += 1
        self.nbytes += buf.numel()
        return buf

    def free(self, buf: Tensor) -> None:
        self.nbytes -= buf.numel()
        self._ops.unpin(buf)


def _check_slots(slots: int) -> None:
    if slots < 2:
        raise ValueError(f"staging slots={slots}: expected >= 2 (a copy and a kernel at once)")


class Ring:
    """``slots`` pinned blocks used in turn; each remembers the event of its last copy (and the
    event's label), which the host waits for through ``wait`` before the block is reused or freed."""

    def __init__(self, pool: PinnedPool, slots: int, *, name: str = "ring", wait: EventWait = EventWait()) -> None:
        _check_slots(slots)
        self._pool = pool
        self._name = name
        self._wait = wait
        self._bufs: list[Tensor | None] = [None] * slots
        self._last: list[tuple[Any, Any] | None] = [None] * slots  # (event, label) of the slot's last copy
        self._renew = [False] * slots  # sized for an old chunk layout: replaced at its next use
        self._next = 0
        self._largest = 0
        self._resize_to: int | None = None  # a new depth, applied by the worker at the next use

    def resize(self, slots: int) -> None:
        """Between steps: ``slots`` blocks from the next use on. As :meth:`renew`, nothing waits
        or is freed here (the caller's thread); the worker applies it at the next :meth:`reserve`
        (the optimizer's, at once), :meth:`take` or :meth:`settle`: the dropped slots' blocks given
        back after their last copy, the new slots made, the kept ones left as they are."""
        _check_slots(slots)
        self._resize_to = slots

    def _apply_resize(self) -> None:
        slots, self._resize_to = self._resize_to, None
        if slots is None or slots == len(self._bufs):
            return
        for slot in range(slots, len(self._bufs)):
            self._wait_last(slot)
            buf = self._bufs[slot]
            if buf is not None:
                self._pool.free(buf)
        grow = max(slots - len(self._bufs), 0)
        self._bufs = self._bufs[:slots] + [None] * grow
        self._last = self._last[:slots] + [None] * grow
        self._renew = self._renew[:slots] + [False] * grow
        self._next = 0  # (each take waits for its slot's last copy: any order is safe)

    def take(self, nbytes: int) -> tuple[int, Tensor]:
        """The next slot, after its last copy completed, holding at least ``nbytes`` bytes: a
        smaller block is replaced by one as large as the largest request so far (so a layout
        whose chunks grow registers each slot a few times in its first step, then never)."""
        if self._resize_to is not None:
            self._apply_resize()
        slot = self._next
        self._next = (slot + 1) % len(self._bufs)
        self._wait_last(slot)
        buf = self._bufs[slot]
        if buf is None or buf.numel() < nbytes or self._renew[slot]:
            self._largest = max(self._largest, nbytes)
            buf = self._replace(slot)
        return slot, buf

    def _replace(self, slot: int) -> Tensor:
        """A new block of the largest size for ``slot``, whose last copy completed."""
        old = self._bufs[slot]
        if old is not None:
            self._bufs[slot] = None
            self._pool.free(old)
        self._renew[slot] = False
        buf = self._bufs[slot] = self._pool.new(self._largest)
        return buf

    def used_by(self, slot: int, event: Any, label: Any) -> None:
        self._last[slot] = (event, label)

    def _wait_last(self, slot: int) -> None:
        """Wait (bounded) for the slot's last copy; forgotten only once it completed."""
        last = self._last[slot]
        if last is not None:
            self._wait(last[0], last[1], f"the {self._name}'s slot {slot} (its last copy)")
            self._last[slot] = None

    @property
    def nbytes(self) -> int:
        """Bytes of the slots' blocks."""
        return sum(b.numel() for b in self._bufs if b is not None)

    def settle(self) -> None:
        """At a step's end: every slot as large as the largest request so far, so a slot this step
        did not reach registers nothing in a later step (waits for the last copy of a slot it
        replaces: in the first step of a layout only)."""
        if self._resize_to is not None:
            self._apply_resize()
        if not self._largest:
            return
        for slot, buf in enumerate(self._bufs):
            if buf is None or buf.numel() < self._largest or self._renew[slot]:
                self._wait_last(slot)
                self._replace(slot)

    def reserve(self, nbytes: int) -> None:
        """Now, between steps, on the idle worker: a new depth applied and every slot at least
        ``nbytes`` (the chunk layout's largest staging), replaced where renewed, after its last
        copy; so the next steps' :meth:`take` finds its block (a larger request still grows one)."""
        self._largest = max(self._largest, nbytes)
        self.settle()

    def renew(self) -> None:
        """The chunk layout changed: every slot is replaced, at its next use or a step's end, by a
        block sized for the new chunks (on the worker, after the slot's last copy)."""
        self._renew = [True] * len(self._bufs)
        self._largest = 0

    def sync(self) -> None:
        for slot in range(len(self._last)):
            self._wait_last(slot)

    def release(self) -> None:
        """Wait for every slot's last copy, then give every block back (next take: new ones)."""
        self.sync()
        for slot, buf in enumerate(self._bufs):
            if buf is not None:
                self._bufs[slot] = None
                self._pool.free(buf)
        self._largest = 0


class LowpPlaces:
    """Per parameter (slot), a pinned place of its dtype for the low-precision weights a chunk
    started during backward computes (see the module doc); each place remembers the event of its
    last host-to-device copy, and :meth:`view` waits for it before handing the place out for
    writing again."""

    def __init__(self, pool: PinnedPool, *, wait: EventWait = EventWait()) -> None:
        self._pool = pool
        self._wait = wait
        self._blocks: list[Tensor] = []
        self._place: dict[int, Tensor] = {}
        self._last: dict[int, tuple[Any, Any]] = {}  # slot -> (event, label) of its place's last copy
        self._noted: dict[int, int] = {}  # chunk -> id of the item list noted for it
        self._want: dict[int, tuple[int, torch.dtype]] = {}  # fused-mp items met, without a place
        self._could: dict[int, tuple[int, torch.dtype]] = {}  # bf16/fp16 items met, without a place

    def note(self, job: ChunkJob, slabs: HostSlabs) -> None:
        """Remember the job's bf16/fp16 parameters that may start during backward (their slab
        segment may speculate); once per chunk and item list, so a step's cost is one lookup."""
        if self._noted.get(job.chunk) == id(job.items):
            return
        self._noted[job.chunk] = id(job.items)
        slots, speculable = slabs.slots, slabs.speculable
        for it in job.items:
            slot, p = it.view.slot, it.param
            if p.dtype not in LOWP_DTYPES or not speculable[slots[slot].segment] or self._fits(slot, p):
                continue
            self._could[slot] = (p.numel(), p.dtype)
            if it.kind == KIND_MP:
                self._want[slot] = (p.numel(), p.dtype)

    def settle(self) -> None:
        """At a step's end: one block for every fused-mp parameter noted without a place."""
        if self._want:
            self._allocate(self._want)

    def reserve(self, need: dict[int, tuple[int, torch.dtype]]) -> None:
        """Now, between steps, on the idle worker: one block for the places of ``need`` (slot ->
        elements, dtype: the parameters whose chunks may start during backward) that have none."""
        missing = {slot: nd for slot, nd in need.items() if not self._fits_shape(slot, *nd)}
        if missing:
            self._allocate(missing)

    def view(self, it: Item, *, for_write: bool) -> Tensor:
        """``it``'s elements of its parameter's place: to write (by an early kernel) or to read
        (by the host-to-device copy in ``step()``, which needs the place that kernel wrote)."""
        slot, p = it.view.slot, it.param
        if not self._fits(slot, p):
            if not for_write:
                raise RuntimeError(f"parameter {slot} ({p.dtype}, {p.numel()} elements) has no pinned place "
                                   "holding its new weights: expected a chunk started during backward to have "
                                   "written them")
            # not foreseen: a block for it and for every candidate
            self._could[slot] = (p.numel(), p.dtype)
            self._allocate(self._could)
        if for_write:
            self._wait_last(slot)
        return self._place[slot][it.view.start : it.view.stop]

    def used_by(self, slot: int, event: Any, label: Any) -> None:
        self._last[slot] = (event, label)

    def _wait_last(self, slot: int) -> None:
        """Wait (bounded) for the last copy of the slot's place; forgotten only once it completed."""
        last = self._last.get(slot)
        if last is not None:
            self._wait(last[0], last[1], f"parameter {slot}'s pinned place of early weights (its last copy)")
            del self._last[slot]

    @property
    def places(self) -> int:
        """Parameters with a place."""
        return len(self._place)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks holding the places."""
        return sum(b.numel() for b in self._blocks)

    def release(self) -> None:
        """Wait for every place's last copy, then give every block back."""
        for slot in list(self._last):
            self._wait_last(slot)
        self._place.clear()
        self._noted.clear()
        for buf in self._blocks:
            self._pool.free(buf)
        self._blocks = []

    def _fits(self, slot: int, p: Tensor) -> bool:
        return self._fits_shape(slot, p.numel(), p.dtype)

    def _fits_shape(self, slot: int, numel: int, dtype: torch.dtype) -> bool:
        place = self._place.get(slot)
        return place is not None and place.dtype == dtype and place.numel() == numel

    def _allocate(self, need: dict[int, tuple[int, torch.dtype]]) -> None:
        entries = sorted(need.items())
        block = self._pool.new(sum(aligned(n * dt.itemsize) for _, (n, dt) in entries))
        self._blocks.append(block)
        off = 0
        for slot, (n, dt) in entries:
            self._place[slot] = block[off : off + n * dt.itemsize].view(dt)
            off += aligned(n * dt.itemsize)
            self._want.pop(slot, None)
            self._could.pop(slot, None)
