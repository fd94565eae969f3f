"""The drift watch: after lock-in, notices that the locked setting got clearly slower than measured.

Why the rule looks as it does: a locked step must cost next to nothing, so the watch only collects
step times and, once per ``drift_window`` steps, compares their median with the median the setting
was locked in with (the slowest local rank's: one all-reduce of one float per window, which the
tuner runs). One slow window (a checkpoint, a data stall) is no drift: only ``drift_patience``
consecutive windows slower by ``drift_factor`` are, and then the watch says whether to re-probe
(``drift_reprobe``, at most ``max_reprobes`` times a run, never with a single candidate).

The watch holds only numbers; the tuner owns the agreement and the schedule, logs the
:class:`Drift` on rank 0 and starts the re-probe. Every rank sees the same all-reduced medians, so
every rank's watch reports the same drift at the same step.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable

from autotune._config import AutotuneConfig
from autotune._measurement import format_ms

__all__ = ["Drift", "DriftWatch"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Drift:
    """A reported drift: the window that made it, the median it was compared with, what to do."""

    window_s: float
    """The latest window's median step time (the slowest local rank's)."""
    reference_s: float
    """The median the locked setting was measured with (or the first locked window's)."""
    windows: int
    """How many consecutive slow windows it took (``drift_patience``)."""
    window_steps: int
    """Steps per window (``drift_window``)."""
    reprobe: bool
    """Whether the tuner re-probes now (else it keeps the locked setting)."""

    @property
    def ratio(self) -> float:
        return self.window_s / self.reference_s if self.reference_s > 0 else math.inf

    def message(self, *, owner: str, step: int, setting: str) -> str:
        """The warning rank 0 logs; ``setting`` is the locked setting in words."""
        return (
            f"{owner}: step {step}: locked setting {setting} runs slower than measured: window median "
            f"{format_ms(self.window_s)} vs locked median {format_ms(self.reference_s)} (x{self.ratio:.2f}) "
            f"for {self.windows} windows of {self.window_steps} steps; "
            + ("re-probing" if self.reprobe else "keeping it")
        )


class DriftWatch:
    """Locked step times in, a :class:`Drift` out when the locked setting clearly slowed down.

    ``can_reprobe``: whether a re-probe could choose anything else (more than one candidate).
    """

    def __init__(self, config: AutotuneConfig, *, can_reprobe: bool) -> None:
        self.config = config
        self.can_reprobe = can_reprobe
        self.events = 0
        """Drifts reported this run."""
        self.reprobes = 0
        """Re-probes started this run (at most ``config.max_reprobes``)."""
        self.reference_s: float | None = None
        """The median windows are compared with (None: the next window becomes it)."""
        self._window: list[float] = []
        self._slow_windows = 0

    def lock(self, reference_s: float | None) -> None:
        """A new lock-in: compare with ``reference_s`` from now on, forgetting the windows so far."""
        self.reference_s = reference_s
        self._window.clear()
        self._slow_windows = 0

    def observe(self, time_s: float, node_median: Callable[[float], float]) -> Drift | None:
        """Record one locked step. At the end of a window ``node_median`` turns this rank's window
        median into the node's (the tuner's all-reduce); returns the drift when one is reported."""
        self._window.append(float(time_s))
        if len(self._window) < self.config.drift_window:
            return None
        local = statistics.median(self._window)
        self._window.clear()
        node = node_median(local)
        reference = self.reference_s
        if reference is None:
            # Nothing was measured before lock-in (one candidate): the first window is the reference.
            self.reference_s = node
            return None
        self._slow_windows = self._slow_windows + 1 if node > reference * self.config.drift_factor else 0
        if self._slow_windows < self.config.drift_patience:
            return None
        self._slow_windows = 0
        self.events += 1
        reprobe = self.config.drift_reprobe and self.reprobes < self.config.max_reprobes and self.can_reprobe
        if reprobe:
            self.reprobes += 1
        return Drift(
            window_s=node,
            reference_s=reference,
            windows=self.config.drift_patience,
            window_steps=self.config.drift_window,
            reprobe=reprobe,
        )
