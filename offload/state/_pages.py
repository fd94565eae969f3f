"""Moving host pages to a NUMA node in place: Linux ``mbind(2)`` through ``ctypes``.

``OffloadSettings.bind_numa`` switched on between steps finds the slabs allocated and their pages
wherever they were first touched. :func:`mbind_move` gives a page-aligned range the policy
"preferred: node N" and asks the kernel to migrate the pages already there (``MPOL_MF_MOVE``):
the kernel copies each page and remaps it at the same virtual address, so the tensors, their
views and their bits are untouched and no second copy of the state is ever held.
``MPOL_PREFERRED``, not ``MPOL_BIND``: a node that is full falls back to another instead of failing
an allocation later. ``MPOL_MF_STRICT`` makes the call fail (``EIO``) where some pages could not
be moved (shared with another process, e.g. a DataLoader worker forked after the optimizer, or
pinned), so the caller can say so; the pages that could move have moved.

:func:`page_ranges` turns tensors' byte ranges into the page-aligned ranges handed to the mover
(a slab's first and last page are shared with its neighbours in memory: they get the same
preference; merged where they touch). :func:`page_node` reads back where a page lives
(``get_mempolicy(MPOL_F_NODE | MPOL_F_ADDR)``; tests). Linux on x86-64 and aarch64 only; elsewhere
every call raises ``OSError(ENOSYS)``, which the placement logs and survives.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from collections.abc import Callable, Iterable

__all__ = ["MPOL_MF_MOVE", "MPOL_MF_STRICT", "MPOL_PREFERRED", "PageMover", "mbind_move", "page_node",
           "page_ranges", "page_size"]

PageMover = Callable[[int, int, int], None]
"""``mover(addr, nbytes, node)``: move the pages of the page-aligned range ``[addr, addr + nbytes)``
to NUMA node ``node`` in place; raises ``OSError`` where it could not (default :func:`mbind_move`)."""

#: ``mbind`` modes and flags (``<linux/mempolicy.h>``).
MPOL_PREFERRED = 1
MPOL_MF_STRICT = 1 << 0
MPOL_MF_MOVE = 1 << 1
_MPOL_F_NODE = 1 << 0
_MPOL_F_ADDR = 1 << 1

#: Syscall numbers: (mbind, get_mempolicy) per machine (x86-64's table; aarch64's generic one).
_SYSCALLS = {"x86_64": (237, 239), "aarch64": (235, 236), "arm64": (235, 236)}
_WORD_BITS = 8 * ctypes.sizeof(ctypes.c_ulong)


def page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def page_ranges(regions: Iterable[tuple[int, int]], page: int | None = None) -> list[tuple[int, int]]:
    """``(addr, nbytes)`` byte ranges -> sorted, merged, page-aligned ``(start, nbytes)`` ranges
    covering them (empty ranges dropped)."""
    page = page or page_size()
    spans = sorted((addr - addr % page, -(-(addr + n) // page) * page) for addr, n in regions if n > 0)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in merged]


def _syscall(index: int, *args: object) -> int:
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None or platform.system() != "Linux":
        raise OSError(errno.ENOSYS, f"mbind/get_mempolicy: no syscall numbers for {platform.system()} "
                                    f"{platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(numbers[index]), *args)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(result)


def _nodemask(node: int) -> tuple[ctypes.Array[ctypes.c_ulong], int]:
    if isinstance(node, bool) or not isinstance(node, int) or node < 0:
        raise ValueError(f"node={node!r}: expected a NUMA node id >= 0")
    words = node // _WORD_BITS + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // _WORD_BITS] = 1 << (node % _WORD_BITS)
    return mask, words * _WORD_BITS + 1  # maxnode: the kernel reads maxnode - 1 bits


def mbind_move(addr: int, nbytes: int, node: int) -> None:
    """Prefer NUMA node ``node`` for the page-aligned range ``[addr, addr + nbytes)`` and migrate
    its pages there in place (``mbind(MPOL_PREFERRED, MPOL_MF_MOVE | MPOL_MF_STRICT)``).
    ``OSError``: ``EIO`` where some pages stayed (shared or pinned), ``EINVAL`` for an unaligned
    range or a node the machine lacks, ``ENOSYS`` where there is no such call."""
    if addr % page_size():
        raise OSError(errno.EINVAL, f"mbind: address {addr:#x} is not page-aligned")
    mask, maxnode = _nodemask(node)
    _syscall(0, ctypes.c_void_p(addr), ctypes.c_ulong(nbytes), ctypes.c_int(MPOL_PREFERRED), mask,
             ctypes.c_ulong(maxnode), ctypes.c_uint(MPOL_MF_MOVE | MPOL_MF_STRICT))


def page_node(addr: int) -> int:
    """The NUMA node of the page holding ``addr`` (it must be touched, else the kernel faults it in)."""
    node = ctypes.c_int(-1)
    _syscall(1, ctypes.byref(node), None, ctypes.c_ulong(0), ctypes.c_void_p(addr),
             ctypes.c_ulong(_MPOL_F_NODE | _MPOL_F_ADDR))
    return node.value
