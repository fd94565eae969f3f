"""Edits of device weights that no version counter shows, found by content (CUDA models).

A weight edited through ``.data`` (``p.data.clamp_()``, pruning ``p.data.mul_(mask)``,
Lookahead's ``p.data.copy_(slow)``) bumps a version counter of its own, so the stamps of
:mod:`offload.state._edits` miss it. On the host the kernel compares every master with its live
weight in its pass (``offload.kernels._adamw.mixed_precision_adamw_``, ``seen=``). A CUDA
model's weights are on the device, where the kernel cannot read them; so :class:`DeviceWeightSums`
keeps, per parameter, the content checksum (``offload.kernels._grad_stats.checksums_reference``:
a lane-weighted sum of every word, any change of one element changes it) of the weights the
optimizer last wrote, taken on the device after the step's weight copies (no host sync), and at
the next ``step()`` compares it with the checksum of the weights then: one host-device sync for
all of them, two device passes of 2-4 B per element, O(block) temporaries. A parameter whose
checksum differs is re-seeded as an edited one (``reseed``'s rule: an element whose master does
not round to its weight takes the weight's value), before any early chunk holding it is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

from offload.kernels._grad_stats import checksums_reference
from offload.state._dtensor import local
from offload.state._params import ParamRecord

__all__ = ["DeviceWeightSums"]


class DeviceWeightSums:
    """Per slot, the device checksum of the weights the optimizer last wrote (see the module doc).

    ``watched(tensor)``: which parameters' local tensors are watched (default: those on a CUDA
    device; a test passes another predicate to run the same logic on the CPU).
    """

    def __init__(self, watched: Callable[[Tensor], bool] | None = None) -> None:
        self._watched = watched if watched is not None else (lambda t: t.device.type == "cuda")
        self._sums: dict[int, Tensor] = {}  # slot -> 0-d int64 on the weight's device

    def _locals(self, records: Sequence[ParamRecord], slots: Iterable[int]) -> list[tuple[int, Tensor]]:
        # One device per optimizer (ParamRegistry checks it): a host model costs one test per step.
        if not records or not self._watched(local(records[0].param)):
            return []
        out = []
        for s in slots:
            t = local(records[s].param).detach()
            out.append((s, t if t.is_contiguous() else t.contiguous()))
        return out

    def record(self, records: Sequence[ParamRecord], slots: Iterable[int]) -> None:
        """After the step wrote the weights of ``slots`` (on the current stream, after it waited
        for the weight copies): their checksums, queued on the device."""
        found = self._locals(records, slots)
        if not found:
            return
        for s, v in zip((s for s, _ in found), checksums_reference([t for _, t in found]).unbind()):
            self._sums[s] = v

    def changed(self, records: Sequence[ParamRecord], slots: Iterable[int]) -> list[int]:
        """The slots among ``slots`` whose weights differ from what the optimizer last wrote (one
        host-device sync for all; none where nothing is watched)."""
        if not self._sums:  # (a host model, or nothing written yet)
            return []
        found = [(s, t) for s, t in self._locals(records, (s for s in slots if s in self._sums))
                 if t.device == self._sums[s].device]
        if not found:
            return []
        now = checksums_reference([t for _, t in found])
        was = torch.stack([self._sums[s] for s, _ in found])
        differs = (now != was).tolist()  # the one sync
        return [s for (s, _), d in zip(found, differs) if d]

    def forget(self, slots: Iterable[int]) -> None:
        """Slots whose weights the optimizer no longer vouches for (a relayout renumbers them)."""
        for s in slots:
            self._sums.pop(s, None)
