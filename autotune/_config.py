"""What a client configures and reports: :class:`AutotuneConfig` (how the tuner probes, decides
and watches) and :class:`StepSample` (one measured training step).

Kept apart from the tuner so the schedule modules (:mod:`autotune.decide._probe`,
:mod:`autotune.decide._check`) read the config without importing the tuner that drives them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from autotune.measure._measurement import MIN_GAIN, NOISE_FACTOR, TIE_TOLERANCE

__all__ = ["AutotuneConfig", "StepSample"]


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"AutotuneConfig.{name}={value!r}: expected an int >= {minimum}")


def _check_float(name: str, value: object, minimum: float, *, strict: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum or (strict and value == minimum):
        relation = ">" if strict else ">="
        raise ValueError(f"AutotuneConfig.{name}={value!r}: expected a finite number {relation} {minimum}")


@dataclass(frozen=True, kw_only=True, slots=True)
class AutotuneConfig:
    """How the online tuner probes, decides and watches. Every local rank must use the same one."""

    probe_steps: int = 40
    """Most training steps one tuning session may spend probing (never exceeded)."""
    warmup_steps: int = 1
    """Steps discarded after each switch of setting (the first step after a change is slower)."""
    measure_steps: int = 3
    """Measured steps per candidate while exploring; also the steps of a cache re-check."""
    finalists: int = 3
    """Candidates re-measured interleaved before the decision, the static plan included (< 2: none)."""
    final_rounds: int = 2
    """Round-robin rounds of the finals; each visit is one warm-up and one measured step."""
    min_gain: float = MIN_GAIN
    """Smallest relative gain over the static plan that may replace it."""
    noise_factor: float = NOISE_FACTOR
    """How sure a decision must be, as a normal z-score: paired rounds decide with an exact paired
    permutation test at the one-sided level it names (1.25: 10.6 %); without paired rounds (no
    finals) a gain must exceed this multiple of the standard error of the difference of the two
    medians, each estimated from its IQR and sample count."""
    tie_tolerance: float = TIE_TOLERANCE
    """Medians within this relative distance of the fastest count as tied (then the preferred knob values win)."""
    seed: int = 0
    """Seed of the Optuna sampler."""
    timeout_s: float = 300.0
    """Timeout of every collective of the tuner; a rank that does not answer in time fails the others."""
    force_retune: bool = False
    """Ignore a cached choice and probe again (the new result replaces the cache entry)."""
    recheck_rounds: int = 4
    """Paired rounds of a cache re-check: the cached choice and the static plan, one warm-up and one
    measured step each per round, the order alternating. The choice is kept unless the static plan
    is clearly faster in them (fewer than 4 rounds can never show that at the default
    ``noise_factor``: the choice is then always kept). A cached static plan is measured for ``warmup_steps + measure_steps`` steps instead."""
    watch: bool = True
    """After lock-in, keep comparing the winner with the runner-up and the static plan in paired
    rounds now and then, and switch (every rank at the same step) when one is clearly faster
    (:mod:`autotune.decide._watch`): a run follows a host whose load changes."""
    watch_cost: float = 0.005
    """The most the watch may cost, as a fraction of the locked steps' time (0.5 %): what its
    rounds took beyond as many steps of the winner."""
    watch_window: int = 5
    """Paired rounds of one challenger per switch test: a challenger faster than the winner in
    every round of such a block (and by more than ``min_gain`` on the ratio of means) is switched
    to. Each block is tested once and dropped, so that rounds from before a change of load do
    not outvote the rounds after it and repeated tests do not add up false alarms (one block of
    two equal settings passes with probability 1/2**watch_window)."""
    use_cache: bool = True
    """Read and write the tuning cache (``autotune.tuner._session.cache_for`` builds it from the field below)."""
    cache_path: str | os.PathLike[str] | None = None
    """Cache file (a ``Path`` is accepted and stored as ``str``); None: ``$OFFLOAD_AUTOTUNE_CACHE``
    or the user cache directory (``autotune.knobs``)."""
    trace_dir: str | os.PathLike[str] | None = None
    """Folder of the trace files (trace.jsonl, trace.csv, trace.chrome.json, summary.json,
    tuning.png; a ``Path`` is stored as ``str``), written by each node's local rank 0 into a new
    ``run-N`` folder of it per run (``latest`` links to the newest); None: no trace."""
    trace_runs: bool = True
    """Each run's trace goes into a new ``run-N`` folder of ``trace_dir``; False: into
    ``trace_dir`` itself (a caller that made the run's folder, as the reference trainer does)."""

    def __post_init__(self) -> None:
        _check_int("probe_steps", self.probe_steps, 1)
        _check_int("warmup_steps", self.warmup_steps, 0)
        _check_int("measure_steps", self.measure_steps, 1)
        _check_int("finalists", self.finalists, 0)
        _check_int("final_rounds", self.final_rounds, 0)
        _check_float("min_gain", self.min_gain, 0.0)
        _check_float("noise_factor", self.noise_factor, 0.0)
        _check_float("tie_tolerance", self.tie_tolerance, 0.0)
        if self.tie_tolerance >= self.min_gain and self.min_gain > 0:
            raise ValueError(
                f"AutotuneConfig.tie_tolerance={self.tie_tolerance!r}: expected less than min_gain={self.min_gain!r}"
            )
        _check_int("seed", self.seed, 0)
        _check_float("timeout_s", self.timeout_s, 0.0, strict=True)
        _check_int("recheck_rounds", self.recheck_rounds, 1)
        _check_float("watch_cost", self.watch_cost, 0.0, strict=True)
        if self.watch_cost > 0.5:
            raise ValueError(f"AutotuneConfig.watch_cost={self.watch_cost!r}: expected a fraction in (0, 0.5]")
        _check_int("watch_window", self.watch_window, 1)
        for name in ("cache_path", "trace_dir"):
            value = getattr(self, name)
            text = os.fspath(value) if isinstance(value, os.PathLike) else value
            if value is not None and (not isinstance(text, str) or not text):
                raise ValueError(f"AutotuneConfig.{name}={value!r}: expected None or a non-empty str or "
                                 "os.PathLike path")
            object.__setattr__(self, name, text)  # stored as str: equal configs compare equal
        for name in ("force_retune", "watch", "use_cache", "trace_runs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"AutotuneConfig.{name}={getattr(self, name)!r}: expected a bool")
        minimum = 2 * (self.warmup_steps + self.measure_steps)
        if self.probe_steps < minimum:
            raise ValueError(
                f"AutotuneConfig.probe_steps={self.probe_steps}: expected >= {minimum} "
                f"(two candidates of warmup_steps + measure_steps = {self.warmup_steps} + {self.measure_steps})"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSample:
    """What the client measured for one training step."""

    time_s: float
    """The step's time in seconds (what the tuner minimises)."""
    stages: Mapping[str, float] = field(default_factory=dict)
    """Optional per-stage seconds (``{"step_s": ..., "drain_s": ...}``), written to the trace."""
    spans: tuple[Any, ...] = ()
    """Optional ``(stage, chunk, start_s, end_s)`` tuples for the Chrome trace."""

    def __post_init__(self) -> None:
        t = self.time_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"StepSample.time_s={t!r}: expected a finite number of seconds >= 0")
        if not isinstance(self.stages, Mapping):
            raise ValueError(f"StepSample.stages={self.stages!r}: expected a mapping of stage name to seconds")
        object.__setattr__(self, "spans", tuple(self.spans))
