"""The probing schedule of one tuning session and the lock-in rule; runs on local rank 0 only.

A session spends at most ``config.probe_steps`` training steps:

1. explore: candidates in the order Optuna asks for them (the static plan first). Each gets
   ``warmup_steps`` discarded steps, then ``measure_steps`` measured ones. When every candidate
   fits the budget the order comes from a seeded brute-force (grid) sampler and every candidate
   is measured. Otherwise the first points are a coordinate sweep from the static plan
   (:func:`sweep_next`: the thread ladder at the static chunk, then the chunk ladder at the best
   thread count so far, ...), each enqueued into the study and decided from the results so far;
   then a seeded multivariate TPE sampler for what budget remains. Beyond the grid a candidate
   whose fastest step is clearly slower than the best so far stops after two measured steps
   (:data:`EARLY_STOP_MARGIN`; three when both may be stalls), which leaves room for more candidates.
2. finals: the static plan and the best ``finalists - 1`` others (by the median of their
   exploring samples, nothing filtered) are measured again in paired rounds
   (:mod:`autotune.measure._paired`): ``final_rounds`` rounds (beyond the grid :data:`TPE_FINAL_ROUNDS`),
   each visiting every finalist once, one warm-up step (the first step after a switch is slower,
   so it is discarded as in exploring) and one measured step per visit, the order reversed every
   other round (A B C, then C B A). A change of load between rounds hits every finalist alike.
   While the fastest finalist is not yet clearly faster than the static plan but still could be,
   and the budget allows, duel rounds of just those two follow (at least
   :data:`~autotune.measure._paired.MIN_DECIDING_ROUNDS` rounds decide anything; beyond the grid the
   budget reserves :data:`DUEL_ROUNDS` of them).
3. decide (see :func:`decide_paired`) on the paired rounds alone: each finalist's mean step time
   over the static plan's in the rounds that measured both, and an exact paired permutation test.
   Exploring samples only pick the finalists; a sample is never judged against its own
   candidate's other samples (issue 36: a setting slow four times in five won on its fifth).

The schedule is planned up front (:func:`plan_budget`), so the budget is never exceeded; a guard
decides early if it ever would be.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Literal

from autotune._config import AutotuneConfig
from autotune.decide._decide import LEAN_ROUNDS, choose, decide_paired, paired_comparisons
from autotune.measure._measurement import OUTLIER_FACTOR, Measurement
from autotune.measure._paired import MIN_DECIDING_ROUNDS, PairedComparison, gain_margin, round_order
from autotune.measure._space import Scalar, SearchSpace

logger = logging.getLogger("autotune.tuner._tuner")

__all__ = ["BudgetPlan", "Key", "Phase", "ProbeSession", "Slot", "plan_budget", "sweep_next"]

Key = tuple[Scalar, ...]
Phase = Literal["warmup", "measure", "final_warmup", "final", "check_warmup", "check", "watch_warmup", "watch", "watch_pulse"]

#: Times the sampler may propose already-measured candidates before the session picks the next
#: unmeasured one itself (categorical TPE repeats itself on small spaces).
MAX_REPEATED_ASKS = 32
#: A candidate whose fastest measured step is this much slower than the best median so far is
#: clearly worse: after ``EARLY_STOP_SAMPLES`` measured steps its remaining ones are skipped and
#: the budget they free goes to further candidates (beyond the grid) or to the finals.
EARLY_STOP_MARGIN = 0.05
#: Measured steps before a candidate may be stopped early. Two, because a stall only ever slows a
#: step: one slow sample may be a hiccup, the faster of two rarely is.
EARLY_STOP_SAMPLES = 2
#: ... unless even the faster of the two is a stall next to the best median so far (beyond
#: :data:`~autotune.measure._measurement.OUTLIER_FACTOR` of it): two stalls in a row look just like a
#: candidate twice as slow, and on a node where one rank's stall stalls the step they are not rare
#: (``python -m bench.simulate``: 15 % of node steps, so 2 % of candidates get two in a row; one
#: such lost candidate locked in a 28 % slower setting). Such a candidate is stopped only after this
#: many samples (three stalls in a row: 0.3 %).
STALL_CONFIRM_SAMPLES = 3
#: Most samples beyond ``measure_steps`` that a candidate whose samples disagree wildly gets
#: while exploring (``ProbeSession._disagrees``), budget permitting: with 5 samples its median
#: survives two stalls, and a setting slow in most of its steps shows it.
EXTRA_SAMPLES = 2
#: Beyond the grid the finals are two paired rounds of the finalists (with exploring's pass, three
#: for every finalist, so the one the duel settles is not picked on two rounds) ...
TPE_FINAL_ROUNDS = 2
#: ... followed by up to this many duel rounds (the fastest finalist against the static plan, see
#: ``ProbeSession._queue_duel``) while the comparison is undecided; the budget reserves them, so
#: that exploring's pass (round 0), one finals round and the duel reach
#: :data:`~autotune.measure._paired.MIN_DECIDING_ROUNDS`. A grid plans its duel rounds the same way.
DUEL_ROUNDS = MIN_DECIDING_ROUNDS - 1 - TPE_FINAL_ROUNDS
#: Paired rounds before a duel may end in the static plan's favour without the plan being clearly
#: faster (budget permitting): as many as a lean needs (:data:`~autotune.decide._decide.LEAN_ROUNDS`).
#: A few rounds of a few milliseconds each can all fall in one lull of a load that comes and goes:
#: on the 2-core VM beside two 2-thread torch loops working in bursts (30-150 ms busy, 10-60 ms
#: idle), 5 of 30 sessions of stock AdamW kept 2 threads on three rounds, 14 steps in 0.1-0.2 s,
#: at 1.7-5.7x the mean step time of 1 thread (``bench.tuner_load --load bursts``).
UNSETTLED_ROUNDS = LEAN_ROUNDS


@dataclass(frozen=True, slots=True)
class Slot:
    """What the next training step runs: a candidate and the step's role."""

    key: Key
    phase: Phase
    round: int = -1
    """The paired round the step belongs to (finals, duel, re-check, watch); -1 outside rounds."""


