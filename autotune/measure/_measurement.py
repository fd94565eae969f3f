"""Statistics of one candidate's step times, and the noise rule that decides if a gain is real.

Modelled on ``torch.utils.benchmark.Measurement``: keep the raw samples and derive robust
statistics (median, interquartile range) from them, never from a mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

__all__ = [
    "Measurement",
    "IQR_WARN_THRESHOLD",
    "IQR_GROSS_WARN_THRESHOLD",
    "MIN_GAIN",
    "NOISE_FACTOR",
    "OUTLIER_FACTOR",
    "TIE_TOLERANCE",
    "COST_REFERENCE_STEPS",
    "gain_threshold",
    "median_standard_error",
    "probe_cost_pct",
    "probe_cost_s",
    "significantly_faster",
]

#: A measurement whose IQR exceeds this fraction of its median is noisy (as in torch.utils.benchmark).
IQR_WARN_THRESHOLD = 0.1
#: ... and grossly noisy above this fraction.
IQR_GROSS_WARN_THRESHOLD = 0.25
#: Default minimum relative gain over the static plan before the tuner leaves it (1 %), and
#: default multiple of the standard error of the difference of two medians that a gain must
#: exceed to count as more than noise (a one-sided z-score). ``python -m bench.simulate``, 8 node
#: shapes x 50 seeds, chose them: against 2 % and 1.5 the worst p95 regret fell from 4.57 % to
#: 3.01 % (seeds 0-49; 3.01 % to 2.72 % on seeds 50-99), no node's median, p95 or max regret
#: rose, and the median probe steps stayed at 31-32. The old rule kept the static plan on a
#: third of the seeds where it was 4-6 % slower than the best (the noise term, not min_gain, set
#: the threshold: 3 % of the step and more with 3-6 samples); the false switches it prevents cost
#: less than 1 % each.
MIN_GAIN = 0.01
NOISE_FACTOR = 1.25
#: Standard error of the median of ``n`` samples is about ``MEDIAN_SE_PER_IQR * IQR / sqrt(n)``:
#: for normal noise sigma = IQR / 1.349 and the median's standard error is sqrt(pi / 2) sigma / sqrt(n).
MEDIAN_SE_PER_IQR = math.sqrt(math.pi / 2.0) / 1.349
#: A step this many times the best median so far may be a stall (on a node the step time is the
#: slowest rank's, so one rank's stall doubles a whole step): exploring does not stop a candidate
#: on two such samples alone (``autotune.decide._probe.STALL_CONFIRM_SAMPLES``). No decision filters
#: samples by it: a candidate's slow samples are its own (:mod:`autotune.measure._paired`).
OUTLIER_FACTOR = 1.5
#: Default relative distance between medians under which two candidates count as equally fast.
TIE_TOLERANCE = 0.005
#: The probing cost is also stated as a percentage of this many steps at the winner's median
#: (the summary's ``probe_cost_pct_of_1000_steps``): what probing weighs against a short run.
COST_REFERENCE_STEPS = 1000


def _quantile(ordered: tuple[float, ...], q: float) -> float:
    """Linear-interpolation quantile of sorted data (numpy's and torch.quantile's default)."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def format_ms(seconds: float) -> str:
    """Seconds as milliseconds, the one unit of every tuner message and table (no exponent)."""
    ms = seconds * 1e3
    return f"{ms:.2f} ms" if abs(ms) >= 1.0 or ms == 0 else f"{ms:.3f} ms"


