"""The watch after lock-in (local rank 0): paired rounds of the winner against a challenger, now
and then, at a bounded cost; a switch when the challenger is clearly faster.

Why. A host that other jobs share changes under a run: a data loader starts, a neighbour's job
leaves. The setting locked in on the first steps can be the wrong one an hour later, and the only
way to know is to measure the alternative *now*, next to the winner. The old drift watch compared
the winner with its own lock-in median, which cannot tell "everything got slower" from "the
winner got slower", and could only start a whole re-probe.

How. A round is four steps, one measured step of each arm, the order alternating with each
round of the same challenger (``c c' w w'`` then ``w c c' w'``, a primed step being the warm-up
after a switch, discarded). The challengers take turns: the runner-up of the decision (close by
construction) and the static plan; a challenger that was faster than the winner in its last round
keeps the turn. Each block of ``watch_window`` (5) rounds of a challenger is tested once: if the
challenger was faster in every round of it (a sign test at p = 1/32) and by more than ``min_gain``
on the ratio of the mean step times (:class:`~autotune._paired.PairedComparison`), every rank
switches to it at the same step (settings never change the numbers, so a switch is exact) and the
old winner becomes a challenger.

Cost. A round costs what its four steps took beyond four steps of the winner as measured in the
same round (its *excess*: a slower challenger and the warm-up steps after a switch). The watch keeps the sum of the excesses
it spent under ``watch_cost`` (0.5 %) of the locked steps' time so far: the next round of a
challenger starts only once the allowance covers what its last rounds cost (at least
:data:`MIN_ROUND_COST` of a step). A challenger that was *faster* in its last round costs
nothing, so it is re-measured soon: a change of load is followed within a few rounds.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from autotune._config import AutotuneConfig
from autotune._paired import PairedComparison, gain_margin, round_order
from autotune._probe import Key, Slot

__all__ = ["MIN_ROUND_COST", "Switch", "Watch", "WatchStart"]

#: The least a round is assumed to cost, as a fraction of a step: the two switches' warm-up
#: steps are never free (a thread team is rebuilt, buffers are resized).
MIN_ROUND_COST = 0.25
#: Rounds of a challenger whose excess estimates the next one's cost (median).
COST_MEMORY = 3


@dataclass(frozen=True, slots=True)
class WatchStart:
    """When the next round starts and what its first step runs (every rank needs both)."""

    step: int
    """The index of the round's first step (the tuner counts steps from 0)."""
    slot: Slot


@dataclass(frozen=True, slots=True)
class Switch:
    """A challenger that proved clearly faster than the winner."""

    old: Key
    new: Key
    comparison: PairedComparison
    """The new winner's paired comparison with the old one."""


