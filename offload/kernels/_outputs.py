"""What the native kernels write besides the update: a speculation's next generation and
checksums when a call updates nothing, and the weight copies of committed speculations.

Both serve ``offload.overlap``'s speculation (``offload.overlap._speculation``): the kernels of
:mod:`offload.kernels._adamw` take ``into``/``checksums`` and fill them in their own pass, and
:func:`speculation_outputs` is what they leave there when ``found_inf`` skips the update;
:func:`native_copy_` writes the committed weights into the parameters
(``offload.pipeline._host_transport``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from offload.kernels._build import ExtensionLoader
from offload.kernels._fused_mp import _module as _native_module
from offload.kernels._grad_stats import checksums_reference

__all__ = ["native_copy_", "speculation_outputs", "swap_storages_"]


def native_copy_(dsts: Sequence[Tensor], srcs: Sequence[Tensor], *,
                 loader: ExtensionLoader | None = None) -> None:
    """``dsts[i] = srcs[i]`` (each pair one dtype and size, contiguous, one element size per
    call) by the native extension: one parallel pass, the GIL released, non-temporal stores into
    the destinations of a large call (no read for ownership: 16-20% faster than
    ``torch._foreach_copy_`` on the 2-core VM, 20M fp32 or bf16 elements, 1 or 2 threads). For
    the weight copies of committed speculations (``offload.pipeline._host_transport``), which run
    only where a native kernel ran: the extension is loaded by then."""
    _native_module(loader).copy_(list(dsts), list(srcs))


def swap_storages_(a: Sequence[Tensor], b: Sequence[Tensor], *, loader: ExtensionLoader | None = None) -> None:
    """Swap the memory of ``a[i]``'s and ``b[i]``'s storages (each a CPU tensor over the whole of
    its own storage, the pair of one size) by the native extension: every view of either sees
    the other's bytes, no byte copied (a speculation's commit: ``HostSlabs.swap``). Raises
    ``FusedMPUnavailable`` without the extension (the caller copies instead)."""
    _native_module(loader).swap_storages_(list(a), list(b))


def speculation_outputs(grads: Sequence[Tensor], masters: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                        exp_avg_sqs: Sequence[Tensor], into: Sequence[Tensor],
                        checksums: Tensor | None, *, seen: Sequence[Tensor] = ()) -> None:
    """What a native kernel given ``into`` and ``checksums`` leaves there, made with torch ops
    (for a call that updates nothing: ``found_inf``). ``into``: empty, or per tensor ``i`` three
    fp32 tensors (``into[3i:3i+3]``) that receive its new master, ``exp_avg`` and ``exp_avg_sq``
    (an update out of place: the inputs are only read; with nothing updated, their values);
    ``checksums``: None, or an int64 tensor that receives each gradient's content checksum
    (:func:`offload.kernels._grad_stats.checksums_`). The kernels make both in their own pass: the
    gradient is read once, the committed state only read and the next generation only written
    (speculation, ``offload.overlap._speculation``). ``seen``: the weights a mixed-precision call
    compared the masters with; their words are part of each checksum (as the kernel adds them)."""
    if into:
        srcs = [t for trio in zip(masters, exp_avgs, exp_avg_sqs) for t in trio]
        torch._foreach_copy_(list(into), srcs)
    if checksums is not None:
        sums = checksums_reference(list(grads))
        if seen:
            sums += checksums_reference(list(seen))  # int64 wrap-around, as the kernel's uint64 sums
        checksums.copy_(sums)