@dataclass(frozen=True, slots=True)
class BudgetPlan:
    """How a session spends its probe budget (worst case ``steps <= probe_steps``)."""

    sampler: Literal["none", "grid", "tpe"]
    explore: int
    """Candidates measured while exploring (beyond the grid: at least; candidates stopped early
    leave room for more)."""
    finalists: int
    final_rounds: int
    steps: int
    """Probe steps of the session if no candidate stops early and every reserved duel round runs
    (each costs at most ``2 * (warmup_steps + 1)``). Beyond the grid, candidates stopped early let
    more be explored; duel rounds beyond the reserved ones run while the budget allows; always
    within ``probe_steps``."""
    duel_rounds: int = 0
    """Duel rounds reserved after the finals, so that the best finalist and the static plan reach
    :data:`~autotune.measure._paired.MIN_DECIDING_ROUNDS` paired rounds (see :data:`DUEL_ROUNDS`)."""


def _final_cost(n: int, config: AutotuneConfig, rounds: int) -> int:
    return min(config.finalists, n) * rounds * (config.warmup_steps + 1) if n >= 2 else 0


def _duel_cost(config: AutotuneConfig, rounds: int) -> int:
    return rounds * 2 * (config.warmup_steps + 1)


def plan_budget(n_candidates: int, config: AutotuneConfig) -> BudgetPlan:
    """Grid when ``n * (warmup + k) + finals`` fits ``probe_steps``, else sweep + TPE over as many
    as fit next to :data:`TPE_FINAL_ROUNDS` finals round(s) and :data:`DUEL_ROUNDS` duel rounds
    (fewer of those first, then no finals, when the budget is too small for two candidates)."""
    per = config.warmup_steps + config.measure_steps
    if n_candidates <= 1:
        return BudgetPlan("none", n_candidates, 0, 0, 0)
    rounds = config.final_rounds if config.finalists >= 2 else 0
    # Measuring every candidate beats sampling some of them: a grid with fewer final rounds (down
    # to one) is preferred over sweep + TPE when the full finals do not fit. The duel rounds that
    # bring the best finalist and the static plan to MIN_DECIDING_ROUNDS are part of the plan:
    # without them a grid could never decide to leave the static plan.
    for grid_rounds in range(rounds, 0, -1) if rounds else (0,):
        duel = max(0, MIN_DECIDING_ROUNDS - 1 - grid_rounds) if grid_rounds else 0
        grid_cost = n_candidates * per + _final_cost(n_candidates, config, grid_rounds) + _duel_cost(config, duel)
        if grid_cost <= config.probe_steps:
            finals = min(config.finalists, n_candidates) if grid_rounds else 0
            return BudgetPlan("grid", n_candidates, finals, grid_rounds, grid_cost, duel)
    options = [(min(rounds, TPE_FINAL_ROUNDS), d) for d in range(DUEL_ROUNDS, -1, -1)] if rounds else []
    for rounds_try, duel in options + [(0, 0)]:
        n = n_candidates - 1
        fixed = _duel_cost(config, duel)
        while n >= 2 and n * per + _final_cost(n, config, rounds_try) + fixed > config.probe_steps:
            n -= 1
        if n >= 2:
            finals = min(config.finalists, n) if rounds_try else 0
            steps = n * per + _final_cost(n, config, rounds_try) + fixed
            return BudgetPlan("tpe", n, finals, rounds_try, steps, duel)
    # AutotuneConfig guarantees probe_steps >= 2 * (warmup + k); keep a safe answer anyway.
    return BudgetPlan("tpe", 2, 0, 0, 2 * per)


