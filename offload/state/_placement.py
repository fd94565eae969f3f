"""NUMA placement of the host state (``OffloadSettings.bind_numa``): at construction bind, allocate,
first touch; between steps bind and move the pages in place, or restore the affinity.

The slabs are most of a rank's host memory and every step streams them through the CPU. Linux
places a page on the NUMA node of the CPU that first writes it, so at construction the order
matters: the process is bound to its node first (the node of its GPU, or of most of its affinity
mask), then the slabs are allocated *untouched* (``torch.empty``), then the optimizer's worker
thread, the one whose intra-op threads run the kernels, writes every page once
(``HostSlabs.first_touch``).

Switched on between steps (``apply_settings``, the tuner's ``bind_numa`` knob), the slabs exist
and their pages sit wherever they were first touched: the process is bound the same way, then
the page-aligned range of every slab (the second generation's too) and of every CPU parameter
that is its own master (fp32 CPU models: the kernel updates it in place) goes to the page mover
(``offload.state._pages.mbind_move``: ``mbind`` with ``MPOL_MF_MOVE``), which migrates the pages to
the node in place: the same virtual addresses, no second copy of the state, the same bits. A
failed move (an old kernel, pages shared with a forked process, no such node) is logged once as a
WARNING and recorded (:attr:`NumaPlacement.move_error`); the step carries on with the pages
wherever they are. Switched off, the affinity the bind narrowed is restored and the pages stay
where they are (moving them back would cost a second migration for no gain on the next bind).
Where there is nothing to choose (one NUMA node, a node sysfs does not know) both are logged no-ops.

:class:`NumaPlacement` records what happened, as it happens: the binding (``close()`` restores
the affinity it changed), the order of the steps, whether the slabs were zeroed at allocation,
the thread and intra-op thread count of the first touch, the ranges moved. :class:`NumaSwitch`
holds the placement in force over the optimizer's life. Tests and users read it from
``CPUOffloadAdamW.numa_placement``; the binder and the page mover are injectable
(``numa_binder=``: a fake sysfs root in tests; ``page_mover=``: a recorder).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from offload.state._pages import PageMover, mbind_move, page_ranges
from offload.state._slabs import HostSlabs
from offload.threads._numa import NumaBinding, bind_rank_numa_node

logger = logging.getLogger(__name__)

__all__ = ["NumaBinder", "NumaPlacement", "NumaSwitch", "PageMover"]

NumaBinder = Callable[[torch.device], NumaBinding]
"""Binds this process to the NUMA node for a device (default ``bind_rank_numa_node``)."""


@dataclass(slots=True)
class NumaPlacement:
    """What the NUMA placement of one optimizer's host state did (filled in as it happens)."""

    binding: NumaBinding
    """What the bind changed (``binding.bound``: the mask was narrowed; ``restore()`` undoes it)."""
    device: str
    """The device the node was chosen for."""
    order: list[str] = field(default_factory=list)
    """The steps in the order they ran: "bind", "allocate", "first-touch"."""
    zeroed_at_allocation: bool | None = None
    """Whether the slabs were written when allocated (False: their pages were left untouched)."""
    touch_thread: str | None = None
    """Name of the thread that first touched the slabs (the optimizer's worker)."""
    touch_threads: int | None = None
    """Its intra-op threads during the touch."""
    moved: list[tuple[int, int]] = field(default_factory=list)
    """Switched on between steps: the page-aligned ranges ``(address, bytes)`` the page mover
    moved to ``binding.node`` (empty at construction: the first touch placed the pages)."""
    move_error: str | None = None
    """Why page moves failed (the first error, and how many ranges of how many), or None."""

    @classmethod
    def bind(cls, device: torch.device, binder: NumaBinder | None = None) -> NumaPlacement:
        """Bind this process to its NUMA node (before anything is allocated)."""
        placement = cls(binding=(binder or bind_rank_numa_node)(device), device=str(device))
        placement.order.append("bind")
        return placement

    def allocate(self, shapes: list[list[torch.Size]], own_master: list[list[bool]], *,
                 speculable: int | None = 0, strides: list[list[tuple[int, ...] | None]] | None = None,
                 moments: torch.dtype = torch.float32) -> HostSlabs:
        """The slabs, allocated untouched (their pages land where :meth:`first_touch` runs)."""
        slabs = HostSlabs(shapes, own_master, zero=False, speculable=speculable, strides=strides, moments=moments)
        self.zeroed_at_allocation = False
        self.order.append("allocate")
        return slabs

    def first_touch(self, slabs: HostSlabs) -> None:
        """Write every page of ``slabs`` (call it on the worker thread, with its intra-op threads)."""
        self.touch_thread = threading.current_thread().name
        self.touch_threads = torch.get_num_threads()
        slabs.first_touch()
        self.order.append("first-touch")

    def move_pages(self, regions: list[tuple[int, int]], mover: PageMover | None = None, *,
                   warn: bool = True) -> None:
        """Move the pages of ``regions`` (``(address, bytes)``: ``HostLayout.host_regions``, the
        slabs and the parameters that are their own masters; page-aligned ranges, merged where
        they touch) to the bound node, in place; a logged no-op where the bind chose no node. A mover's ``OSError`` never
        propagates: it is recorded in :attr:`move_error` and logged as a WARNING (``warn``), and
        the other ranges are still tried."""
        node = self.binding.node
        if node is None or not self.binding.bound:
            logger.info("bind_numa switched on: no NUMA node to choose (one node, or none known): no page moved")
            self.order.append("move-skipped")
            return
        ranges = page_ranges(regions)
        began = time.perf_counter()
        failed: list[str] = []
        for addr, nbytes in ranges:
            try:
                (mover or mbind_move)(addr, nbytes, node)
            except (OSError, ValueError) as exc:
                failed.append(f"{exc}")
                continue
            self.moved.append((addr, nbytes))
        self.order.append("move-pages")
        total = sum(n for _, n in self.moved)
        logger.info("bind_numa switched on: %.1f MiB of host state in %d ranges moved to NUMA node %d in %.3f s",
                    total / 2**20, len(self.moved), node, time.perf_counter() - began)
        if failed:
            self.move_error = (f"{len(failed)} of {len(ranges)} page ranges not (fully) moved to NUMA node {node}: "
                               f"{failed[0]}")
            (logger.warning if warn else logger.debug)(
                "bind_numa: %s; the step carries on with those pages where they are (pages shared with a "
                "forked process or pinned cannot move; the threads stay bound to the node)", self.move_error)

    def restore(self) -> None:
        """Give the threads the bind narrowed their previous affinity back (idempotent)."""
        self.binding.restore()


