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
old winner becomes a challenger. A block that does not pass is tested on the mean too: the
challenger's latest :data:`MEAN_BLOCKS` blocks together (at least two), the exact paired
permutation test of the step-time differences at :data:`MEAN_LEVEL` and the ratio of means beyond
``min_gain``. The sign test alone would keep a winner that is fast in most rounds and many times
slower in the others (on the loaded 2-CPU VM, 2 threads of stock AdamW ran 13 ms or 140 ms a step
in regimes of seconds, 1 thread 20 ms: 4x slower on the mean, faster in most rounds).

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

A winner that slows down sharply. The allowance spaces a challenger's rounds by what they are
expected to cost: a runner-up twice as slow as the winner waits 400 steps for its first round. But
the winner's own pace can collapse long before (on a 2-core host an OpenMP team of 2 threads ran
13 ms for the first steps after lock-in, then 140 ms per step for good, while 1 thread ran 20 ms:
``bench.tuner_load --load threads``). So while no round is due within :data:`PULSE_EVERY` steps,
the watch takes a *pulse*: one measured step of the winner alone (no switch, no warm-up, no
excess; only the step's two collectives). A pulse :data:`SLOWDOWN` times slower than the winner's
time that a challenger's expected cost was counted against makes that estimate optimistic: the
challenger is assumed not to have slowed, so a challenger that is now faster pays for its round and
it runs at once; the lighter setting takes turns too. Being wrong costs one round, which the
allowance then pays back: the cost bound holds within one round.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from autotune._config import AutotuneConfig
from autotune.measure._paired import PairedComparison, gain_margin, round_order
from autotune.decide._probe import Key, Slot

__all__ = ["MEAN_BLOCKS", "MEAN_LEVEL", "MIN_ROUND_COST", "PULSE_EVERY", "Switch", "Watch", "WatchStart"]

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
#: Blocks of a challenger's rounds (its latest ``MEAN_BLOCKS * watch_window``) that the test on the
#: mean looks at, when a block's sign test did not switch.
MEAN_BLOCKS = 4
#: The level of that test (the exact paired permutation test of :mod:`autotune.measure._paired`, on the
#: differences of step times: the mean, what a run pays), half the block test's 1/32: it looks at
#: overlapping windows, block after block.
MEAN_LEVEL = 1.0 / 64.0
#: Steps between the winner's pulses while no round is due sooner: how soon the watch notices a
#: winner that slowed down sharply, for two small collectives per pulse.
PULSE_EVERY = 25


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
        self._latest_s = 0.0  # the faster arm's time in the latest round, or the winner's in the latest pulse
        self._pulse_s: float | None = None  # the winner's time in a pulse since the latest round
        self._winner_then: dict[Key, float] = {}  # the winner's time in each challenger's latest round
        self._challenger_last: dict[Key, float] = {}  # each challenger's measured step in its latest round
        self.rounds: dict[Key, list[dict[Key, float]]] = {c: [] for c in self.challengers + self.conditional}
        self.excesses: dict[Key, list[float]] = {c: [] for c in self.challengers + self.conditional}
        self._history: dict[Key, deque[dict[Key, float]]] = {}  # each challenger's latest tested rounds
        self.switches = 0
        self._expected = dict(expected_ratios or {})
        self._winner_samples: deque[float] = deque(maxlen=8)
        self._turn = 0
        self._current: Key | None = None  # the challenger of the round under way
        self._pressed: Key | None = None  # a challenger faster than the winner in its last round: next again
        self._queue: deque[Slot] = deque()
        self._round: list[tuple[Slot, float]] = []  # the round's (or pulse's) steps so far and their times
        self.slot: Slot | None = None

    @property
    def active(self) -> bool:
        return bool(self.challengers) and self.config.watch

    def _slowed(self) -> bool:
        """Both arms of the latest round (or the winner in a later pulse) ran :data:`SLOWDOWN` times
        slower than the winner when locked in."""
        return self._latest_s > SLOWDOWN * self.locked_s

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
        then = self._winner_then.get(challenger, self.locked_s)
        if self._pulse_s is not None and self._pulse_s > SLOWDOWN * then:
            # The winner slowed since the estimate's rounds: assume the challenger did not. Its
            # time then: as measured in its latest round, else the expected ratio's (two measured
            # steps a round, so the ratio behind a first estimate is 1 + estimate / 2).
            own = self._challenger_last.get(challenger, (1.0 + estimate / 2.0) * then)
            estimate = min(estimate, 2.0 * (own / self._pulse_s - 1.0))
        return estimate

    def next_start(self, after_step: int) -> WatchStart | None:
        """The next round, starting after step ``after_step`` once the allowance covers it; None
        without challengers. Queues the round's slots."""
        if not self.active:
            return None
        challenger = self._challenger()
        needed = self.spent + self._estimate(challenger)
        at = self.locked_at + math.ceil(needed / self.config.watch_cost) if needed > 0 else after_step + 1
        at = max(at, after_step + 1)
        self._queue.clear()
        self._round = []
        if at > after_step + PULSE_EVERY:  # no round due soon: a pulse of the winner alone
            self.slot = Slot(self.winner, "watch_pulse", 0)
            return WatchStart(after_step + PULSE_EVERY, self.slot)
        self._current = challenger
        index = len(self.rounds[challenger])
        warm = self.config.warmup_steps
        for arm in round_order([challenger, self.winner], index):
            if arm == challenger or index % 2 == 0:  # the winner runs before an odd round: no switch
                self._queue.extend([Slot(arm, "watch_warmup", index)] * warm)
            self._queue.append(Slot(arm, "watch", index))
        if index % 2 == 1:
            self._queue.extend([Slot(self.winner, "watch_warmup", index)] * warm)  # back to the winner
        self.rounds[challenger].append({})
        self.slot = self._queue.popleft()
        return WatchStart(at, self.slot)

    def record(self, node_time: float) -> Slot | None:
        """Record a watch step's node time; the next slot, or None when the round is over (then
        :meth:`conclude`)."""
        slot = self.slot
        if slot is None:
            raise RuntimeError("no watch round is running")
        self._round.append((slot, node_time))
        if slot.phase == "watch_pulse":
            self._winner_samples.append(node_time)
        elif slot.phase == "watch":
            self.rounds[self._challenger()][-1][slot.key] = node_time
            if slot.key == self.winner:
                self._winner_samples.append(node_time)
        self.slot = self._queue.popleft() if self._queue else None
        return self.slot

    def _excess(self, challenger: Key) -> tuple[float, float]:
        """What the round's steps took beyond as many steps of the winner, in steps of the winner,
        and the winner's time it counted against.

        The switch penalty is what a warm-up step takes over its arm's measured step, the smaller
        of the two arms' (a stall in one warm-up is not a penalty). The winner's time is its
        measured step, unless its warm-up less the penalty differs from that by more than
        :data:`SLOWDOWN`: then the round straddles a change of load (the winner measured before
        it, the challenger after) or the winner is fast and slow by turns, and the mean of the two
        is its time, so that the change is not booked as the watch's cost. The winner's warm-up
        steps run the winner, which the run would have run anyway: each is charged the penalty
        only (a winner slow now and then would book its own slowness as the watch's cost)."""
        measured = self.rounds[challenger][-1]
        times = self._round
        penalties = []
        for arm in (challenger, self.winner):
            warm = [t for slot, t in times if slot.key == arm and slot.phase == "watch_warmup"]
            if warm and arm in measured:
                penalties.append(max(statistics.fmean(warm) - measured[arm], 0.0))
        penalty = min(penalties, default=0.0)
        winner = max(measured.get(self.winner, self.reference_s), 1e-9)
        warm = [max(t - penalty, 1e-9) for slot, t in times if slot.key == self.winner and slot.phase == "watch_warmup"]
        if warm and not 1.0 / SLOWDOWN <= statistics.fmean(warm) / winner <= SLOWDOWN:
            winner = statistics.fmean([winner, *warm])
        total = 0.0
        for slot, t in times:
            total += t - winner if slot.key == challenger else penalty if slot.phase == "watch_warmup" else 0.0
        return total / winner, winner

    def conclude(self) -> Switch | None:
        """After a round (or a pulse): book its cost, test the challenger, and say whether to switch."""
        if self._winner_samples:
            self.reference_s = max(statistics.median(list(self._winner_samples)[-RECENT_SAMPLES:]), 1e-9)
        if self._current is None:  # a pulse: the winner alone, nothing spent
            self._pulse_s = self._latest_s = self._round[-1][1]
            return None
        challenger = self._challenger()
        self._pulse_s = None
        if len(self.rounds[challenger][-1]) == 2 and challenger not in self.conditional:
            self._latest_s = min(self.rounds[challenger][-1].values())  # (the lighter's own pace says nothing)
        # What the round cost beyond as many steps of the winner, measured in the same round (a
        # change of load since the winner's earlier samples must not count as the watch's cost).
        excess, self._winner_then[challenger] = self._excess(challenger)
        if challenger in self.rounds[challenger][-1]:
            self._challenger_last[challenger] = self.rounds[challenger][-1][challenger]
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
        window = self.config.watch_window
        history = self._history.setdefault(challenger, deque(maxlen=MEAN_BLOCKS * window))
        history.extend(rounds)
        comparison = PairedComparison.of([r[challenger] for r in rounds], [r[self.winner] for r in rounds])
        margin = gain_margin(self.config.min_gain)
        if not (all(v < 0.0 for v in comparison.log_ratios) and -comparison.effect > margin):
            # Not faster in every round of the block: a winner that is fast most of the time and
            # many times slower now and then (an OpenMP team preempted in every barrier while the
            # load holds its cores) wins most rounds and loses the run. The mean decides that.
            comparison = PairedComparison.of([r[challenger] for r in history], [r[self.winner] for r in history])
            if not (len(history) >= 2 * window and -comparison.effect > margin
                    and comparison.p_value() <= MEAN_LEVEL):
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
        self._winner_then = {}
        self._challenger_last = {}
        self._history = {}
        # The fastest the winner ran when locked in: a switch under load does not make the load the
        # new normal, or a lighter setting would never get its turn while it lasts.
        self.locked_s = min(self.locked_s, max(statistics.median(comparison.candidate), 1e-9))
        self._winner_samples.clear()
        self._expected = {}
        self._turn = 0
        self._pressed = None
        self.switches += 1
        return Switch(old=old, new=challenger, comparison=comparison)
