"""The re-check of a cached choice (local rank 0): :class:`CheckSession` measures it on the run's
first steps and gives a :class:`CheckVerdict`: confirmed, or stale (re-tune).

A cached choice is re-checked because the machine may have changed in ways the fingerprint
cannot see (other jobs, thermal limits, a noisy neighbour). Slower than recorded alone does not
condemn it: when the whole machine is slower, every setting is, so the static plan is then
measured beside it for as many steps and the choice is kept unless it lost to the static plan.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from autotune._config import AutotuneConfig
from autotune._measurement import Measurement, format_ms, median_standard_error
from autotune._probe import Key, Phase, Slot

logger = logging.getLogger(__name__)

__all__ = ["CheckSession", "CheckVerdict"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckVerdict:
    """How a finished re-check ended."""

    stale: bool
    """True: the choice is clearly slower than recorded (and than the static plan): re-tune."""
    reason: str
    """Why the choice holds (empty when stale)."""
    measurements: tuple[tuple[Key, Measurement], ...]
    """The re-check's measurements: the choice's, and the static plan's when it was measured beside it."""
    reference_s: float
    """The choice's re-check median: the drift watch's reference once locked."""


class CheckSession:
    """Re-check of a cached choice: warm-up steps, then ``measure_steps`` measured ones.

    If the choice is clearly slower than recorded, the absolute comparison alone cannot tell a
    choice gone bad from a machine that is slower for everyone (other jobs, a noisy neighbour):
    :meth:`measure_baseline` then adds the same number of steps of the static plan, and
    :meth:`still_ahead_of_baseline` compares the two measured side by side.
    """

    def __init__(self, key: Key, recorded_median_s: float, config: AutotuneConfig) -> None:
        self.key = key
        self.recorded_median_s = recorded_median_s
        self.config = config
        self.samples: list[float] = []
        self.baseline_key: Key | None = None
        self.baseline_samples: list[float] = []
        self._queue = deque(self._slots(key, "check_warmup", "check"))
        self.slot: Slot | None = self._queue.popleft()

    def _slots(self, key: Key, warmup: Phase, measure: Phase) -> list[Slot]:
        return [Slot(key, warmup)] * self.config.warmup_steps + [Slot(key, measure)] * self.config.measure_steps

    def record(self, node_time: float) -> Slot | None:
        if self.slot is None:
            raise RuntimeError("the cache re-check has already finished")
        if self.slot.phase == "check":
            self.samples.append(node_time)
        elif self.slot.phase == "check_baseline":
            self.baseline_samples.append(node_time)
        self.slot = self._queue.popleft() if self._queue else None
        return self.slot

    def measurement(self) -> Measurement:
        return Measurement(tuple(self.samples), "re-check")

    def baseline_measurement(self) -> Measurement:
        return Measurement(tuple(self.baseline_samples), "re-check, static plan")

    def clearly_slower(self) -> bool:
        """True if the re-check median exceeds the recorded one by more than ``recheck_tolerance``
        and by more than the noise."""
        m = self.measurement().without_outliers()
        excess = m.median - self.recorded_median_s
        beyond_tolerance = excess > self.config.recheck_tolerance * self.recorded_median_s
        return beyond_tolerance and excess > self.config.noise_factor * median_standard_error(m)

    def measure_baseline(self, baseline_key: Key) -> Slot:
        """Queue the static plan's warm-up and measured steps; returns the next slot."""
        if self.slot is not None or self.baseline_key is not None:
            raise RuntimeError("the static plan is measured once, after the cached choice")
        self.baseline_key = baseline_key
        self._queue.extend(self._slots(baseline_key, "check_warmup", "check_baseline"))
        self.slot = self._queue.popleft()
        return self.slot

    def still_ahead_of_baseline(self) -> bool:
        """The cached choice, measured next to the static plan, is not slower than it by more than
        ``min_gain``: whatever slowed the machine down slowed both, and the choice still holds."""
        if self.baseline_key is None or not self.baseline_samples:
            raise RuntimeError("the static plan was not measured")
        choice = self.measurement().without_outliers().median
        static = self.baseline_measurement().without_outliers().median
        return choice <= static * (1.0 + self.config.min_gain)

    def conclude(self, baseline_key: Key, *, described: str, owner: str) -> Slot | CheckVerdict:
        """After the last measured step: the verdict, or the first slot of the static plan measured
        beside the choice (once, when the choice is clearly slower than recorded and is not the
        static plan itself). ``described``: the choice in words, for the log."""
        measured = self.measurement()
        recorded = format_ms(self.recorded_median_s)
        reason = f"cached choice confirmed ({measured}; recorded median {recorded})"
        measurements = [(self.key, measured)]
        if self.clearly_slower():
            if self.baseline_key is None and self.key != baseline_key:
                # Slower than recorded: the choice, or the whole machine? Ask the static plan.
                return self.measure_baseline(baseline_key)
            if self.baseline_key is None or not self.still_ahead_of_baseline():
                logger.warning(
                    "%s: the cached choice %s is clearly slower than recorded (%s vs recorded median %s)%s; "
                    "re-tuning",
                    owner,
                    described,
                    measured,
                    recorded,
                    "" if self.baseline_key is None else f" and than the static plan ({self.baseline_measurement()})",
                )
                return CheckVerdict(stale=True, reason="", measurements=tuple(measurements), reference_s=measured.median)
            static = self.baseline_measurement()
            logger.info(
                "%s: the cached choice %s is slower than recorded (%s vs %s) but so is the static plan (%s): "
                "the machine is slower, the choice holds",
                owner, described, measured, recorded, static,
            )
            reason = (f"cached choice confirmed against the static plan measured next to it ({measured} vs "
                      f"{static}); both slower than recorded (median {recorded})")
            measurements.append((self.baseline_key, static))
        return CheckVerdict(stale=False, reason=reason, measurements=tuple(measurements), reference_s=measured.median)
