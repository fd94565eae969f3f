"""NUMA placement of the host state (``OffloadSettings.bind_numa``): bind, allocate, first touch.

The slabs are most of a rank's host memory and every step streams them through the CPU. Linux
places a page on the NUMA node of the CPU that first writes it, so the order matters: the process
is bound to its node first (the node of its GPU, or of most of its affinity mask), then the slabs
are allocated *untouched* (``torch.empty``), then the optimizer's worker thread, the one whose
intra-op threads run the kernels, writes every page once (``HostSlabs.first_touch``).

:class:`NumaPlacement` records what happened, as it happens: the binding (``close()`` restores
the affinity it changed), the order of the three steps, whether the slabs were zeroed at
allocation, and the thread and intra-op thread count of the first touch. Tests and users read it
from ``CPUOffloadAdamW.numa_placement``; the binder is injectable (``numa_binder=``: a fake sysfs
root in tests).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from offload.state._slabs import HostSlabs
from offload.threads._numa import NumaBinding, bind_rank_numa_node

__all__ = ["NumaBinder", "NumaPlacement"]

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

    def restore(self) -> None:
        """Give the threads the bind narrowed their previous affinity back (idempotent)."""
        self.binding.restore()