@contextlib.contextmanager
def _quiet_optuna() -> Iterator[Any]:
    """Optuna with its INFO logging and experimental warnings silenced, restored afterwards."""
    import optuna

    previous = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(max(previous, optuna.logging.WARNING))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield optuna
    finally:
        optuna.logging.set_verbosity(previous)


def sweep_next(space: SearchSpace, baseline: Key, measured: dict[Key, float]) -> Key | None:
    """The next candidate of a coordinate sweep from ``baseline``, or None when the sweep is done.

    One knob at a time (in the space's order), the other knobs held at the best setting so far:
    walk the knob's ladder from the current value in both directions, one rung at a time, and
    keep walking a direction while each rung is faster than the one before it. The best setting
    of that line becomes the new centre for the next knob. Cycles over the knobs until a whole
    cycle moves nothing and proposes nothing new; then the unmeasured neighbours of the best
    candidates so far, best first (None once every candidate is measured). A knob walks first
    towards its preferred side (fewer threads, larger chunks), and once a direction improved the
    other one is skipped (a unimodal line cannot improve on both sides). Stateless: a function of
    ``measured`` (medians), so the order is deterministic and adapts to the results as they come.
    """
    center = baseline
    for _ in range(len(space) + 1):  # the centre's median strictly falls each cycle: this bounds the loop
        moved = False
        for index, knob in enumerate(space.knobs):
            here = knob.values.index(center[index])
            line = {center}
            for direction in ((-1, 1) if knob.prefer == "low" else (1, -1)):
                previous = measured[center]
                position = here + direction
                while 0 <= position < len(knob.values):
                    key = center[:index] + (knob.values[position],) + center[index + 1:]
                    if key not in measured:
                        return key
                    line.add(key)
                    if measured[key] >= previous:
                        break
                    previous = measured[key]
                    position += direction
                if previous < measured[center]:
                    break  # this direction improved: on a unimodal line the other one cannot
            best = min(line, key=lambda k: (measured[k], space.preference(space.setting(k))))
            if best != center and measured[best] < measured[center]:
                center, moved = best, True
        if not moved:
            break
    # Converged: the unmeasured neighbours (one rung away on one knob) of the best candidates so
    # far, best first; a noisy sample may have hidden a better direction from the sweep.
    for key in sorted(measured, key=lambda k: (measured[k], space.preference(space.setting(k)))):
        for index, knob in enumerate(space.knobs):
            here = knob.values.index(key[index])
            for position in (here - 1, here + 1):
                if 0 <= position < len(knob.values):
                    neighbour = key[:index] + (knob.values[position],) + key[index + 1:]
                    if neighbour not in measured:
                        return neighbour
    return None


