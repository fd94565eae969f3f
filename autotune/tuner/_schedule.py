"""Local rank 0's half of the tuner: the cache lookup, the probing session or the re-check of a
cached choice, the lock-in and the cache write; it says what every next step runs.

:class:`Schedule` turns each step's node time into the next :class:`~autotune.decide._records.Directive`;
``OnlineTuner`` broadcasts it and every rank (rank 0 included) follows it. Only rank 0 builds a
schedule, so the cache and the Optuna sampler live on one rank and cannot disagree.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Mapping, Protocol

from autotune.cache._entry import CacheEntry, CacheEntryError
from autotune.decide._check import CheckSession, CheckVerdict
from autotune._config import AutotuneConfig
from autotune.decide._probe import ProbeSession
from autotune.decide._records import Decision, Directive, TunerState
from autotune.measure._space import SearchSpace
from autotune.decide._watch import Watch

logger = logging.getLogger(__name__)

__all__ = ["CacheLike", "FingerprintLike", "Schedule"]


class CacheLike(Protocol):
    def get(self, key: str) -> dict[str, Any] | None: ...

    def put(self, key: str, entry: dict[str, Any]) -> bool | None: ...


class FingerprintLike(Protocol):
    key: str
    details: dict[str, Any]


class Schedule:
    """Rank 0's schedule: :meth:`first` at start, :meth:`advance` after every probing or
    re-check or watch step, :meth:`new_session` when a re-check finds the cached choice stale."""

    def __init__(
        self,
        space: SearchSpace,
        baseline: dict[str, Any],
        config: AutotuneConfig,
        *,
        workload: Mapping[str, Any],
        world_size: int,
        cache: CacheLike | None,
        fingerprint: Callable[..., FingerprintLike],
        collect_spans: bool,
        owner: str,
    ) -> None:
        self.space = space
        self.baseline = baseline
        self.config = config
        self.workload = workload
        self.world_size = world_size
        self.owner = owner
        self._baseline_key = space.key(baseline)
        self._cache = cache
        self._fingerprint_fn = fingerprint
        self._collect_spans = collect_spans
        self.cache_key: str | None = None
        self.fingerprint_details: dict[str, Any] = {}
        self.session: ProbeSession | None = None
        """The latest probing session (None before the first)."""
        self.check: CheckSession | None = None
        """The re-check of the cached choice (None without a cache hit)."""
        self._cached_entry: CacheEntry | None = None
        self.watch: Watch | None = None
        """The watch over the locked setting (None before lock-in, or without challengers)."""

    def directive(
        self,
        step: int | None,
        state: TunerState,
        phase: str,
        setting: Mapping[str, Any],
        *,
        decision: Decision | None = None,
        cache_status: str | None = None,
    ) -> Directive:
        return Directive(
            step=step,
            state=state,
            phase=phase,
            setting=dict(setting),
            decision=decision,
            cache_status=cache_status,
            collect_spans=self._collect_spans,
            cache_key=self.cache_key,
        )

    def first(self) -> Directive:
        """The cache decision and the first setting."""
        if len(self.space) == 1:
            decision = Decision.measured(
                self.space, self.baseline, winner=self._baseline_key, reason="only one candidate", measurements=[],
                sampler="none", steps=0,
            )
            return self.directive(None, "locked", "locked", self.baseline, decision=decision, cache_status="skipped")
        status, entry = self._lookup()
        if status == "hit":
            assert entry is not None
            winner = self.space.check(entry.winner)
            self._cached_entry = entry
            self.check = CheckSession(self.space.key(winner), self._baseline_key, self.config)
            assert self.check.slot is not None
            return self.directive(None, "checking", self.check.slot.phase, winner, cache_status=status)
        return self.new_session(None, cache_status=status)

    def _lookup(self) -> tuple[str, CacheEntry | None]:
        if self._cache is None:
            return "disabled", None
        owner = self.owner
        fp = self._fingerprint_fn(workload=self.workload, space=self.space, local_world_size=self.world_size)
        self.cache_key, self.fingerprint_details = fp.key, dict(fp.details)
        if self.config.force_retune:
            logger.info("%s: force_retune: ignoring the cache for key %s", owner, fp.key)
            return "forced", None
        try:
            found = self._cache.get(fp.key)
        except Exception as exc:  # a broken cache must never stop training
            logger.warning("%s: cache lookup for key %s failed (%s); tuning instead", owner, fp.key, exc)
            return "miss", None
        if found is None:
            logger.info("%s: no cached choice for key %s; probing", owner, fp.key)
            return "miss", None
        try:
            entry = CacheEntry.from_json(found)
            reason = entry.why_unusable(self.space)
        except CacheEntryError as exc:
            reason = str(exc)
        if reason is not None:
            logger.warning("%s: ignoring the cached choice for key %s: %s; re-tuning", owner, fp.key, reason)
            return "invalid", None
        logger.info(
            "%s: cached choice %s for key %s; re-checking it on its first steps",
            owner,
            self.space.describe(entry.winner),
            fp.key,
        )
        return "hit", entry

    def new_session(self, step: int | None, *, cache_status: str | None = None) -> Directive:
        """Start a probing session (at start, or after a stale re-check)."""
        self.session = ProbeSession(self.space, self._baseline_key, self.config, owner=self.owner)
        plan = self.session.plan
        logger.info(
            "%s: probing %d of %d candidates (%s), %d of at most %d steps: %d warm-up + %d measured each, "
            "%d finalist(s) x %d round(s), up to %d duel round(s)",
            self.owner,
            plan.explore,
            len(self.space),
            plan.sampler,
            plan.steps,
            self.config.probe_steps,
            self.config.warmup_steps,
            self.config.measure_steps,
            plan.finalists,
            plan.final_rounds,
            plan.duel_rounds,
        )
        assert self.session.slot is not None
        return self.directive(step, "probing", self.session.slot.phase, self.baseline, cache_status=cache_status)

    def advance(self, step: int, node_time: float, state: TunerState) -> Directive:
        """Record the node time of ``step`` (run in ``state``) and say what the next step runs."""
        if state == "probing":
            session = self.session
            assert session is not None
            slot = session.record(node_time)
            if slot is not None:
                return self.directive(step, "probing", slot.phase, self.space.setting(slot.key))
            assert session.winner is not None
            decision = Decision.measured(
                self.space,
                self.baseline,
                winner=session.winner,
                reason=session.reason,
                measurements=session.measurements(),
                sampler=session.plan.sampler,
                steps=session.steps,
                finalists=[self.space.setting(k) for k in session.finalists],
                step_times=session.step_times,
                paired=sorted(session.paired().items(), key=lambda kv: kv[1].effect),
                runner_up=session.runner_up,
            )
            self._store(decision)
            return self._locked(step, decision)
        if state == "locked":
            return self._advance_watch(step, node_time)
        check = self.check
        assert check is not None and self._cached_entry is not None
        slot = check.record(node_time)
        if slot is None:
            verdict = check.verdict(described=self.space.describe(self.space.setting(check.key)))
            if verdict.stale:
                logger.warning("%s: %s; re-tuning", self.owner, verdict.reason)
            else:
                logger.info("%s: %s", self.owner, verdict.reason)
            return self._after_check(step, verdict)
        return self.directive(step, "checking", slot.phase, self.space.setting(slot.key))

    def _after_check(self, step: int, verdict: CheckVerdict) -> Directive:
        if verdict.stale:
            return self.new_session(step, cache_status="stale")
        assert self.check is not None and self._cached_entry is not None
        entry = self._cached_entry
        decision = Decision.of(
            self.space,
            self.baseline,
            winner=self.space.setting(self.check.key),
            winner_median_s=float(entry.winner_median_s),
            baseline_median_s=float(entry.baseline_median_s),
            reason=verdict.reason,
            measurements=verdict.measurements,
            sampler="cache",
            steps=0,
            reference_s=verdict.reference_s,
            probe_cost_s=0.0,  # a confirmed cached choice: its re-check steps ran it, nothing was probed
            paired=[(self.check.key, verdict.paired)] if verdict.paired is not None else (),
            runner_up=self._runner_up(entry),
        )
        return self._locked(step, decision)

    def _locked(self, step: int, decision: Decision) -> Directive:
        """The directive that locks ``decision`` in, with the watch's first round when it has one."""
        winner = self.space.key(decision.winner)
        challengers = [self.space.key(decision.runner_up)] if decision.runner_up is not None else []
        challengers.append(self._baseline_key)
        lighter = self.space.lighter(decision.winner)  # what a load that starts mid-run favours
        ratios = {}
        for p in decision.paired:  # each arm's ratio to the static plan: the winner's to a challenger follows
            ratios[self.space.key(p["candidate"])] = float(p["ratio"])
        mine = ratios.get(winner, 1.0)
        expected = {k: r / mine for k, r in ratios.items()} | {self._baseline_key: 1.0 / mine}
        self.watch = Watch(
            winner, challengers, reference_s=decision.reference_s or 0.0, locked_at=step + 1, config=self.config,
            expected_ratios=expected, conditional=[self.space.key(lighter)] if lighter is not None else [],
        ) if decision.reference_s else None
        return self._with_watch(self.directive(step, "locked", "locked", decision.winner, decision=decision), step)

    def _with_watch(self, directive: Directive, step: int) -> Directive:
        start = self.watch.next_start(step) if self.watch is not None else None
        if start is None:
            return directive
        return dataclasses.replace(directive, watch_at=start.step, watch_phase=start.slot.phase,
                                   watch_setting=self.space.setting(start.slot.key))

    def _advance_watch(self, step: int, node_time: float) -> Directive:
        """A watch step's node time in; the next watch step, or the end of the round (maybe a switch)."""
        watch = self.watch
        assert watch is not None
        slot = watch.record(node_time)
        if slot is not None:
            return self.directive(step, "locked", slot.phase, self.space.setting(slot.key))
        switch = watch.conclude()
        decision = None
        if switch is not None:
            old, new = self.space.setting(switch.old), self.space.setting(switch.new)
            reason = (f"watch: {self.space.describe(new)} clearly faster than {self.space.describe(old)} "
                      f"({switch.comparison.describe()}); switched")
            logger.warning("%s: step %d: %s", self.owner, step, reason)
            decision = Decision.of(
                self.space, self.baseline, winner=new, winner_median_s=watch.reference_s * switch.comparison.ratio,
                baseline_median_s=None, reason=reason, measurements=[], sampler="watch", steps=0,
                reference_s=watch.reference_s * switch.comparison.ratio, probe_cost_s=0.0,
                paired=[(switch.new, switch.comparison)], runner_up=switch.old,
            )
            watch.reference_s = max(watch.reference_s * switch.comparison.ratio, 1e-9)
        directive = self.directive(step, "locked", "locked", self.space.setting(watch.winner), decision=decision)
        return self._with_watch(directive, step)

    def _runner_up(self, entry: CacheEntry) -> Any:
        """The watch's challenger for a kept cached choice: the entry's recorded runner-up when it
        is a valid other candidate, else the static plan (None when the choice is the plan and no
        runner-up was recorded)."""
        winner = self.space.key(self.space.check(entry.winner))
        recorded = entry.runner_up
        if recorded is not None and self.space.contains(recorded):
            key = self.space.key(recorded)
            if key != winner:
                return key
        return self._baseline_key if winner != self._baseline_key else None

    def _store(self, decision: Decision) -> None:
        """Write the new choice to the cache (never fatal)."""
        if self._cache is None or self.cache_key is None:
            return
        try:
            entry = CacheEntry(
                winner=decision.winner,
                baseline=decision.baseline,
                winner_median_s=decision.winner_median_s,  # type: ignore[arg-type]  # measured: a float
                baseline_median_s=decision.baseline_median_s,  # type: ignore[arg-type]
                measurements=tuple(decision.measurements),  # to_json keeps what an entry stores of each
                probe_steps=decision.session_probe_steps,
                probe_cost_s=decision.probe_cost_s,
                runner_up=decision.runner_up,
                paired_ratio=decision.paired_ratio if decision.sampler != "watch" else None,
                created_unix=time.time(),
                fingerprint=self.fingerprint_details,
            )
            self._cache.put(self.cache_key, entry.to_json())
        except Exception as exc:  # a broken cache must never stop training
            logger.warning("%s: could not store the choice in the cache (%s)", self.owner, exc)
