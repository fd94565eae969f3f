"""``overlap_backward``'s hooks: which chunks have all their gradients, as backward runs.

A post-accumulate-grad hook on every parameter counts its firings (FSDP2 runs these hooks on the
sharded parameters after reduce-scatter). The first backward is a calibration: nothing starts
early, and the firings per parameter (outside ``accumulating()``) are learned. Later, a chunk
starts when every parameter in it has fired as often as learned; a chunk with a parameter that
did not fire during calibration never starts early (it runs in ``step()``). Counts are re-learned
from any backward whose counts differ.

Work started early is a speculation (``offload.overlap._speculation``): at ``step()`` every early
chunk is checked against what the step consumes, then committed, or undone and recomputed. A
parameter that does not require a gradient gets no hook (its chunks run in ``step()``).

Interface: one callable, ``start_early`` (:data:`StartEarly`, a method of the launcher, held
weakly: the hooks live on the model's parameters and must not keep the optimizer alive), which
builds and submits a chunk's job from the gradients read here. What started is the launcher's
record (``offload.overlap._speculation``), not this module's. The per-parameter counts live in
the parameter records (``ParamRecord.hooks_fired`` / ``hooks_expected``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Callable

from torch import Tensor

from offload.state._params import ParamRecord
from offload.state._slabs import Chunk

logger = logging.getLogger(__name__)

__all__ = ["GradHooks", "StartEarly"]

StartEarly = Callable[[Chunk, dict[int, Tensor]], None]
"""``start_early(chunk, grads)``: submit ``chunk``'s d2h + kernel from ``grads`` (slot -> local
gradient, read now), unless it cannot start early (a parameter without state yet)."""


def _grad_hook(overlap_ref: weakref.ref[GradHooks], slot: int, _param: Tensor) -> None:
    overlap = overlap_ref()
    if overlap is not None:
        overlap.on_grad(slot)


class GradHooks:
    """The backward hooks and their counts of one layout (see the module doc)."""

    def __init__(self, records: Sequence[ParamRecord], start_early: StartEarly, *,
                 calibrated: bool = False) -> None:
        """Hooks on every parameter of ``records``; ``start_early``: a bound method (held weakly);
        ``calibrated``: the records' ``hooks_expected`` were learned already (a new overlap after
        a relayout keeps what the old one learned)."""
        self._lock = threading.Lock()
        self._start_early = weakref.WeakMethod(start_early)  # type: ignore[arg-type]
        self._records = list(records)
        self.calibrated = calibrated
        self._accumulating = 0
        self._chunks: tuple[Chunk, ...] = ()
        self._chunks_of: list[list[int]] = [[] for _ in self._records]
        self._eligible: list[bool] = []
        self._pending: list[int] = []
        self.external = False
        """Gradients arrive through :meth:`on_grad` with ``external=True`` only (a DDP comm hook,
        after the all-reduce); the autograd hooks (before it) are ignored."""
        self._source: dict[int, Tensor] = {}  # slot -> the reduced gradient an external call gave
        for rec in self._records:
            rec.hooks_fired = 0
        ref = weakref.ref(self)
        self._handles: list[Any] = [  # a frozen parameter cannot take a hook (and needs none)
            rec.param.register_post_accumulate_grad_hook(functools.partial(_grad_hook, ref, rec.slot))
            for rec in self._records if rec.param.requires_grad
        ]

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def set_chunks(self, chunks: tuple[Chunk, ...]) -> None:
        with self._lock:
            self._chunks = chunks
            self._chunks_of = [[] for _ in self._records]
            for c in chunks:
                for slot in {v.slot for v in c.views}:
                    self._chunks_of[slot].append(c.index)
            self._reset_pending()

    def _reset_pending(self) -> None:
        recs = self._records
        self._eligible, self._pending = [], []
        for c in self._chunks:
            slots = {v.slot for v in c.views}
            self._eligible.append(self.calibrated and all(recs[s].hooks_expected > 0 for s in slots))
            self._pending.append(len(slots))

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        with self._lock:
            self._accumulating += 1
        try:
            yield
        finally:
            with self._lock:
                self._accumulating -= 1

    def on_grad(self, slot: int, grad: Tensor | None = None, *, external: bool = False) -> None:
        """A gradient of ``slot`` arrived (``grad``: where to read it, else ``param.grad``)."""
        with self._lock:
            if self._accumulating or external != self.external:
                return
            if grad is not None:
                self._source[slot] = grad
            rec = self._records[slot]
            rec.hooks_fired += 1
            if not self.calibrated or rec.hooks_fired != rec.hooks_expected:
                return
            for c in self._chunks_of[slot]:
                if not self._eligible[c]:
                    continue
                self._pending[c] -= 1
                if self._pending[c] == 0:
                    self._launch(self._chunks[c])

    def _launch(self, chunk: Chunk) -> None:
        """From a backward hook (under the lock): submit the chunk's d2h + kernel."""
        start_early = self._start_early()
        if start_early is None:
            return
        grads: dict[int, Tensor] = {}
        for slot in {v.slot for v in chunk.views}:
            rec = self._records[slot]
            g = self._source.get(slot)
            if g is None:
                g = rec.param.grad  # FSDP2: the reduce-scattered shard (grad_of takes it)
            if g is None or g.is_sparse:
                return  # not launchable early; step() runs it
            g = rec.grad_of(g)  # (channels_last: in the parameter's memory order)
            grads[slot] = g
        start_early(chunk, grads)

    def end_window(self) -> None:
        """At ``step()``: stop early launches for this step and learn the counts."""
        with self._lock:
            self._source = {}
            recs = self._records
            fired = [r.hooks_fired for r in recs]
            for r in recs:
                r.hooks_fired = 0
            if any(fired) and (not self.calibrated or fired != [r.hooks_expected for r in recs]):
                if self.calibrated:
                    logger.debug(
                        "overlap_backward: gradient hook counts changed; re-learned "
                        "(chunks with changed parameters start in step() until then)"
                    )
                for r, n in zip(recs, fired):
                    r.hooks_expected = n
                self.calibrated = True
            self._reset_pending()
