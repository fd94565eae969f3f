"""The probing schedule of one tuning session and the lock-in rule; runs on local rank 0 only.

A session spends at most ``config.probe_steps`` training steps:

1. explore: candidates in the order Optuna asks for them (the static plan first). Each gets
   ``warmup_steps`` discarded steps, then ``measure_steps`` measured ones. When every candidate
   fits the budget the order comes from a seeded brute-force (grid) sampler and every candidate
   is measured; otherwise from a seeded TPE sampler, for as many candidates as fit.
2. finals: the static plan and the best ``finalists - 1`` others are measured again, round-robin:
   ``final_rounds`` rounds, each visit one warm-up step (the first step after a switch is slower,
   so it is discarded as in exploring) and one measured step. Interleaving spreads slow drifts of
   the machine over every finalist instead of favouring whoever was measured last.
3. decide (see :func:`choose`) on all samples of each finalist.

The schedule is planned up front from the worst case, so the budget is never exceeded; a guard
decides early if it ever would be.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Literal

from autotune._measurement import Measurement, gain_threshold, significantly_faster
from autotune._space import Scalar, SearchSpace

if TYPE_CHECKING:
    from autotune._tuner import AutotuneConfig

logger = logging.getLogger("autotune._tuner")

__all__ = ["BudgetPlan", "CheckSession", "ProbeSession", "Slot", "choose", "plan_budget"]

Key = tuple[Scalar, ...]
Phase = Literal["warmup", "measure", "final_warmup", "final", "check_warmup", "check"]

#: Times the sampler may propose already-measured candidates before the session picks the next
#: unmeasured one itself (categorical TPE repeats itself on small spaces).
MAX_REPEATED_ASKS = 32


@dataclass(frozen=True, slots=True)
class Slot:
    """What the next training step runs: a candidate and the step's role."""

    key: Key
    phase: Phase


@dataclass(frozen=True, slots=True)
class BudgetPlan:
    """How a session spends its probe budget (worst case ``steps <= probe_steps``)."""

    sampler: Literal["none", "grid", "tpe"]
    explore: int
    """Candidates measured while exploring."""
    finalists: int
    final_rounds: int
    steps: int
    """Worst-case probe steps of the session."""


def _final_cost(n: int, config: AutotuneConfig, rounds: int) -> int:
    return min(config.finalists, n) * rounds * (config.warmup_steps + 1) if n >= 2 else 0


def plan_budget(n_candidates: int, config: AutotuneConfig) -> BudgetPlan:
    """Grid when ``n * (warmup + k) + finals`` fits ``probe_steps``, else TPE over as many as fit."""
    per = config.warmup_steps + config.measure_steps
    if n_candidates <= 1:
        return BudgetPlan("none", n_candidates, 0, 0, 0)
    rounds = config.final_rounds if config.finalists >= 2 else 0
    grid_cost = n_candidates * per + _final_cost(n_candidates, config, rounds)
    if grid_cost <= config.probe_steps:
        return BudgetPlan("grid", n_candidates, min(config.finalists, n_candidates) if rounds else 0, rounds, grid_cost)
    for rounds_try in (rounds, 0):
        n = n_candidates - 1
        while n >= 2 and n * per + _final_cost(n, config, rounds_try) > config.probe_steps:
            n -= 1
        if n >= 2:
            finals = min(config.finalists, n) if rounds_try else 0
            return BudgetPlan("tpe", n, finals, rounds_try, n * per + _final_cost(n, config, rounds_try))
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