class _OptunaOrder:
    """Candidate order from an Optuna study driven by ask/tell; the static plan is enqueued first.

    Grid (every candidate fits the budget): a seeded brute-force sampler. Otherwise the most
    informative points come first: :func:`sweep_next` decides them from the results so far and
    enqueues each into the study, then a seeded multivariate TPE sampler (which has seen every
    sweep result) asks for whatever budget remains.
    """

    def __init__(
        self, space: SearchSpace, baseline: Key, plan: BudgetPlan, seed: int, *,
        max_repeated_asks: int = MAX_REPEATED_ASKS,
    ) -> None:
        self._space = space
        self._max_repeated_asks = max_repeated_asks
        self._baseline = baseline
        self._sweep = plan.sampler == "tpe"
        with _quiet_optuna() as optuna:
            if plan.sampler == "grid":
                sampler = optuna.samplers.BruteForceSampler(seed=seed)
            else:
                sampler = optuna.samplers.TPESampler(
                    seed=seed, n_startup_trials=max(3, plan.explore // 3), multivariate=True
                )
            self._study = optuna.create_study(direction="minimize", sampler=sampler)
            self._study.enqueue_trial(space.setting(baseline))
            self._distributions = {
                knob.name: optuna.distributions.CategoricalDistribution(knob.values) for knob in space.knobs
            }
        self._pending: dict[Key, Any] = {}

    def ask(self, measured: dict[Key, float]) -> Key | None:
        """The next unmeasured candidate, or None when every candidate is measured."""
        if len(measured) >= len(self._space):
            return None
        with _quiet_optuna():
            if self._sweep and self._baseline in measured:
                key = sweep_next(self._space, self._baseline, measured)
                if key is not None:
                    self._study.enqueue_trial(self._space.setting(key))
                    trial = self._study.ask(self._distributions)
                    self._pending[self._space.key(trial.params)] = trial
                    return self._space.key(trial.params)
                self._sweep = False
            for _ in range(self._max_repeated_asks):
                trial = self._study.ask(self._distributions)
                key = self._space.key(trial.params)
                if key in measured:
                    self._study.tell(trial, measured[key])
                else:
                    self._pending[key] = trial
                    return key
            # The sampler keeps repeating itself: take the first unmeasured candidate in space order.
            for candidate in self._space.candidates():
                key = self._space.key(candidate)
                if key not in measured:
                    self._study.enqueue_trial(candidate)
                    self._pending[key] = self._study.ask(self._distributions)
                    return key
        return None

    def tell(self, key: Key, value: float, *, measured: int) -> None:
        """Report ``key``'s median; ``measured`` counts the candidates measured so far."""
        trial = self._pending.pop(key)
        if measured >= len(self._space):
            # Nothing is left to ask for; telling the last trial would make the brute-force
            # sampler call study.stop(), which raises outside optimize().
            return
        with _quiet_optuna():
            self._study.tell(trial, value)


class ProbeSession:
    """One tuning session's schedule. Call :attr:`slot` for the step about to run, then
    :meth:`record` with that step's node time; it returns the next slot, or None once decided."""

    def __init__(
        self, space: SearchSpace, baseline: Key, config: AutotuneConfig, *, owner: str = "OnlineTuner"
    ) -> None:
        self.space = space
        self.baseline = baseline
        self.config = config
        self.owner = owner
        self.plan = plan_budget(len(space), config)
        self.steps = 0
        self.step_times: list[float] = []
        """The node time of every probe step so far, warm-ups included (the probing cost's input)."""
        self.samples: dict[Key, list[float]] = {}
        self.explored: dict[Key, float] = {}
        self.finalists: list[Key] = []
        self.rounds: list[dict[Key, float]] = []
        """The paired rounds (finals and duel): each maps the arms it visited to their measured time."""
        self.winner: Key | None = None
        self._duelist: Key | None = None
        self.runner_up: Key | None = None
        """The best finalist that is not the winner (the static plan if another won): the watch's challenger."""
        self.reason = ""
        self._phase = "explore"
        self._queue: deque[Slot] = deque()
        self._order = _OptunaOrder(space, baseline, self.plan, config.seed) if self.plan.sampler != "none" else None
        first = self._order.ask(self.explored) if self._order is not None else baseline
        if first != baseline:  # Optuna returns the enqueued static plan first; never start elsewhere.
            raise RuntimeError(f"{owner}: the sampler did not start with the static plan")
        self._queue_candidate(baseline)
        self.slot: Slot | None = self._queue.popleft()

    def _queue_candidate(self, key: Key) -> None:
        self._queue.extend([Slot(key, "warmup")] * self.config.warmup_steps)
        self._queue.extend([Slot(key, "measure")] * self.config.measure_steps)
        self.samples.setdefault(key, [])

    def measurement(self, key: Key) -> Measurement:
        return Measurement(tuple(self.samples[key]), self.space.describe(self.space.setting(key)))

    def record(self, node_time: float) -> Slot | None:
        slot = self.slot
        if slot is None:
            raise RuntimeError(f"{self.owner}: the probing session has already decided")
        self.steps += 1
        self.step_times.append(node_time)
        if slot.phase in ("measure", "final"):
            self.samples[slot.key].append(node_time)
        if slot.phase == "final":
            while len(self.rounds) <= slot.round:
                self.rounds.append({})
            self.rounds[slot.round][slot.key] = node_time
        if slot.phase == "measure" and self._clearly_slower(slot.key):
            while self._queue and self._queue[0].key == slot.key:
                self._queue.popleft()
        if slot.phase == "measure" and (not self._queue or self._queue[0].key != slot.key):
            if self._disagrees(slot.key) and self._room_for(1):
                self._queue.appendleft(Slot(slot.key, "measure"))  # one more sample before it is ranked
            else:
                self._finish_candidate(slot.key)
        self.slot = self._next()
        if self.slot is not None and self.steps >= self.config.probe_steps:
            logger.warning(
                "%s: probe budget of %d steps reached early; deciding now", self.owner, self.config.probe_steps
            )
            self._decide()
            self.slot = None
        return self.slot

    def _clearly_slower(self, key: Key) -> bool:
        """True when ``key``'s fastest measured step is beyond :data:`EARLY_STOP_MARGIN` of the best
        median explored so far. Only beyond the grid (a grid measures every candidate fully),
        never for the static plan, nor before :data:`EARLY_STOP_SAMPLES` samples (nor before
        :data:`STALL_CONFIRM_SAMPLES` when even the fastest may be a stall)."""
        samples = self.samples[key]
        if self.plan.sampler != "tpe" or key == self.baseline or len(samples) < EARLY_STOP_SAMPLES:
            return False
        if not self.explored:
            return False
        best = min(self.explored.values())
        fastest = min(samples)
        stopped = fastest > (1.0 + EARLY_STOP_MARGIN) * best
        if stopped and fastest > OUTLIER_FACTOR * best and len(samples) < STALL_CONFIRM_SAMPLES:
            return False  # every sample may be a stall: one more tells (see STALL_CONFIRM_SAMPLES)
        if stopped:
            logger.debug("%s: %s is clearly slower after %d samples; skipping the rest", self.owner,
                         self.space.describe(self.space.setting(key)), len(samples))
        return stopped

    def _disagrees(self, key: Key) -> bool:
        """The candidate's samples disagree wildly: its median is beyond :data:`OUTLIER_FACTOR` of
        its fastest (most of its steps stalled, or its one fast step was luck). It gets more
        samples, up to :data:`EXTRA_SAMPLES` beyond ``measure_steps``, rather than being ranked on
        either story; what it is then is what its median says (never its fastest)."""
        samples = self.samples[key]
        if len(samples) >= self.config.measure_steps + EXTRA_SAMPLES or len(samples) < 2:
            return False
        return Measurement(tuple(samples)).median > OUTLIER_FACTOR * min(samples)

    def _room_for(self, extra: int) -> bool:
        """``extra`` more exploring steps still leave the planned rest of the session in the budget."""
        per = self.config.warmup_steps + self.config.measure_steps
        finals = self.plan.finalists * self.plan.final_rounds * (self.config.warmup_steps + 1)
        duel = _duel_cost(self.config, self.plan.duel_rounds)
        left = max(self.plan.explore - len(self.explored) - 1, 0) if self.plan.sampler == "grid" else 0
        return self.steps + extra + left * per + finals + duel <= self.config.probe_steps

    def _can_explore(self) -> bool:
        """Grid: until every candidate is measured. Beyond it: while one more candidate fits the
        budget next to the planned finals (a candidate stopped early leaves room for another)."""
        if self._order is None:
            return False
        if self.plan.sampler == "grid":
            return len(self.explored) < self.plan.explore
        per = self.config.warmup_steps + self.config.measure_steps
        finals = self.plan.finalists * self.plan.final_rounds * (self.config.warmup_steps + 1)
        duel = _duel_cost(self.config, self.plan.duel_rounds)
        return self.steps + per + finals + duel <= self.config.probe_steps

    def _finish_candidate(self, key: Key) -> None:
        measurement = self.measurement(key)
        self.explored[key] = measurement.median
        if self._order is not None:
            self._order.tell(key, self.explored[key], measured=len(self.explored))
        logger.info(
            "%s: candidate %d of %d: %s", self.owner, len(self.explored), self.plan.explore, measurement
        )

    def _next(self) -> Slot | None:
        if self._queue:
            return self._queue.popleft()
        if self._phase == "explore":
            if self._can_explore():
                assert self._order is not None
                key = self._order.ask(self.explored)
                if key is not None:
                    self._queue_candidate(key)
                    return self._queue.popleft()
            self._phase = "finals"
            if self.plan.final_rounds and len(self.explored) >= 2:
                self._queue_finals()
                return self._queue.popleft()
        if self._phase == "finals" and self.finalists and self._queue_duel():
            return self._queue.popleft()
        self._decide()
        return None

    def _queue_duel(self) -> bool:
        """After the planned finals: while the best finalist is not yet clearly faster than the
        static plan but could still be (:meth:`PairedComparison.could_still_win`), or its rounds
        disagree wildly (one 1.5x faster, another 1.5x slower: on a shared host a load that comes
        and goes in bursts of a few steps), and the budget allows, one more paired round of just
        those two, in the alternating order. False when there is nothing to settle or no budget.
        (On this 2-core VM under two 2-thread torch loops, 4 of 20 sessions of stock AdamW kept the
        static plan, 2.1-5.7x slower than 1 thread, on three rounds of which two fell in a burst
        where the plan's 2 threads ran free.)"""
        if self.steps + _duel_cost(self.config, 1) > self.config.probe_steps or not self.rounds:
            return False
        winner, _, _ = decide_paired(self.space, self.baseline, self.rounds, self.config, final=False)
        if winner != self.baseline:
            return False  # already clearly faster
        comparisons = paired_comparisons(self.rounds, self.baseline)
        wild = math.log(OUTLIER_FACTOR)

        def open_(key: Key) -> bool:
            comparison = comparisons[key]
            if any(v < -wild for v in comparison.log_ratios) and any(v > wild for v in comparison.log_ratios):
                return True  # the rounds disagree wildly (the load changed under them): more rounds
            # Faster in at least half of the rounds: more rounds tell, even where one stalled
            # round has pulled its mean level with the plan's (a stall is not filtered: it is
            # outweighed).
            if comparison.could_still_win(min_gain=self.config.min_gain, noise_factor=self.config.noise_factor):
                return True
            # Faster on the mean by more than min_gain, in fewer than half of the rounds: a plan
            # slightly faster most of the time and many times slower in a burst of load. The mean
            # is what decides (and what a lean needs, LEAN_ROUNDS): more rounds tell. (On the VM
            # beside two 2-thread torch loops in bursts, 2 of 20 sessions of stock AdamW kept 2
            # threads after three rounds in which 1 thread was 0.29x and 0.60x on the mean but
            # faster in only one: 1.6x and 2.8x the best, bench.tuner_load --load bursts.)
            if -comparison.effect > gain_margin(self.config.min_gain):
                return True
            # Nor do a few rounds settle it for a plan that looks faster (see UNSETTLED_ROUNDS):
            # until the plan is clearly faster than the challenger, or a lean has its rounds, more
            # rounds tell. (A challenger faster by less than min_gain costs nothing if it loses.)
            return (comparison.n < UNSETTLED_ROUNDS and comparison.effect > 0.0
                    and not comparison.reversed().clearly_faster(
                        min_gain=self.config.min_gain, noise_factor=self.config.noise_factor))

        # The duel keeps its challenger while it can still win: switching to whichever finalist
        # looks best after each round would leave every one of them short of the rounds a
        # decision needs when the budget ends (on bench.simulate, most kept static plans).
        best = self._duelist if self._duelist in comparisons and open_(self._duelist) else min(
            comparisons,
            key=lambda k: (comparisons[k].effect, self.space.preference(self.space.setting(k))),
            default=None,
        )
        if best is None or not open_(best):
            return False  # as fast as the static plan, or short of the margin beyond any noise: settled
        self._duelist = best
        logger.debug("%s: duel round: %s vs the static plan", self.owner, self.space.describe(self.space.setting(best)))
        self._queue_round([self.baseline, best])
        return True

    def _queue_round(self, arms: list[Key]) -> None:
        """One paired round of ``arms`` in the alternating order; a visit that runs the setting
        already running (the last arm of the round before) needs no warm-up step."""
        index = len(self.rounds)
        self.rounds.append({})
        previous = self._queue[-1].key if self._queue else (self.slot.key if self.slot is not None else None)
        for key in round_order(arms, index):
            if key != previous:
                self._queue.extend([Slot(key, "final_warmup", index)] * self.config.warmup_steps)
            self._queue.append(Slot(key, "final", index))
            previous = key

    def _queue_finals(self) -> None:
        others = sorted(
            (k for k in self.explored if k != self.baseline),
            key=lambda k: (self.explored[k], self.space.preference(self.space.setting(k))),
        )
        chosen = set(others[: max(0, self.plan.finalists - 1)])
        # In the order they were explored (the static plan first): exploring was the first pass
        # over them, so it is round 0, each finalist's time in it the median of its exploring
        # samples; the finals' first round runs them in the reverse order (A B, then B A).
        self.finalists = [self.baseline] + [k for k in self.explored if k in chosen]
        logger.info(
            "%s: finals: %d candidates re-measured in %d paired round(s) after exploring's",
            self.owner,
            len(self.finalists),
            self.plan.final_rounds,
        )
        # Round 0's time of a finalist is the mean of its exploring samples: what its steps cost.
        self.rounds.append({k: Measurement(tuple(self.samples[k])).mean for k in self.finalists})
        for _ in range(self.plan.final_rounds):
            self._queue_round(self.finalists)

    def _decide(self) -> None:
        rounds = [r for r in self.rounds if self.baseline in r and len(r) >= 2]
        if rounds:
            self.winner, self.reason, self.runner_up = decide_paired(self.space, self.baseline, rounds, self.config)
            return
        pool = self.finalists or [k for k in self.samples if self.samples[k]]
        measurements = {k: self.measurement(k) for k in pool if self.samples[k]}
        if self.baseline not in measurements:
            self.winner, self.reason = self.baseline, "the static plan was not measured"
            return
        self.winner, self.reason = choose(self.space, self.baseline, measurements, self.config)
        others = sorted((k for k in measurements if k != self.winner), key=lambda k: measurements[k].median)
        self.runner_up = others[0] if others else None

    def paired(self) -> dict[Key, PairedComparison]:
        """Each finalist's paired comparison with the static plan (empty without rounds)."""
        return paired_comparisons([r for r in self.rounds if len(r) >= 2], self.baseline)

    def measurements(self) -> list[tuple[Key, Measurement]]:
        """Every measured candidate, in the order it was first probed."""
        return [(k, self.measurement(k)) for k in self.samples if self.samples[k]]
