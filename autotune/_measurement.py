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
    "TIE_TOLERANCE",
    "gain_threshold",
    "significantly_faster",
]

#: A measurement whose IQR exceeds this fraction of its median is noisy (as in torch.utils.benchmark).
IQR_WARN_THRESHOLD = 0.1
#: ... and grossly noisy above this fraction.
IQR_GROSS_WARN_THRESHOLD = 0.25
#: Default minimum relative gain over the static plan before the tuner leaves it (3 %).
MIN_GAIN = 0.03
#: Default multiple of the larger IQR that a gain must exceed to count as more than noise.
NOISE_FACTOR = 1.0
#: Default relative distance between medians under which two candidates count as equally fast.
TIE_TOLERANCE = 0.005


def _quantile(ordered: tuple[float, ...], q: float) -> float:
    """Linear-interpolation quantile of sorted data (numpy's and torch.quantile's default)."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _format_seconds(value: float) -> str:
    if value >= 1.0:
        return f"{value:.3f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.1f} us"


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
        return f"{head}median {_format_seconds(self.median)} / IQR {_format_seconds(self.iqr)} / n={self.n}{noisy}"


def gain_threshold(
    baseline: Measurement, candidate: Measurement, *, min_gain: float = MIN_GAIN, noise_factor: float = NOISE_FACTOR
) -> float:
    """Seconds by which ``candidate``'s median must undercut ``baseline``'s to count as faster:
    ``max(min_gain * baseline.median, noise_factor * max(baseline.iqr, candidate.iqr))``."""
    return max(min_gain * baseline.median, noise_factor * max(baseline.iqr, candidate.iqr))


def significantly_faster(
    candidate: Measurement, baseline: Measurement, *, min_gain: float = MIN_GAIN, noise_factor: float = NOISE_FACTOR
) -> bool:
    """True if ``candidate`` beats ``baseline`` by more than the noise and the minimum margin."""
    threshold = gain_threshold(baseline, candidate, min_gain=min_gain, noise_factor=noise_factor)
    return baseline.median - candidate.median > threshold
