"""The re-check of a cached choice (local rank 0): :class:`CheckSession` compares it with the
static plan on the run's first steps and gives a :class:`CheckVerdict`: kept, or stale (re-tune).

A cached choice is re-checked because the machine may have changed in ways the fingerprint
cannot see (other jobs, thermal limits, a noisy neighbour). Today's samples are never compared
with the recorded median: that record was made under other conditions, and on a noisy host it
threw good choices away (issue 36: "clearly slower than recorded (median 3.98 ms / IQR 1.99 ms /
n=3 (very noisy) vs 2.80 ms); re-tuning", then 28 steps of probing). Instead the choice and the
static plan run ``recheck_rounds`` paired rounds (:mod:`autotune.measure._paired`: each round one visit
of each, the order alternating, each visit a warm-up step and a measured one), and the choice is
kept unless the static plan is clearly faster *now*. A cached static plan has nothing to be
compared with: it is measured for ``warmup_steps + measure_steps`` steps (the watch's reference)
and kept.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from autotune._config import AutotuneConfig
from autotune.measure._measurement import Measurement
from autotune.measure._paired import PairedComparison, round_order
from autotune.decide._probe import Key, Slot

__all__ = ["CheckSession", "CheckVerdict"]



@dataclass(frozen=True, kw_only=True, slots=True)
class CheckVerdict:
    """How a finished re-check ended."""

    stale: bool
    """True: the static plan is clearly faster than the cached choice today: re-tune."""
    reason: str
    """Why the choice holds, or why it does not."""
    measurements: tuple[tuple[Key, Measurement], ...]
    """The re-check's measurements: the choice's, and the static plan's when it was measured beside it."""
    reference_s: float
    """The choice's re-check median."""
    paired: PairedComparison | None = None
    """The choice's paired comparison with the static plan (None for a cached static plan)."""


class CheckSession:
    """Re-check of a cached choice ``key`` against the static plan ``baseline_key``.

    :attr:`slot` is the step about to run; :meth:`record` takes its node time and returns the next
    slot, or None when the re-check is over (then :meth:`verdict`).
    """

    def __init__(self, key: Key, baseline_key: Key, config: AutotuneConfig) -> None:
        self.key = key
        self.baseline_key = baseline_key
        self.config = config
        self.samples: dict[Key, list[float]] = {key: [], baseline_key: []}
        self.rounds: list[dict[Key, float]] = []
        self._queue: deque[Slot] = deque()
        if key == baseline_key:
            self._queue.extend([Slot(key, "check_warmup")] * config.warmup_steps)
            self._queue.extend([Slot(key, "check")] * config.measure_steps)
        else:
            previous = None
            for index in range(config.recheck_rounds):
                self.rounds.append({})
                for arm in round_order([key, baseline_key], index):
                    if arm != previous:  # the arm that ended the round before runs on: no switch
                        self._queue.extend([Slot(arm, "check_warmup", index)] * config.warmup_steps)
                    self._queue.append(Slot(arm, "check", index))
                    previous = arm
        self.slot: Slot | None = self._queue.popleft()

    def record(self, node_time: float) -> Slot | None:
        if self.slot is None:
            raise RuntimeError("the cache re-check has already finished")
        if self.slot.phase == "check":
            self.samples[self.slot.key].append(node_time)
            if self.slot.round >= 0:
                self.rounds[self.slot.round][self.slot.key] = node_time
        self.slot = self._queue.popleft() if self._queue else None
        return self.slot

    def measurement(self, key: Key | None = None) -> Measurement:
        key = self.key if key is None else key
        label = "re-check" if key == self.key else "re-check, static plan"
        return Measurement(tuple(self.samples[key]), label)

    def verdict(self, *, described: str) -> CheckVerdict:
        """After the last step: kept unless the static plan was clearly faster in the paired rounds.
        ``described``: the choice in words, for the reason."""
        if self.slot is not None:
            raise RuntimeError("the cache re-check has not finished")
        choice = self.measurement()
        if self.key == self.baseline_key:
            return CheckVerdict(stale=False, reason=f"cached choice (the static plan) measured: {choice}",
                                measurements=((self.key, choice),), reference_s=choice.median)
        plan = PairedComparison.of(
            [r[self.baseline_key] for r in self.rounds], [r[self.key] for r in self.rounds]
        )
        measurements = ((self.key, choice), (self.baseline_key, self.measurement(self.baseline_key)))
        stale = plan.clearly_faster(min_gain=self.config.min_gain, noise_factor=self.config.noise_factor)
        if stale:
            reason = f"the static plan is clearly faster than the cached choice {described} today: {plan.describe()}"
        else:
            reason = (f"cached choice {described} kept: the static plan was {plan.describe()}: "
                      "not clearly faster")
        return CheckVerdict(stale=stale, reason=reason, measurements=measurements, reference_s=choice.median,
                            paired=plan.reversed())
