"""NUMA binding: narrow this process's threads to one NUMA node's CPUs, and undo it.

Used before a rank allocates its host optimizer state (``OffloadSettings(bind_numa=True)``): the
pages are first touched by threads on the node that will compute on them, next to the GPU when
there is one. Every bind returns a :class:`NumaBinding` whose ``restore()`` gives each changed
thread its previous mask back; where there is nothing to choose (one node, no CUDA, an unknown
or CPU-less node) the bind is a logged no-op.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Sequence

import torch

from offload.threads._topology import format_cpulist, parse_cpulist, read_affinity, read_numa_nodes, read_pci_numa_node

logger = logging.getLogger(__name__)

__all__ = [
    "NumaBinding",
    "bind_rank_numa_node",
    "bind_to_device_numa_node",
    "bind_to_numa_node",
    "device_pci_bus_id",
    "numa_node_for",
    "rank_numa_node",
]


class NumaBinding:
    """What a NUMA bind changed; ``restore()`` (or leaving the ``with`` block) undoes it.

    ``node``: the NUMA node bound to, or None. ``cpus``: the calling thread's mask after the bind
    (``previous`` when skipped). ``previous``: its mask before. ``bound``: whether the mask was
    narrowed to the node.
    """

    __slots__ = ("node", "cpus", "previous", "bound", "_changed")

    def __init__(self, *, node: int | None, cpus: frozenset[int], previous: frozenset[int],
                 bound: bool, changed: tuple[tuple[int, frozenset[int]], ...] = ()) -> None:
        self.node = node
        self.cpus = cpus
        self.previous = previous
        self.bound = bound
        self._changed = changed

    def restore(self) -> None:
        """Give every thread the bind changed its previous mask back, and so every thread started
        while bound, which inherited the narrowed mask (the optimizer's worker and its intra-op
        threads after a bind at construction): every thread of the process whose mask is still
        exactly the bound one (idempotent)."""
        changed, self._changed = self._changed, ()
        for tid, mask in changed:
            with contextlib.suppress(OSError):  # the thread may have exited
                os.sched_setaffinity(tid, mask)
        if not changed:
            return
        done = {tid for tid, _ in changed}
        with contextlib.suppress(OSError):
            for name in os.listdir("/proc/self/task"):
                tid = int(name)
                with contextlib.suppress(OSError):
                    if tid not in done and frozenset(os.sched_getaffinity(tid)) == self.cpus:
                        os.sched_setaffinity(tid, self.previous)

    def __enter__(self) -> NumaBinding:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def __repr__(self) -> str:
        return f"NumaBinding(node={self.node}, cpus={format_cpulist(self.cpus)!r}, bound={self.bound})"


def _skip(node: int | None, why: str, *args: object) -> NumaBinding:
    logger.warning("NUMA bind skipped, mask kept: " + why, *args)
    mask = read_affinity()
    return NumaBinding(node=node, cpus=mask, previous=mask, bound=False)


def bind_to_numa_node(node: int, *, root: Path | str = "/") -> NumaBinding:
    """Narrow this process's threads to the CPUs of NUMA node ``node`` that they may already use.

    The new mask is the intersection of the node's cpulist (``root/sys/devices/system/node``) and
    the calling thread's mask; every thread whose mask equals the caller's is narrowed too (threads
    started later inherit it). A CPU-less node, an unknown node or an empty intersection logs a
    warning and changes nothing. Returns a handle whose ``restore()`` undoes the change.
    """
    path = Path(root) / "sys" / "devices" / "system" / "node" / f"node{node}" / "cpulist"
    try:
        node_cpus = parse_cpulist(path.read_text(), what=str(path))
    except OSError:
        return _skip(node, "NUMA node %s has no cpulist at %s", node, path)
    if not node_cpus:
        return _skip(node, "NUMA node %s has no CPUs (a memory-only node)", node)
    previous = read_affinity()
    target = previous & node_cpus
    if not target:
        return _skip(node, "NUMA node %s CPUs %s do not intersect the mask %s", node,
                     format_cpulist(node_cpus), format_cpulist(previous))
    changed: list[tuple[int, frozenset[int]]] = []
    if target != previous:
        own = threading.get_native_id()
        os.sched_setaffinity(0, target)
        changed.append((own, previous))
        with contextlib.suppress(OSError):
            for name in os.listdir("/proc/self/task"):
                tid = int(name)
                if tid == own:
                    continue
                with contextlib.suppress(OSError):
                    if frozenset(os.sched_getaffinity(tid)) == previous:
                        os.sched_setaffinity(tid, target)
                        changed.append((tid, previous))
    logger.info("bound %d threads to NUMA node %d: CPUs %s (was %s)", len(changed), node,
                format_cpulist(target), format_cpulist(previous))
    return NumaBinding(node=node, cpus=target, previous=previous, bound=True, changed=tuple(changed))


def device_pci_bus_id(index: int) -> str:
    """sysfs PCI address of CUDA device ``index`` (the one place that reads device properties)."""
    props = torch.cuda.get_device_properties(index)
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def bind_to_device_numa_node(device: torch.device | int | str | None = None, *, root: Path | str = "/",
                             pci_bus_id: Callable[[int], str] = device_pci_bus_id) -> NumaBinding:
    """Bind to the NUMA node of a CUDA device (default: the current one), see :func:`bind_to_numa_node`.

    ``pci_bus_id`` maps a CUDA device index to its sysfs PCI address (default: from the device's
    properties; tests pass a table). A no-op (``bound=False``) without CUDA, for a non-CUDA
    device, or when sysfs reports no NUMA node for the device (``numa_node`` = -1).
    """
    if not torch.cuda.is_available():
        logger.debug("NUMA bind skipped: no CUDA device")
        mask = read_affinity()
        return NumaBinding(node=None, cpus=mask, previous=mask, bound=False)
    if device is None:
        index = torch.cuda.current_device()
    else:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            mask = read_affinity()
            return NumaBinding(node=None, cpus=mask, previous=mask, bound=False)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
    bus_id = pci_bus_id(index)
    node = read_pci_numa_node(bus_id, root)
    if node is None:
        logger.info("NUMA bind skipped: sysfs reports no NUMA node for cuda:%d (%s)", index, bus_id)
        mask = read_affinity()
        return NumaBinding(node=None, cpus=mask, previous=mask, bound=False)
    return bind_to_numa_node(node, root=root)


def numa_node_for(
    *, mask: frozenset[int], nodes: Sequence[tuple[int, frozenset[int]]], device_node: int | None
) -> int | None:
    """The NUMA node a rank's host state belongs on, or None when there is nothing to choose.

    With a GPU: the node sysfs reports for it (``device_node``; the copies cross no socket link).
    Without: the node holding most CPUs of the rank's affinity mask (ties: the lowest id), so the
    threads that compute on the state sit next to it. None on a single-node machine, or when the
    mask meets no node's CPUs.
    """
    if device_node is not None:
        return device_node
    if len(nodes) < 2:
        return None
    best = max(((len(mask & cpus), -node) for node, cpus in nodes), default=(0, 0))
    return -best[1] if best[0] > 0 else None


def rank_numa_node(device: torch.device | str | None = None, *, root: Path | str = "/",
                   pci_bus_id: Callable[[int], str] = device_pci_bus_id) -> int | None:
    """The node :func:`bind_rank_numa_node` would bind this process to, without binding: the
    node of its CUDA device as sysfs reports it, else of most of its affinity mask; None where
    there is nothing to choose (one node, no node reported). Never raises for a missing sysfs."""
    nodes = read_numa_nodes(root)
    if len(nodes) < 2:
        return None
    dev = torch.device(device) if device is not None else torch.device("cpu")
    device_node = None
    if dev.type == "cuda" and torch.cuda.is_available():
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        try:
            device_node = read_pci_numa_node(pci_bus_id(index), root)
        except (OSError, RuntimeError, ValueError) as exc:
            logger.debug("rank_numa_node: no NUMA node for cuda:%d: %s", index, exc)
            return None
        if device_node is None:
            return None
    return numa_node_for(mask=read_affinity(), nodes=nodes, device_node=device_node)


def bind_rank_numa_node(device: torch.device | str | None = None, *,
                        root: Path | str = "/") -> NumaBinding:
    """Bind this process to the NUMA node of its GPU (``device`` on CUDA), or of its affinity mask
    (CPU), see :func:`numa_node_for`; a no-op binding where there is nothing to choose."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        return bind_to_device_numa_node(dev, root=root)
    mask = read_affinity()
    node = numa_node_for(mask=mask, nodes=read_numa_nodes(root), device_node=None)
    if node is None:
        logger.debug("NUMA bind skipped: one NUMA node, or the mask %s meets none", format_cpulist(mask))
        return NumaBinding(node=None, cpus=mask, previous=mask, bound=False)
    return bind_to_numa_node(node, root=root)
