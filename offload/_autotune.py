"""Glue between ``CPUOffloadAdamW`` and the generic ``autotune.OnlineTuner``.

This module is the only place that knows both sides: it builds the offload search space (threads
x chunk size) from the thread plan and the slab sizes, turns each step's ``StepStats`` into the
tuner's ``StepSample`` and turns the tuner's settings back into ``OffloadSettings``.

Objective: without ``overlap_backward`` the settings change nothing but ``step()`` itself (the
worker thread sets its own intra-op thread count), so the tuner minimises the wall time of
``step()``; that keeps the noise of forward and backward out of the comparison. With
``overlap_backward`` part of the step runs during backward and competes with it for the CPU, so
the tuner minimises the wall time of the whole iteration instead, from the return of the previous
``step()`` to the return of this one. The first step after a switch is discarded by the tuner's
warm-up rule.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

from autotune import (
    AutotuneConfig,
    Knob,
    OnlineTuner,
    SearchSpace,
    StepSample,
    TraceWriter,
    TuningCache,
    geometric_ladder,
    knobs,
    powers_of_two,
)
from offload._threads import ThreadPlan

if TYPE_CHECKING:
    from offload._optimizer import CPUOffloadAdamW

logger = logging.getLogger(__name__)

__all__ = ["OffloadTuning", "offload_search_space"]

#: Smallest chunk the tuner probes: below ~1M elements per call the fixed per-chunk cost shows.
MIN_TUNED_CHUNK = 1 << 20
#: Most chunk sizes probed; with the thread ladder this keeps the grid inside the probe budget
#: on typical machines (the tuner switches to TPE when it does not fit).
MAX_CHUNK_CANDIDATES = 4
#: Most thread counts probed.
MAX_THREAD_CANDIDATES = 5


def offload_search_space(
    *, max_threads: int, baseline_threads: int, largest_slab: int, baseline_chunk: int, fixed_threads: bool
) -> SearchSpace:
    """Threads (a geometric ladder from 1 to ``max_threads`` that holds the static plan's value)
    x chunk size (powers of two from 1 Mi elements to the largest slab, plus the configured one).

    Every argument must be the same on every local rank (derive them from agreed values).
    """
    if fixed_threads:
        threads: tuple[int, ...] = (baseline_threads,)
    else:
        threads = geometric_ladder(1, max_threads, include=(baseline_threads,), max_count=MAX_THREAD_CANDIDATES)
    hi = max(largest_slab, MIN_TUNED_CHUNK)
    chunks = set(powers_of_two(MIN_TUNED_CHUNK, hi, max_count=MAX_CHUNK_CANDIDATES)) if largest_slab > MIN_TUNED_CHUNK else set()
    # A chunk at least as large as the largest slab is the same schedule whatever its size: keep one.
    chunks = {c for c in chunks if c < largest_slab}
    chunks.add(baseline_chunk)
    return SearchSpace(
        (
            Knob("threads", threads, prefer="low"),
            Knob("chunk_numel", tuple(sorted(chunks)), prefer="high"),
        )
    )


class OffloadTuning:
    """Owns the ``OnlineTuner`` of one ``CPUOffloadAdamW`` and feeds it every step."""

    def __init__(
        self,
        optimizer: CPUOffloadAdamW,
        config: AutotuneConfig,
        *,
        plan: ThreadPlan,
        fixed_threads: bool,
        objective: Literal["step", "iteration"],
        workload: dict[str, Any],
        largest_slab: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._optimizer = optimizer
        self._clock = clock
        if objective not in ("step", "iteration"):
            raise ValueError(f"objective={objective!r}: expected 'step' or 'iteration'")
        self.objective = objective
        self._own_threads = plan.threads
        # Every local rank must build the same space: the ladder tops at the largest budget of any
        # local rank and each rank caps the knob at its own plan (see _apply), so the static plan
        # ("as many threads as my plan allows") is the same setting on every rank.
        local = tuple(plan.local_threads) if getattr(plan, "local_threads", None) else (plan.threads,)
        top = plan.threads if fixed_threads else max(local)
        baseline = {"threads": top, "chunk_numel": optimizer.settings.chunk_numel}
        space = offload_search_space(
            max_threads=top,
            baseline_threads=top,
            largest_slab=largest_slab,
            baseline_chunk=baseline["chunk_numel"],
            fixed_threads=fixed_threads,
        )
        cache = None
        if config.use_cache:
            cache = TuningCache(Path(config.cache_path) if config.cache_path else knobs.cache_path())
        # The tuner writes its cache and trace on local rank 0 only.
        self._trace: TraceWriter | None = None
        if config.trace_dir and (knobs.local_rank() or 0) == 0:
            self._trace = TraceWriter(Path(config.trace_dir), rank=_global_rank())
        self.tuner = OnlineTuner(
            space,
            baseline=baseline,
            apply=self._apply,
            config=config,
            workload=workload,
            cache=cache,
            trace=self._trace,
        )
        self._last_return: float | None = None
        self.tuner.start()
        self._last_return = self._clock()

    def _apply(self, setting: dict[str, Any]) -> None:
        threads = min(int(setting["threads"]), self._own_threads)
        current = self._optimizer.settings
        self._optimizer.apply_settings(replace(current, threads=threads, chunk_numel=int(setting["chunk_numel"])))

    def after_step(self) -> None:
        """Called at the end of every ``step()``; reads the step's stats only while tuning
        (on CUDA, reading them waits for the step's copies)."""
        now = self._clock()
        previous, self._last_return = self._last_return, now
        if self.tuner.state == "locked" and not self.tuner.config.drift_window:
            return  # locked: nothing per step
        stats = self._optimizer.last_stats
        if stats is None:
            return
        iteration_s = now - previous if previous is not None else stats.step_s
        stages = {
            "iteration_s": iteration_s,
            "step_s": stats.step_s,
            "d2h_s": stats.d2h_s,
            "adam_kernel_s": stats.adam_kernel_s,
            "materialize_s": stats.materialize_s,
            "drain_s": stats.drain_s,
        }
        spans = tuple((s.stage, s.chunk, s.start_s, s.end_s) for s in stats.spans)
        was_locked = self.tuner.state == "locked"
        time_s = iteration_s if self.objective == "iteration" else stats.step_s
        self.tuner.observe(StepSample(time_s=time_s, stages=stages, spans=spans))
        if self.tuner.state == "locked" and not was_locked:
            self.flush()

    def flush(self) -> None:
        """Write the trace summary (idempotent); called at lock-in and by ``close``."""
        if self._trace is not None:
            self._trace.write_summary(self.tuner.summary())

    def close(self) -> None:
        self.flush()
        if self._trace is not None:
            self._trace.close()
        self.tuner.close()


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