class Watch:
    """Rank 0's watch over a locked ``winner``.

    ``challengers``: the settings to compare with, in turn (the runner-up first, then the static
    plan). ``reference_s``: the winner's step time at lock-in (the unit of the cost allowance,
    updated from the winner's watch samples). ``locked_at``: the index of the first locked step.
    """

    def __init__(
        self, winner: Key, challengers: list[Key], *, reference_s: float, locked_at: int, config: AutotuneConfig,
        expected_ratios: dict[Key, float] | None = None,
    ) -> None:
        self.config = config
        self.winner = winner
        self.challengers = [c for c in dict.fromkeys(challengers) if c != winner]
        self.reference_s = max(reference_s, 1e-9)
        self.locked_at = locked_at
        self.spent_s = 0.0
        """Excess seconds spent by the watch's rounds so far (a faster challenger's rounds credit it)."""
        self.rounds: dict[Key, list[dict[Key, float]]] = {c: [] for c in self.challengers}
        self.excesses: dict[Key, list[float]] = {c: [] for c in self.challengers}
        self.switches = 0
        self._expected = dict(expected_ratios or {})
        self._winner_samples: deque[float] = deque(maxlen=8)
        self._turn = 0
        self._queue: deque[Slot] = deque()
        self._round_times: list[float] = []
        self.slot: Slot | None = None

    @property
    def active(self) -> bool:
        return bool(self.challengers) and self.config.watch

    def _challenger(self) -> Key:
        return self.challengers[self._turn % len(self.challengers)]

    def _estimate(self, challenger: Key) -> float:
        """Expected excess seconds of the next round of ``challenger``."""
        past = self.excesses[challenger][-COST_MEMORY:]
        if past and past[-1] < 0.0:
            return past[-1]  # faster than the winner just now: the next round pays for itself
        if past:
            estimate = statistics.median(past)
        else:
            ratio = self._expected.get(challenger, 1.0)
            estimate = 2.0 * self.reference_s * max(ratio - 1.0, 0.0)
        if estimate > 0.0 or not past:
            estimate = max(estimate, MIN_ROUND_COST * self.reference_s)
        return estimate

    def next_start(self, after_step: int) -> WatchStart | None:
        """The next round, starting after step ``after_step`` once the allowance covers it; None
        without challengers. Queues the round's slots."""
        if not self.active:
            return None
        challenger = self._challenger()
        per_step = self.config.watch_cost * self.reference_s
        needed = self.spent_s + self._estimate(challenger)
        at = self.locked_at + math.ceil(needed / per_step) if needed > 0 else after_step + 1
        at = max(at, after_step + 1)
        index = len(self.rounds[challenger])
        warm = self.config.warmup_steps
        self._queue.clear()
        for arm in round_order([challenger, self.winner], index):
            if arm == challenger or index % 2 == 0:  # the winner runs before an odd round: no switch
                self._queue.extend([Slot(arm, "watch_warmup", index)] * warm)
            self._queue.append(Slot(arm, "watch", index))
        if index % 2 == 1:
            self._queue.extend([Slot(self.winner, "watch_warmup", index)] * warm)  # back to the winner
        self._round_times = []
        self.rounds[challenger].append({})
        self.slot = self._queue.popleft()
        return WatchStart(at, self.slot)

    def record(self, node_time: float) -> Slot | None:
        """Record a watch step's node time; the next slot, or None when the round is over (then
        :meth:`conclude`)."""
        slot = self.slot
        if slot is None:
            raise RuntimeError("no watch round is running")
        self._round_times.append(node_time)
        if slot.phase == "watch":
            self.rounds[self._challenger()][-1][slot.key] = node_time
            if slot.key == self.winner:
                self._winner_samples.append(node_time)
        self.slot = self._queue.popleft() if self._queue else None
        return self.slot

    def conclude(self) -> Switch | None:
        """After a round: book its cost, test the challenger, and say whether to switch."""
        challenger = self._challenger()
        if self._winner_samples:
            self.reference_s = max(statistics.median(self._winner_samples), 1e-9)
        # What the round cost beyond as many steps of the winner, measured in the same round (a
        # change of load since the winner's earlier samples must not count as the watch's cost).
        winner_now = self.rounds[challenger][-1].get(self.winner, self.reference_s)
        excess = math.fsum(self._round_times) - len(self._round_times) * winner_now
        self.spent_s += excess
        self.excesses[challenger].append(excess)
        rounds = [r for r in self.rounds[challenger] if len(r) == 2]
        if not rounds or rounds[-1][challenger] >= rounds[-1][self.winner]:
            self._turn += 1  # the next challenger's turn; one that was faster just now is pressed on
        if len(rounds) < self.config.watch_window:
            return None
        # A block of watch_window rounds is tested once, then dropped: sliding windows retested
        # after every round would raise the false-alarm rate far above one block's.
        self.rounds[challenger] = []
        comparison = PairedComparison.of([r[challenger] for r in rounds], [r[self.winner] for r in rounds])
        margin = gain_margin(self.config.min_gain)
        if not (all(v < 0.0 for v in comparison.log_ratios) and -comparison.effect > margin):
            return None
        old = self.winner
        self.winner = challenger
        self.challengers = [old if c == challenger else c for c in self.challengers]
        self.rounds = {c: [] for c in self.challengers}
        self.excesses = {c: [] for c in self.challengers}
        self._winner_samples.clear()
        self._expected = {}
        self._turn = 0
        self.switches += 1
        return Switch(old=old, new=challenger, comparison=comparison)
