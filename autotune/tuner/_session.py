"""Tune your own knobs: :class:`TuningSession`, and the cache and trace every client builds alike.

``CPUOffloadAdamW(autotune=...)``, ``offload.tune_step_threads`` and a :class:`TuningSession`
around any other code that runs steps (DeepSpeed's CPU Adam, an in-house offload optimizer) use
the same :class:`~autotune.OnlineTuner` and get its cache and trace from the same two functions:

- :func:`cache_for`: a :class:`TuningCache` at ``AutotuneConfig.cache_path``, else at
  ``$OFFLOAD_AUTOTUNE_CACHE``, else in the user's cache directory (``autotune.knobs``); None when
  ``use_cache`` is off.
- :func:`trace_for`: a :class:`TraceWriter` on each node's local rank 0 when ``trace_dir`` is set,
  into a new ``run-N`` folder of it (``latest`` links to the newest), so a second run never
  overwrites the first; into ``trace_dir`` itself with ``trace_runs=False`` (a caller that made
  the run's folder, as the reference trainer does for its own files).

A session starts its tuner at construction (the ranks agree, the cache is read, the first setting
applied), times each step it is handed, and on :meth:`TuningSession.close` writes the trace's
summary and closes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from autotune import knobs
from autotune.cache._cache import TuningCache
from autotune._config import AutotuneConfig, StepSample
from autotune.report._runs import new_run_dir
from autotune.measure._space import SearchSpace
from autotune.report._trace import TraceWriter
from autotune.tuner._tuner import OnlineTuner

__all__ = ["TuningSession", "cache_for", "global_rank", "trace_for"]

T = TypeVar("T")


def cache_for(config: AutotuneConfig) -> TuningCache | None:
    """The cache ``config`` names (see the module doc); its warnings name where the path came from."""
    if not config.use_cache:
        return None
    if config.cache_path:
        return TuningCache(Path(config.cache_path), source="AutotuneConfig(cache_path=...)")
    return TuningCache(knobs.cache_path(), source=knobs.CACHE_VAR)


def global_rank() -> int:
    """This process's rank in torch.distributed's default group (0 without it)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def trace_for(config: AutotuneConfig) -> TraceWriter | None:
    """The trace writer ``config`` asks for on this process (see the module doc): None off local
    rank 0 or without ``trace_dir``."""
    if not config.trace_dir or (knobs.local_rank() or 0) != 0:
        return None
    directory = new_run_dir(config.trace_dir) if config.trace_runs else Path(config.trace_dir)
    return TraceWriter(directory, rank=global_rank())


class TuningSession:
    """Tune the knobs of any code that runs steps, during its first steps (see docs/autotune.md).

    Args:
        space: the knobs and their values.
        baseline: the setting in effect without tuning (compared with every candidate).
        apply: called with a setting (a dict) between steps, at the same step on every local
            rank; it must only change how fast a step runs, never what it computes.
        config: the tuning protocol, cache and trace (:class:`AutotuneConfig`).
        workload: what the cache key should tell apart besides hardware and software (sizes,
            dtypes, a library's version): runs with equal keys reuse each other's result.
        group: the ranks that agree (None: this node's ranks under torch.distributed, else
            this process alone), or an :class:`~autotune.Agreement`.
        clock: what :meth:`step` times with (``time.perf_counter``; tests inject one).

    A step's time on a node is the slowest local rank's (the tuner reduces it). Construction
    agrees, reads the cache and applies the first setting; then hand every step to :meth:`step`
    (or time it yourself and call :meth:`observe`), and :meth:`close` at the end (or use the
    session as a context manager).
    """

    def __init__(
        self,
        space: SearchSpace,
        *,
        baseline: Mapping[str, Any],
        apply: Callable[[dict[str, Any]], None],
        config: AutotuneConfig | None = None,
        workload: Mapping[str, Any] | None = None,
        group: Any = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        config = AutotuneConfig() if config is None else config
        if not isinstance(config, AutotuneConfig):
            raise ValueError(f"TuningSession: config={config!r}: expected an AutotuneConfig")
        self._clock = clock
        self._trace = trace_for(config)
        self.tuner = OnlineTuner(space, baseline=dict(baseline), apply=apply, config=config, workload=workload,
                                 group=group, cache=cache_for(config), trace=self._trace)
        """The tuner (its ``summary()``, ``state``, ``setting``)."""
        self._closed = False
        try:
            self.tuner.start()
        except BaseException:
            self._close_trace()
            raise

    @property
    def trace_dir(self) -> Path | None:
        """The folder this run's trace goes to (on local rank 0; None elsewhere or without one)."""
        return self._trace.directory if self._trace is not None else None

    @property
    def setting(self) -> dict[str, Any]:
        """The setting in effect for the next step."""
        return self.tuner.current

    @property
    def state(self) -> str:
        """``"probing"``, ``"checking"``, ``"locked"``, ... (``OnlineTuner.state``)."""
        return self.tuner.state

    def step(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run one step, ``fn(*args, **kwargs)``, timed when the tuner measures, and return what it
        returns; the next setting may be applied before this returns. A step that raises is not
        observed."""
        if not self.tuner.measuring:
            result = fn(*args, **kwargs)
            self.tuner.observe(None)
            return result
        t0 = self._clock()
        result = fn(*args, **kwargs)
        self.observe(self._clock() - t0)
        return result

    def observe(self, seconds: float | None) -> None:
        """Record one finished step that took ``seconds`` (None between measured steps: see
        ``OnlineTuner.measuring``)."""
        self.tuner.observe(None if seconds is None else StepSample(time_s=seconds))

    def summary(self) -> dict[str, Any]:
        """The tuner's summary (state, cache hit, probe steps, baseline, winner, speed-up, ...)."""
        return self.tuner.summary()

    def close(self) -> None:
        """Write the trace's summary, close the trace and the tuner (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._trace is not None:
                self._trace.write_summary(self.tuner.summary())
        finally:
            self._close_trace()
            self.tuner.close()

    def _close_trace(self) -> None:
        if self._trace is not None:
            self._trace.close()

    def __enter__(self) -> TuningSession:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
