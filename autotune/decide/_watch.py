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
on the ratio of the mean step times (:class:`~autotune.measure._paired.PairedComparison`), every rank
switches to it at the same step (settings never change the numbers, so a switch is exact) and the
old winner becomes a challenger.

Cost. A round costs what its four steps took beyond four steps of the winner as measured in the
same round (its *excess*: a slower challenger and the warm-up steps after a switch), counted in
steps of the winner (the excess over the winner's time in that round), so that a load that slows
every step changes the cost and the allowance alike. The watch keeps the sum of the excesses it
spent under ``watch_cost`` (0.5 %) of the locked steps so far: the next round of a challenger
starts only once the allowance covers what its last rounds cost (at least :data:`MIN_ROUND_COST`
of a step). A challenger that was *faster* in its last round costs nothing, so it is re-measured
soon: a change of load is followed within a few rounds.

A load that starts mid-run. The challengers above are the runner-up and the static plan, both
often as heavy as the winner (another chunk size at the same thread count) and as slowed by a
load that takes cores. So the watch also holds the lighter setting (:meth:`SearchSpace.lighter`:
the winner with one thread count fewer) as a *conditional* challenger, in turn only while both arms
of the latest round ran :data:`SLOWDOWN` times slower than the winner did when it was locked in.
On a quiet host it costs nothing; when a load starts, it is the setting that can win, and once it
does, the old winner becomes a challenger: the way back when the load leaves
(``python -m bench.simulate``, "The watch follows a load change").
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from autotune._config import AutotuneConfig
from autotune.measure._paired import PairedComparison, gain_margin, round_order
from autotune.decide._probe import Key, Slot

__all__ = ["MIN_ROUND_COST", "Switch", "Watch", "WatchStart"]

#: The least a round is assumed to cost, as a fraction of a step: the two switches' warm-up
#: steps are never free (a thread team is rebuilt, buffers are resized).
MIN_ROUND_COST = 0.25
#: Rounds of a challenger whose excess estimates the next one's cost (median).
COST_MEMORY = 3
#: Both arms of the watch's latest round over the winner's time when it was locked in, beyond
#: which the conditional challengers (the lighter setting) take turns too: a load that starts
#: mid-run shows first as every setting slowing down (a stall slows one step, not both arms), and
#: the lighter setting is then what may win. Before, their rounds would only spend the allowance
#: (a lighter setting is slower on a quiet host) and space out every other challenger's rounds.
SLOWDOWN = 1.25
#: The winner's latest watch samples whose median is its step time now (:attr:`Watch.reference_s`).
RECENT_SAMPLES = 3


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
    plan). ``conditional``: more challengers that take turns only while both arms of the latest
    round ran :data:`SLOWDOWN` times slower than the winner when it was locked in (the lighter
    setting). ``reference_s``:
    the winner's step time at lock-in (then the median of its :data:`RECENT_SAMPLES` latest watch
    samples). ``locked_at``: the index of the first locked step.
    """

    def __init__(
        self, winner: Key, challengers: list[Key], *, reference_s: float, locked_at: int, config: AutotuneConfig,
        expected_ratios: dict[Key, float] | None = None, conditional: list[Key] | None = None,
    ) -> None:
        self.config = config
        self.winner = winner
        self.challengers = [c for c in dict.fromkeys(challengers) if c != winner]
        self.conditional = [c for c in dict.fromkeys(conditional or []) if c != winner and c not in self.challengers]
        self.reference_s = max(reference_s, 1e-9)
        self.locked_s = self.reference_s
        """The winner's step time when it was locked in (or switched to): what :data:`SLOWDOWN` compares with."""
        self.locked_at = locked_at
        self.spent = 0.0
        """What the watch's rounds cost so far, in steps of the winner: each round's excess over the
        winner's time in that same round (a faster challenger's rounds credit it). Counted in steps,
        not seconds, so a load that slows every step changes the cost and the allowance alike."""
        self._last_round_min = 0.0  # the faster arm's time in the latest round
        self.rounds: dict[Key, list[dict[Key, float]]] = {c: [] for c in self.challengers + self.conditional}
        self.excesses: dict[Key, list[float]] = {c: [] for c in self.challengers + self.conditional}
        self.switches = 0
        self._expected = dict(expected_ratios or {})
        self._winner_samples: deque[float] = deque(maxlen=8)
        self._turn = 0
        self._current: Key | None = None  # the challenger of the round under way
        self._pressed: Key | None = None  # a challenger faster than the winner in its last round: next again
        self._queue: deque[Slot] = deque()
        self._round_times: list[float] = []
        self.slot: Slot | None = None

    @property
    def active(self) -> bool:
        return bool(self.challengers) and self.config.watch

    def _slowed(self) -> bool:
        """Both arms of the latest round ran :data:`SLOWDOWN` times slower than the winner when locked in."""
        return self._last_round_min > SLOWDOWN * self.locked_s

    def _in_turn(self) -> list[Key]:
        return self.challengers + self.conditional if self._slowed() else self.challengers

    def _challenger(self) -> Key:
        if self._current is not None:
            return self._current  # the round under way
        if self._pressed is not None:
            return self._pressed  # faster just now: pressed on (a lighter setting too, slowed or not)
        turns = self._in_turn()
        return turns[self._turn % len(turns)]

    def _estimate(self, challenger: Key) -> float:
        """Expected excess of the next round of ``challenger``, in steps of the winner."""
        past = self.excesses[challenger][-COST_MEMORY:]
        if past and past[-1] < 0.0:
            return past[-1]  # faster than the winner just now: the next round pays for itself
        if past:
            estimate = statistics.median(past)
        else:
            estimate = 2.0 * max(self._expected.get(challenger, 1.0) - 1.0, 0.0)
        if estimate > 0.0 or not past:
            estimate = max(estimate, MIN_ROUND_COST)
        return estimate

    def next_start(self, after_step: int) -> WatchStart | None:
        """The next round, starting after step ``after_step`` once the allowance covers it; None
        without challengers. Queues the round's slots."""
        if not self.active:
            return None
        challenger = self._current = self._challenger()
        needed = self.spent + self._estimate(challenger)
        at = self.locked_at + math.ceil(needed / self.config.watch_cost) if needed > 0 else after_step + 1
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
            self.reference_s = max(statistics.median(list(self._winner_samples)[-RECENT_SAMPLES:]), 1e-9)
        if len(self.rounds[challenger][-1]) == 2 and challenger not in self.conditional:
            self._last_round_min = min(self.rounds[challenger][-1].values())  # (the lighter's own pace says nothing)
        # What the round cost beyond as many steps of the winner, measured in the same round (a
        # change of load since the winner's earlier samples must not count as the watch's cost).
        winner_now = max(self.rounds[challenger][-1].get(self.winner, self.reference_s), 1e-9)
        excess = math.fsum(self._round_times) / winner_now - len(self._round_times)
        self.spent += excess
        self.excesses[challenger].append(excess)
        rounds = [r for r in self.rounds[challenger] if len(r) == 2]
        if not rounds or rounds[-1][challenger] >= rounds[-1][self.winner]:
            self._turn += 1  # the next challenger's turn; one that was faster just now is pressed on
            self._pressed = None
        else:
            self._pressed = challenger
        self._current = None
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
        if challenger in self.conditional:  # the lighter setting won: the old winner in turn, the way back
            self.conditional.remove(challenger)
            self.challengers.append(old)
        else:
            self.challengers = [old if c == challenger else c for c in self.challengers]
        self.rounds = {c: [] for c in self.challengers + self.conditional}
        self.excesses = {c: [] for c in self.challengers + self.conditional}
        # The fastest the winner ran when locked in: a switch under load does not make the load the
        # new normal, or a lighter setting would never get its turn while it lasts.
        self.locked_s = min(self.locked_s, max(statistics.median(comparison.candidate), 1e-9))
        self._winner_samples.clear()
        self._expected = {}
        self._turn = 0
        self._pressed = None
        self.switches += 1
        return Switch(old=old, new=challenger, comparison=comparison)