@dataclass(frozen=True, slots=True)
class Measurement:
    """Raw samples (seconds) of one candidate and statistics derived from them.

    >>> m = Measurement((1.0, 1.2, 1.1, 5.0))
    >>> m.n, m.median, round(m.iqr, 3)
    (4, 1.15, 1.075)
    """

    samples: tuple[float, ...]
    label: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.samples, (str, bytes)) or not isinstance(self.samples, Iterable):
            raise ValueError(f"Measurement samples={self.samples!r}: expected a sequence of seconds")
        samples = tuple(self.samples)
        if not samples:
            raise ValueError("Measurement: expected at least one sample, got none")
        for value in samples:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"Measurement: sample {value!r}: expected a finite number of seconds >= 0")
        object.__setattr__(self, "samples", tuple(float(v) for v in samples))

    @property
    def n(self) -> int:
        return len(self.samples)

    def quantile(self, q: float) -> float:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile q={q!r}: expected 0 <= q <= 1")
        return _quantile(tuple(sorted(self.samples)), q)

    @property
    def median(self) -> float:
        return self.quantile(0.5)

    @property
    def iqr(self) -> float:
        """Interquartile range (0 for fewer than two samples)."""
        return self.quantile(0.75) - self.quantile(0.25)

    @property
    def mean(self) -> float:
        return sum(self.samples) / self.n

    @property
    def relative_iqr(self) -> float:
        return self.iqr / self.median if self.median > 0 else math.inf

    def meets_confidence(self, threshold: float = IQR_WARN_THRESHOLD) -> bool:
        """True if the spread is small: IQR below ``threshold`` times the median."""
        return self.relative_iqr < threshold

    def extended(self, samples: Iterable[float]) -> Measurement:
        """A new measurement with more samples appended."""
        return Measurement(self.samples + tuple(samples), self.label)

    def to_dict(self) -> dict[str, Any]:
        return {"samples": list(self.samples), "median_s": self.median, "iqr_s": self.iqr, "n": self.n}

    def __str__(self) -> str:
        head = f"{self.label}: " if self.label else ""
        noisy = "" if self.meets_confidence() else (
            " (very noisy)" if not self.meets_confidence(IQR_GROSS_WARN_THRESHOLD) else " (noisy)"
        )
        return f"{head}median {format_ms(self.median)} / IQR {format_ms(self.iqr)} / n={self.n}{noisy}"


def median_standard_error(measurement: Measurement) -> float:
    """Standard error of the median, estimated from the IQR: ``MEDIAN_SE_PER_IQR * IQR / sqrt(n)``
    (0 for a single sample). Unlike the IQR it shrinks as samples accumulate."""
    return MEDIAN_SE_PER_IQR * measurement.iqr / math.sqrt(measurement.n)


def gain_threshold(
    baseline: Measurement, candidate: Measurement, *, min_gain: float = MIN_GAIN, noise_factor: float = NOISE_FACTOR
) -> float:
    """Seconds by which ``candidate``'s median must undercut ``baseline``'s to count as faster:
    ``max(min_gain * baseline.median, noise_factor * standard error of the difference of the
    medians)``, the standard errors estimated from each measurement's IQR."""
    noise = math.hypot(median_standard_error(baseline), median_standard_error(candidate))
    return max(min_gain * baseline.median, noise_factor * noise)


def significantly_faster(
    candidate: Measurement, baseline: Measurement, *, min_gain: float = MIN_GAIN, noise_factor: float = NOISE_FACTOR
) -> bool:
    """True if ``candidate`` beats ``baseline`` by more than the noise and the minimum margin."""
    threshold = gain_threshold(baseline, candidate, min_gain=min_gain, noise_factor=noise_factor)
    return baseline.median - candidate.median > threshold


def probe_cost_s(step_times: Iterable[float], winner_median_s: float | None) -> float | None:
    """Seconds a session's probe steps took beyond the same number of steps at the winner's median.

    ``max(0, sum(t - winner_median_s for t in step_times))`` over every probe step (warm-ups,
    the slow first step after a switch and the finals included). Not clipped per step: a step
    faster than the median (the winner's own noise) offsets a slower one, so a session whose
    candidates are all as fast as the winner costs about nothing instead of its noise summed;
    only the total is floored at 0. ``0.0`` for no steps (a cache hit, one candidate); None when
    the winner has no median.

    >>> probe_cost_s([0.3, 0.1, 0.2, 0.1, 0.05], 0.1)  # clipped per step it would be 0.3
    0.25
    """
    times = [float(t) for t in step_times]
    if not times:
        return 0.0
    if winner_median_s is None:
        return None
    return max(0.0, math.fsum(times) - len(times) * winner_median_s)


def probe_cost_pct(cost_s: float | None, winner_median_s: float | None) -> float | None:
    """``cost_s`` as a percentage of :data:`COST_REFERENCE_STEPS` steps at ``winner_median_s``
    (None unless both are known and the median is > 0).

    >>> probe_cost_pct(0.35, 0.1)
    0.35
    """
    if cost_s is None or winner_median_s is None or not winner_median_s > 0:
        return None
    return 100.0 * cost_s / (COST_REFERENCE_STEPS * winner_median_s)