class NumaSwitch:
    """``bind_numa`` over an optimizer's life: the placement in force (None while off), bound at
    construction (:meth:`bind`, before the slabs are allocated) or between steps (:meth:`turn_on`:
    bind and move the pages), restored between steps or at close (:meth:`turn_off`: the pages
    stay). A failed page move is a WARNING once per optimizer, whatever the tuner's toggling (later
    failures are logged at DEBUG and recorded in ``NumaPlacement.move_error``)."""

    def __init__(self, device: torch.device, binder: NumaBinder | None = None,
                 mover: PageMover | None = None) -> None:
        self._device = device
        self._binder = binder
        self._mover = mover
        self._warned = False
        self.placement: NumaPlacement | None = None

    def bind(self) -> NumaPlacement:
        """At construction: bind first (the slabs, allocated next, are first touched on the node)."""
        self.placement = NumaPlacement.bind(self._device, self._binder)
        return self.placement

    def turn_on(self, regions: Callable[[], list[tuple[int, int]]]) -> None:
        """Between steps: bind, and move the pages of ``regions()`` to the node in place (no-op if on)."""
        if self.placement is not None:
            return
        placement = NumaPlacement.bind(self._device, self._binder)
        placement.move_pages(regions(), self._mover, warn=not self._warned)
        self._warned = self._warned or placement.move_error is not None
        self.placement = placement

    def turn_off(self) -> None:
        """Restore the affinity the bind narrowed; the pages stay where they are (no-op if off)."""
        placement, self.placement = self.placement, None
        if placement is not None:
            placement.restore()
            if placement.binding.bound:
                logger.info("bind_numa switched off: affinity restored; the host state's pages stay on NUMA node %s",
                            placement.binding.node)
