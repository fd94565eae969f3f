"""The worker's stage records of one step turned into :class:`~offload.StepStats`.

Built lazily, when ``last_stats`` is first read: on CUDA a record's GPU time needs its events,
and waiting for them at the end of every ``step()`` would stall the host for nothing while the
tuner is locked and nobody reads the stats.
"""

from __future__ import annotations

from typing import Any

from offload.pipeline._jobs import StageRecord
from offload._stats import StageSpan, StepStats

__all__ = ["STAGES", "StatsBuilder"]

#: The pipeline's stages, in the order a chunk runs them.
STAGES = ("d2h", "adam_kernel", "materialize")


class StatsBuilder:
    """Turns stage records into StepStats when first read (CUDA times need their events)."""

    def __init__(self, records: list[StageRecord], t0: float, **fields: Any) -> None:
        """``t0``: the step's start (``time.perf_counter``); ``fields``: the other StepStats fields."""
        self._records, self._t0, self._fields = records, t0, fields
        self._stats: StepStats | None = None

    def build(self) -> StepStats:
        if self._stats is None:
            sums = dict.fromkeys(STAGES, 0.0)
            spans = []
            for r in self._records:
                r.finalize()
                sums[r.stage] += r.busy_s
                spans.append(StageSpan(r.stage, r.chunk, r.start - self._t0, r.end - self._t0))
            spans.sort(key=lambda s: (s.start_s, s.chunk))
            self._stats = StepStats(
                d2h_s=sums["d2h"],
                adam_kernel_s=sums["adam_kernel"],
                materialize_s=sums["materialize"],
                spans=tuple(spans),
                **self._fields,
            )
            self._records = []
        return self._stats
