"""The online tuner: probes candidates during real training steps, agrees across local ranks,
locks in the fastest setting and remembers it in a cache.

One *step* is one :meth:`OnlineTuner.observe` call. The tuner never repeats or skips a step and
never touches the math: it only calls ``apply(setting)`` between steps, at the same step on every
local rank. Local rank 0 runs the schedule (:mod:`autotune.tuner._schedule`: the probing session of
:mod:`autotune.decide._probe` or the re-check of :mod:`autotune.decide._check`) and broadcasts each next
setting with the step index as a :class:`~autotune.decide._records.Directive`; every rank follows it.

Per step while probing (or re-checking a cached choice) the tuner runs two small collectives on
its gloo group: an all-gather of ``(step, time_s, stages, spans)`` (the node time of a step is the
maximum over local ranks; rank 0 also writes the per-rank stages to the trace) and a broadcast of
the next setting. After lock-in it runs none, except during the watch's rounds
(:mod:`autotune.decide._watch`): four steps now and then, each with the same two collectives. Every
rank learns when the next round starts, and what its first step runs, from the directive that
ended the previous one, so a locked step between rounds only counts.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import time
import weakref
from typing import Any, Callable, Mapping, Protocol

from autotune import knobs
from autotune.agree._agree import Agreement, AgreementError, AgreementMismatch, make_agreement
from autotune._config import AutotuneConfig, StepSample
from autotune.decide._records import NO_DECISION, Decision, Directive, TunerState, lock_in_table
from autotune.tuner._schedule import CacheLike, FingerprintLike, Schedule
from autotune.measure._space import SearchSpace, Setting

logger = logging.getLogger(__name__)

__all__ = ["OnlineTuner", "TraceLike"]

OWNER = "OnlineTuner"


class TraceLike(Protocol):
    def add_step(self, row: dict[str, Any]) -> None: ...

    def add_spans(self, rank: int, step: int, spans: Any) -> None: ...

    def write_summary(self, summary: dict[str, Any]) -> None: ...


def _default_fingerprint(**kwargs: Any) -> FingerprintLike:
    from autotune.cache._fingerprint import fingerprint

    return fingerprint(**kwargs)


def _warn_at_exit(ref: weakref.ReferenceType[OnlineTuner]) -> Callable[[], None]:
    """The interpreter-exit hook of a tuner started on local rank 0: the unfinished-tuning warning
    of :meth:`OnlineTuner.close` for a script that ends without calling it."""

    def hook() -> None:
        tuner = ref()
        if tuner is not None and not tuner._closed and tuner._state in ("probing", "checking"):
            logger.warning("%s (at exit, without close())", tuner._unfinished())

    return hook


class OnlineTuner:
    """Probes the candidates of ``space`` during real training steps and locks in the fastest.

    ``baseline`` is the static plan (a member of ``space``): probed first, and kept unless a
    candidate is clearly faster. ``apply(setting)`` receives a plain dict; it is called between
    steps, at the same step on every local rank, only when the setting changes (and once by
    :meth:`start`). ``group``: None makes a gloo group of this node's ranks when
    ``torch.distributed`` is initialised (every rank must then call :meth:`start` together),
    else runs single-process; an ``Agreement`` or gloo ``ProcessGroup`` may be passed instead.
    ``cache`` and ``trace`` are used by local rank 0 only (other ranks may pass None); the cache
    key is ``fingerprint(workload=, space=, local_world_size=)`` (default
    :func:`autotune.cache._fingerprint.fingerprint`). ``clock`` times the tuner's own overhead.

    Collectives: ``start()`` creates the group, checks that every local rank tunes the same
    space, static plan and config, and broadcasts rank 0's cache decision. Each probing or
    re-check step runs two, and so does each step of a watch round (:mod:`autotune.decide._watch`); a
    locked step between rounds none.
    """

    def __init__(
        self,
        space: SearchSpace,
        *,
        baseline: Setting,
        apply: Callable[[dict[str, Any]], None],
        config: AutotuneConfig | None = None,
        workload: Mapping[str, Any] | None = None,
        group: Any = None,
        clock: Callable[[], float] = time.monotonic,
        cache: CacheLike | None = None,
        trace: TraceLike | None = None,
        fingerprint: Callable[..., FingerprintLike] | None = None,
    ) -> None:
        if not isinstance(space, SearchSpace):
            raise ValueError(f"{OWNER}: space={space!r}: expected a SearchSpace")
        reason = space.why_not(baseline)
        if reason is not None:
            raise ValueError(f"{OWNER}: baseline is not in the search space: {reason}")
        if not callable(apply):
            raise ValueError(f"{OWNER}: apply={apply!r}: expected a callable taking a setting dict")
        config = AutotuneConfig() if config is None else config
        if not isinstance(config, AutotuneConfig):
            raise ValueError(f"{OWNER}: config={config!r}: expected an AutotuneConfig")
        self.space = space
        self.baseline = space.check(baseline)
        self.config = config
        self.workload = dict(workload or {})
        self._apply_fn = apply
        self._group = group
        self._clock = clock
        self._cache = cache
        self._trace = trace
        self._fingerprint_fn = fingerprint or _default_fingerprint
        self._agree: Agreement | None = None
        self._state: TunerState = "new"
        self._phase = ""
        self._current: dict[str, Any] = {}
        self._steps = 0
        self._probe_steps = 0
        self._check_steps = 0
        self._cache_status = "disabled"
        self._cache_key: str | None = None
        self._decision: Decision | None = None
        self._collect_spans = False
        self._schedule: Schedule | None = None  # local rank 0 only
        self._watch_next: Directive | None = None  # the directive that announced the next watch round
        self._watch_steps = 0
        self._switches = 0
        self._overhead_s = 0.0
        self._error: BaseException | None = None
        self._closed = False
        self._at_exit: Callable[[], None] | None = None

    # -- public API -----------------------------------------------------------------------------

    @property
    def state(self) -> TunerState:
        return self._state

    @property
    def current(self) -> dict[str, Any]:
        """The setting in effect for the next step (a copy)."""
        return dict(self._current)

    @property
    def measuring(self) -> bool:
        """Whether the next :meth:`observe` uses the step's time (probing, re-checking, or a watch
        round); when False a client may pass ``None`` instead of reading its clocks."""
        return self._state in ("probing", "checking") or self._phase.startswith("watch")

    @property
    def rank(self) -> int:
        return self._agree.rank if self._agree is not None else 0

    def start(self) -> None:
        """Agree with the other local ranks, look up the cache (rank 0) and apply the first setting."""
        if self._state != "new":
            raise RuntimeError(f"{OWNER}.start() was already called (state {self._state!r})")
        began = self._clock()
        try:
            self._agree = make_agreement(self._group, timeout_s=self.config.timeout_s, owner=OWNER)
            self._check_ranks_agree()
            if self._agree.rank == 0:
                self._schedule = Schedule(
                    self.space, self.baseline, self.config, workload=self.workload,
                    world_size=self._agree.world_size, cache=self._cache, fingerprint=self._fingerprint_fn,
                    collect_spans=self._trace is not None, owner=OWNER,
                )
            directive = self._schedule.first() if self._schedule is not None else None
            directive = self._agree.broadcast(directive, step=None, what="broadcast of the cache decision")
            self._follow(directive, step=None)
            if self._agree.rank == 0 and self._state in ("probing", "checking"):
                # Most scripts never call close(): a run that ends before tuning finished says so
                # at exit all the same (the hook holds the tuner weakly and goes with close()).
                self._at_exit = _warn_at_exit(weakref.ref(self))
                atexit.register(self._at_exit)
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._overhead_s += self._clock() - began

    def observe(self, sample: StepSample | None) -> None:
        """Record one finished training step; may apply the next setting before returning.

        ``sample`` may be None when :attr:`measuring` is False (a locked step between watch
        rounds: only counted)."""
        if self._state == "new":
            raise RuntimeError(f"{OWNER}.observe() called before start()")
        if self._state == "failed":
            raise RuntimeError(f"{OWNER} failed earlier and cannot continue: {self._error}") from self._error
        measuring = self.measuring
        if not isinstance(sample, StepSample) and not (sample is None and not measuring):
            raise ValueError(f"{OWNER}.observe({sample!r}): expected a StepSample"
                             + (" (None only between watch rounds: see OnlineTuner.measuring)" if sample is None else ""))
        step = self._steps
        self._steps += 1
        if not measuring:
            self._maybe_start_watch(step)  # locked: no clock, no collective
            return
        assert sample is not None
        began = self._clock()
        try:
            self._observe_active(step, sample)
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._overhead_s += self._clock() - began

    def summary(self) -> dict[str, Any]:
        """State and decision; the same on every local rank (except ``rank`` and ``overhead_s``).

        ``cache_status``: ``"disabled"`` (no cache), ``"skipped"`` (one candidate: nothing to
        tune), ``"miss"``, ``"forced"`` (``force_retune``), ``"invalid"`` (a bad entry, re-tuned),
        ``"hit"`` (cached choice confirmed by its re-check) or ``"stale"`` (hit, but clearly
        slower than recorded on its re-check, so re-tuned). ``probe_steps`` counts every probing
        step of the run (each session spends at most ``config.probe_steps``); ``check_steps`` the
        steps that re-checked a cached choice. ``winner``/``reason``/``measurements`` describe the
        latest decision (None before the first lock-in). ``probe_cost_s``: the seconds the
        deciding session's probe steps (warm-ups included) took beyond as many steps at the
        winner's median, summed unclipped and floored at 0 (:func:`autotune.measure._measurement.probe_cost_s`);
        ``probe_cost_pct_of_1000_steps``: that as a percentage of 1000 steps at the winner's
        median. Both are 0 on a cache hit (re-check steps are not probing) or with one candidate.
        """
        decision = self._decision.summary_fields() if self._decision is not None else NO_DECISION
        return {
            "state": self._state,
            "cache_hit": self._cache_status in ("hit", "stale"),
            "cache_status": self._cache_status,
            "cache_key": self._cache_key,
            "probe_steps": self._probe_steps,
            "check_steps": self._check_steps,
            "probe_budget": self.config.probe_steps,
            "sampler": decision["sampler"],
            "n_candidates": len(self.space),
            "baseline": dict(self.baseline),
            "current": dict(self._current),
            "winner": decision["winner"],
            "speedup": decision["speedup"],
            "baseline_median_s": decision["baseline_median_s"],
            "winner_median_s": decision["winner_median_s"],
            "kept_baseline": decision["kept_baseline"],
            "reason": decision["reason"],
            "measurements": list(decision["measurements"]),
            "finalists": list(decision["finalists"]),
            "paired": list(decision["paired"]),
            "runner_up": decision["runner_up"],
            "probe_cost_s": decision["probe_cost_s"],
            "probe_cost_pct_of_1000_steps": decision["probe_cost_pct_of_1000_steps"],
            "steps": self._steps,
            "watch_steps": self._watch_steps,
            "switches": self._switches,
            "rank": self.rank,
            "local_world_size": self._agree.world_size if self._agree is not None else 1,
            "overhead_s": self._overhead_s,
        }

    def close(self) -> None:
        """Release the agreement's side channel. The tuner cannot be used afterwards.

        Closing while still probing or re-checking logs a warning on rank 0 saying how many steps
        tuning needs: nothing was locked in or cached, so the next run would start over. A script
        that never calls ``close()`` gets the same warning when the interpreter exits.
        """
        if self._state in ("probing", "checking") and self.rank == 0 and not self._closed:
            logger.warning("%s", self._unfinished())
        self._closed = True
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        if self._agree is not None:
            self._agree.close()

    def _unfinished(self) -> str:
        schedule = self._schedule
        if self._state == "checking" and schedule is not None and schedule.check is not None:
            return (
                f"{OWNER}: closed after {self._steps} step(s) while re-checking the cached choice "
                f"({self._check_steps} check step(s) so far): nothing was confirmed; the next run "
                "re-checks it again"
            )
        session = schedule.session if schedule is not None else None
        planned = session.plan.steps if session is not None else self.config.probe_steps
        done = session.steps if session is not None else self._probe_steps
        # The session began after the steps before it (a cache re-check's, a locked stretch's):
        # the advice counts them, or a re-tune after a stale re-check could never finish in time.
        needed = max(self._steps - done, 0) + planned
        before = f", after {self._steps - done} step(s) before this session" if needed > planned else ""
        return (
            f"{OWNER}: closed after {self._steps} step(s) while still probing ({done} of the "
            f"{planned} probe steps it planned, at most {self.config.probe_steps}{before}): nothing "
            f"was locked in or cached, the next run probes again; train for at least {needed} steps "
            "(more if the first steps are slow to settle) to tune"
        )

    # -- start ----------------------------------------------------------------------------------

    def _check_ranks_agree(self) -> None:
        assert self._agree is not None
        mine = {
            "search space": self.space.to_dict(),
            "static plan": self.baseline,
            "AutotuneConfig": dataclasses.asdict(self.config),
        }
        path = getattr(self._cache, "path", None)  # only rank 0's cache is used: say so if they differ
        cache = os.path.realpath(path) if isinstance(path, (str, os.PathLike)) else None
        everyone = self._agree.all_gather({**mine, "cache": cache}, step=None, what="check of the search space")
        caches = {r: ident.get("cache") for r, ident in enumerate(everyone) if ident.get("cache") is not None}
        if len(set(caches.values())) > 1:
            logger.warning(
                "%s: local ranks name different tuning caches (%s): only local rank 0 reads and writes its "
                "cache%s; set %s (or AutotuneConfig.cache_path) to the same file on every rank",
                OWNER, "; ".join(f"local rank {r}: {p}" for r, p in caches.items()),
                f", {caches[0]}" if 0 in caches else "", knobs.CACHE_VAR,
            )
        for label in mine:
            values = [ident[label] for ident in everyone]
            if all(v == values[0] for v in values):
                continue
            if label == "search space":
                shown = [" ".join(f"{k['name']}={k['values']}" for k in v["knobs"]) for v in values]
            elif label == "AutotuneConfig":
                differing = sorted(k for k in values[0] if any(v.get(k) != values[0][k] for v in values))
                shown = [", ".join(f"{k}={v.get(k)!r}" for k in differing) for v in values]
            else:
                shown = [str(v) for v in values]
            per_rank = "; ".join(f"local rank {r}: {text}" for r, text in enumerate(shown))
            raise AgreementMismatch(
                f"{OWNER}: local ranks disagree on the {label} ({per_rank}). Every local rank must tune "
                f"the same {label}: derive it from values agreed across ranks",
                ranks=range(len(values)),
            )

    # -- every step -----------------------------------------------------------------------------

    def _observe_active(self, step: int, sample: StepSample) -> None:
        assert self._agree is not None
        spans = sample.spans if self._collect_spans else ()
        rows = self._agree.all_gather(
            (step, float(sample.time_s), dict(sample.stages), spans), step=step, what="gather of step times"
        )
        steps = [row[0] for row in rows]
        if any(s != step for s in steps):
            raise AgreementMismatch(
                f"{OWNER}: step {step}: local ranks observed different numbers of steps {steps}: "
                "every rank must call observe() once per training step",
                step=step,
                ranks=[r for r, s in enumerate(steps) if s != step],
            )
        node_time = max(row[1] for row in rows)
        ran_state, ran_phase, ran_setting = self._state, self._phase, dict(self._current)
        if self._state == "probing":
            self._probe_steps += 1
        elif self._state == "checking":
            self._check_steps += 1
        else:
            self._watch_steps += 1
        schedule = self._schedule
        directive = schedule.advance(step, node_time, ran_state) if schedule is not None else None
        if self._agree.rank == 0 and self._trace is not None:
            try:
                self._trace_step(step, ran_state, ran_phase, ran_setting, node_time, rows, directive)
            except Exception as exc:  # a trace must never stop training
                logger.warning("%s: trace disabled: add_step/add_spans failed (%s)", OWNER, exc)
                self._trace = None
        directive = self._agree.broadcast(directive, step=step, what="broadcast of the next setting")
        if directive.step != step:
            raise AgreementMismatch(
                f"{OWNER}: step {step}: local rank 0 sent the setting for step {directive.step}",
                step=step,
                ranks=(0,),
            )
        self._follow(directive, step=step)

    def _maybe_start_watch(self, step: int) -> None:
        """Every rank: when the step after ``step`` starts a watch round, apply its first setting."""
        announced = self._watch_next
        if announced is None or announced.watch_at != step + 1:
            return
        self._watch_next = None
        setting = announced.watch_setting or self._current
        if setting != self._current:
            logger.debug("%s: rank %d: step %d: watch round: %s", OWNER, self.rank, step, self.space.describe(setting))
            self._apply_fn(dict(setting))
            self._current = dict(setting)
        self._phase = announced.watch_phase

    def _follow(self, directive: Directive, *, step: int | None) -> None:
        """Every rank: apply the directive's setting (if it changed) and adopt its state."""
        setting = directive.setting
        if setting != self._current:
            logger.debug("%s: rank %d: step %s: applying %s", OWNER, self.rank, step, self.space.describe(setting))
            self._apply_fn(dict(setting))
            self._current = dict(setting)
        self._state = directive.state
        self._phase = directive.phase
        if directive.cache_status is not None:
            self._cache_status = directive.cache_status
        if step is None:
            self._collect_spans = directive.collect_spans
            self._cache_key = directive.cache_key
        if directive.decision is not None:
            self._lock(directive.decision, step)
        if directive.state == "locked" and directive.phase == "locked":
            # The next watch round, announced to every rank: it may start with the very next step.
            self._watch_next = directive if directive.watch_at is not None else None
            self._maybe_start_watch(self._steps - 1)

    def _lock(self, decision: Decision, step: int | None) -> None:
        if decision.sampler == "watch":
            self._switches += 1
        self._decision = decision
        logger.debug(
            "%s: rank %d: step %s: locked %s (%s)",
            OWNER,
            self.rank,
            step,
            self.space.describe(decision.winner),
            decision.reason,
        )
        if self.rank == 0:
            logger.info("%s", lock_in_table(decision, self.space, probe_budget=self.config.probe_steps, owner=OWNER))
            if self._trace is not None:
                try:
                    self._trace.write_summary(self.summary())
                except Exception as exc:  # a trace must never stop training
                    logger.warning("%s: trace disabled: write_summary failed (%s)", OWNER, exc)
                    self._trace = None

    # -- trace ----------------------------------------------------------------------------------

    def _trace_step(
        self,
        step: int,
        state: str,
        phase: str,
        setting: dict[str, Any],
        node_time: float,
        rows: list[Any],
        directive: Directive,
    ) -> None:
        assert self._trace is not None
        decision = directive.decision
        number = step + 1  # the trace counts training steps from 1, as the trainer's console does
        row_out: dict[str, Any] = {
            "step": number,
            "phase": phase,
            "state": state,
            "candidate": setting,
            "node_time_s": node_time,
            "ranks": {rank: {"time_s": row[1], **row[2]} for rank, row in enumerate(rows)},
            "next": directive.setting,
            "decision": (
                f"{'switched to' if decision.sampler == 'watch' else 'locked'} {self.space.describe(decision.winner)}"
                if decision else None
            ),
            "clock_s": self._clock(),
        }
        if decision is not None:  # the lock-in row states what probing cost, as summary.json does
            row_out["probe_cost_s"] = decision.probe_cost_s
            row_out["probe_cost_pct_of_1000_steps"] = decision.probe_cost_pct
        self._trace.add_step(row_out)
        for rank, row in enumerate(rows):
            if row[3]:
                self._trace.add_spans(rank, number, row[3])

    def _fail(self, exc: BaseException) -> None:
        self._state = "failed"
        self._error = exc
        if isinstance(exc, AgreementError):
            logger.error("%s: rank %d: %s", OWNER, self.rank, exc)

    def __repr__(self) -> str:
        return f"OnlineTuner(state={self._state!r}, current={self._current!r}, steps={self._steps})"