class _OptunaOrder:
    """Candidate order from an Optuna study driven by ask/tell; the static plan is enqueued first."""

    def __init__(self, space: SearchSpace, baseline: Key, plan: BudgetPlan, seed: int) -> None:
        self._space = space
        with _quiet_optuna() as optuna:
            if plan.sampler == "grid":
                sampler = optuna.samplers.BruteForceSampler(seed=seed)
            else:
                # A third of the trials explore at random before TPE models them (at least 3).
                sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(3, plan.explore // 3))
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
            for _ in range(MAX_REPEATED_ASKS):
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


def choose(
    space: SearchSpace, baseline: Key, measurements: dict[Key, Measurement], config: AutotuneConfig
) -> tuple[Key, str]:
    """The lock-in rule. Returns ``(winner, reason)``.

    The fastest median wins, candidates within ``tie_tolerance`` of it count as tied and the
    space's preference breaks the tie (fewer threads, then larger chunks). The static plan stays
    if it is among the tied, or unless the winner beats it by more than
    ``max(min_gain * median_plan, noise_factor * max(IQR_plan, IQR_winner))``.
    """
    best = min(m.median for m in measurements.values())
    tied = [k for k, m in measurements.items() if m.median <= best * (1.0 + config.tie_tolerance)]
    if baseline in tied:
        return baseline, "the static plan is as fast as the fastest candidate"
    winner = min(tied, key=lambda k: space.preference(space.setting(k)))
    base, win = measurements[baseline], measurements[winner]
    threshold = gain_threshold(base, win, min_gain=config.min_gain, noise_factor=config.noise_factor)
    gain = base.median - win.median
    if significantly_faster(win, base, min_gain=config.min_gain, noise_factor=config.noise_factor):
        speedup = base.median / win.median
        return winner, f"{speedup:.3f}x faster than the static plan (gain {gain:.3g} s > {threshold:.3g} s)"
    return baseline, (
        f"best candidate {space.describe(space.setting(winner))} is not clearly faster than the static plan "
        f"(gain {gain:.3g} s <= threshold {threshold:.3g} s)"
    )


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
        self.samples: dict[Key, list[float]] = {}
        self.explored: dict[Key, float] = {}
        self.finalists: list[Key] = []
        self.winner: Key | None = None
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
        if slot.phase in ("measure", "final"):
            self.samples[slot.key].append(node_time)
        if slot.phase == "measure" and (not self._queue or self._queue[0].key != slot.key):
            self._finish_candidate(slot.key)
        self.slot = self._next()
        if self.slot is not None and self.steps >= self.config.probe_steps:
            logger.warning(
                "%s: probe budget of %d steps reached early; deciding now", self.owner, self.config.probe_steps
            )
            self._decide()
            self.slot = None
        return self.slot

    def _finish_candidate(self, key: Key) -> None:
        measurement = self.measurement(key)
        self.explored[key] = measurement.median
        if self._order is not None:
            self._order.tell(key, measurement.median, measured=len(self.explored))
        logger.info(
            "%s: candidate %d of %d: %s", self.owner, len(self.explored), self.plan.explore, measurement
        )

    def _next(self) -> Slot | None:
        if self._queue:
            return self._queue.popleft()
        if self._phase == "explore":
            if len(self.explored) < self.plan.explore and self._order is not None:
                key = self._order.ask(self.explored)
                if key is not None:
                    self._queue_candidate(key)
                    return self._queue.popleft()
            self._phase = "finals"
            if self.plan.final_rounds and len(self.explored) >= 2:
                self._queue_finals()
                return self._queue.popleft()
        self._decide()
        return None

    def _queue_finals(self) -> None:
        others = sorted(
            (k for k in self.explored if k != self.baseline),
            key=lambda k: (self.explored[k], self.space.preference(self.space.setting(k))),
        )
        self.finalists = [self.baseline] + others[: max(0, self.plan.finalists - 1)]
        logger.info(
            "%s: finals: %d candidates re-measured interleaved, %d round(s)",
            self.owner,
            len(self.finalists),
            self.plan.final_rounds,
        )
        for _ in range(self.plan.final_rounds):
            for key in self.finalists:
                self._queue.extend([Slot(key, "final_warmup")] * self.config.warmup_steps)
                self._queue.append(Slot(key, "final"))

    def _decide(self) -> None:
        pool = self.finalists or [k for k in self.samples if self.samples[k]]
        measurements = {k: self.measurement(k) for k in pool if self.samples[k]}
        if self.baseline not in measurements:
            self.winner, self.reason = self.baseline, "the static plan was not measured"
            return
        self.winner, self.reason = choose(self.space, self.baseline, measurements, self.config)

    def measurements(self) -> list[tuple[Key, Measurement]]:
        """Every measured candidate, in the order it was first probed."""
        return [(k, self.measurement(k)) for k in self.samples if self.samples[k]]


class CheckSession:
    """Re-check of a cached choice: warm-up steps, then ``measure_steps`` measured ones."""

    def __init__(self, key: Key, recorded_median_s: float, config: AutotuneConfig) -> None:
        self.key = key
        self.recorded_median_s = recorded_median_s
        self.config = config
        self.samples: list[float] = []
        self._queue = deque(
            [Slot(key, "check_warmup")] * config.warmup_steps + [Slot(key, "check")] * config.measure_steps
        )
        self.slot: Slot | None = self._queue.popleft()

    def record(self, node_time: float) -> Slot | None:
        if self.slot is None:
            raise RuntimeError("the cache re-check has already finished")
        if self.slot.phase == "check":
            self.samples.append(node_time)
        self.slot = self._queue.popleft() if self._queue else None
        return self.slot

    def measurement(self) -> Measurement:
        return Measurement(tuple(self.samples), "re-check")

    def clearly_slower(self) -> bool:
        """True if the re-check median exceeds the recorded one by more than ``recheck_tolerance``
        and by more than the noise."""
        m = self.measurement()
        excess = m.median - self.recorded_median_s
        beyond_tolerance = excess > self.config.recheck_tolerance * self.recorded_median_s
        return beyond_tolerance and excess > self.config.noise_factor * m.iqr


def finite_positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
