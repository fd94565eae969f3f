"""The online tuner: probes candidates during real training steps, agrees across local ranks,
locks in the fastest setting and remembers it in a cache.

One *step* is one :meth:`OnlineTuner.observe` call. The tuner never repeats or skips a step and
never touches the math: it only calls ``apply(setting)`` between steps, at the same step on every
local rank. Local rank 0 runs the schedule (:mod:`autotune._probe`) and broadcasts each next
setting with the step index; every rank follows it.

Per step while probing (or re-checking a cached choice) the tuner runs two small collectives on
its gloo group: an all-gather of ``(step, time_s, stages, spans)`` (the node time of a step is the
maximum over local ranks; rank 0 also writes the per-rank stages to the trace) and a broadcast of
the next setting. After lock-in it runs none, except the optional drift watch: one all-reduce of
one float every ``drift_window`` steps.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Protocol

from autotune import knobs
from autotune._agree import Agreement, AgreementError, AgreementMismatch, make_agreement
from autotune._measurement import MIN_GAIN, NOISE_FACTOR, TIE_TOLERANCE, Measurement, format_ms
from autotune._probe import CheckSession, ProbeSession, finite_positive
from autotune._space import SearchSpace, Setting

logger = logging.getLogger(__name__)

__all__ = ["AutotuneConfig", "CacheLike", "FingerprintLike", "OnlineTuner", "StepSample", "TraceLike", "TunerState"]

TunerState = Literal["new", "checking", "probing", "locked", "failed"]
OWNER = "OnlineTuner"


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"AutotuneConfig.{name}={value!r}: expected an int >= {minimum}")


def _check_float(name: str, value: object, minimum: float, *, strict: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum or (strict and value == minimum):
        relation = ">" if strict else ">="
        raise ValueError(f"AutotuneConfig.{name}={value!r}: expected a finite number {relation} {minimum}")


@dataclass(frozen=True, kw_only=True, slots=True)
class AutotuneConfig:
    """How the online tuner probes, decides and watches. Every local rank must use the same one."""

    probe_steps: int = 40
    """Most training steps one tuning session may spend probing (never exceeded)."""
    warmup_steps: int = 1
    """Steps discarded after each switch of setting (the first step after a change is slower)."""
    measure_steps: int = 3
    """Measured steps per candidate while exploring; also the steps of a cache re-check."""
    finalists: int = 3
    """Candidates re-measured interleaved before the decision, the static plan included (< 2: none)."""
    final_rounds: int = 2
    """Round-robin rounds of the finals; each visit is one warm-up and one measured step."""
    min_gain: float = MIN_GAIN
    """Smallest relative gain over the static plan that may replace it."""
    noise_factor: float = NOISE_FACTOR
    """A gain must also exceed this multiple of the standard error of the difference of the two
    medians (winner, static plan), each estimated from its IQR and sample count."""
    tie_tolerance: float = TIE_TOLERANCE
    """Medians within this relative distance of the fastest count as tied (then the preferred knob values win)."""
    seed: int = 0
    """Seed of the Optuna sampler."""
    timeout_s: float = 300.0
    """Timeout of every collective of the tuner; a rank that does not answer in time fails the others."""
    force_retune: bool = False
    """Ignore a cached choice and probe again (the new result replaces the cache entry)."""
    recheck_tolerance: float = 0.2
    """A cached choice whose re-check median exceeds the recorded median by more than this fraction
    (and the noise) is measured next to the static plan for as many steps; it is re-tuned only if
    it is then slower than the static plan by more than ``min_gain``, so a machine that is slower
    for every setting keeps its cached choice."""
    drift_window: int = 0
    """Locked steps per drift check (0: no drift watch). Each check costs one all-reduce of a float."""
    drift_factor: float = 1.25
    """A window is slow when its median (max over ranks) exceeds this multiple of the locked median."""
    drift_patience: int = 2
    """Consecutive slow windows before the drift is reported (and acted on)."""
    drift_reprobe: bool = False
    """Re-probe when drift is reported (else only log it)."""
    max_reprobes: int = 1
    """Most drift-triggered re-probes per run; each spends at most ``probe_steps`` steps."""
    use_cache: bool = True
    """Read and write the tuning cache (clients build a ``TuningCache`` from the two fields below)."""
    cache_path: str | None = None
    """Cache file; None: ``$OFFLOAD_AUTOTUNE_CACHE`` or the user cache directory (``autotune.knobs``)."""
    trace_dir: str | None = None
    """Directory for the trace files (trace.jsonl, trace.csv, trace.chrome.json, summary.json, tuning.png); None: no trace."""

    def __post_init__(self) -> None:
        _check_int("probe_steps", self.probe_steps, 1)
        _check_int("warmup_steps", self.warmup_steps, 0)
        _check_int("measure_steps", self.measure_steps, 1)
        _check_int("finalists", self.finalists, 0)
        _check_int("final_rounds", self.final_rounds, 0)
        _check_float("min_gain", self.min_gain, 0.0)
        _check_float("noise_factor", self.noise_factor, 0.0)
        _check_float("tie_tolerance", self.tie_tolerance, 0.0)
        if self.tie_tolerance >= self.min_gain and self.min_gain > 0:
            raise ValueError(
                f"AutotuneConfig.tie_tolerance={self.tie_tolerance!r}: expected less than min_gain={self.min_gain!r}"
            )
        _check_int("seed", self.seed, 0)
        _check_float("timeout_s", self.timeout_s, 0.0, strict=True)
        _check_float("recheck_tolerance", self.recheck_tolerance, 0.0)
        _check_int("drift_window", self.drift_window, 0)
        _check_float("drift_factor", self.drift_factor, 1.0, strict=True)
        _check_int("drift_patience", self.drift_patience, 1)
        _check_int("max_reprobes", self.max_reprobes, 0)
        for name in ("cache_path", "trace_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"AutotuneConfig.{name}={value!r}: expected None or a non-empty str path")
        for name in ("force_retune", "drift_reprobe", "use_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"AutotuneConfig.{name}={getattr(self, name)!r}: expected a bool")
        minimum = 2 * (self.warmup_steps + self.measure_steps)
        if self.probe_steps < minimum:
            raise ValueError(
                f"AutotuneConfig.probe_steps={self.probe_steps}: expected >= {minimum} "
                f"(two candidates of warmup_steps + measure_steps = {self.warmup_steps} + {self.measure_steps})"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSample:
    """What the client measured for one training step."""

    time_s: float
    """The step's time in seconds (what the tuner minimises)."""
    stages: Mapping[str, float] = field(default_factory=dict)
    """Optional per-stage seconds (``{"step_s": ..., "drain_s": ...}``), written to the trace."""
    spans: tuple[Any, ...] = ()
    """Optional ``(stage, chunk, start_s, end_s)`` tuples for the Chrome trace."""

    def __post_init__(self) -> None:
        t = self.time_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"StepSample.time_s={t!r}: expected a finite number of seconds >= 0")
        if not isinstance(self.stages, Mapping):
            raise ValueError(f"StepSample.stages={self.stages!r}: expected a mapping of stage name to seconds")
        object.__setattr__(self, "spans", tuple(self.spans))


class CacheLike(Protocol):
    def get(self, key: str) -> dict[str, Any] | None: ...

    def put(self, key: str, entry: dict[str, Any]) -> bool | None: ...


class TraceLike(Protocol):
    def add_step(self, row: dict[str, Any]) -> None: ...

    def add_spans(self, rank: int, step: int, spans: Any) -> None: ...

    def write_summary(self, summary: dict[str, Any]) -> None: ...


class FingerprintLike(Protocol):
    key: str
    details: dict[str, Any]


def _default_fingerprint(**kwargs: Any) -> FingerprintLike:
    from autotune._fingerprint import fingerprint

    return fingerprint(**kwargs)


def _validate_cached(entry: object, space: SearchSpace) -> str | None:
    """None if ``entry`` is a usable cache entry for ``space``, else why not."""
    if not isinstance(entry, Mapping):
        return f"the entry is a {type(entry).__name__}, expected a dict"
    reason = space.why_not(entry.get("winner"))
    if reason is not None:
        return f"cached winner: {reason}"
    for name in ("winner_median_s", "baseline_median_s"):
        if not finite_positive(entry.get(name)):
            return f"cached {name}={entry.get(name)!r}: expected a finite number of seconds > 0"
    return None


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
    :func:`autotune._fingerprint.fingerprint`). ``clock`` times the tuner's own overhead.

    Collectives: ``start()`` creates the group, checks that every local rank tunes the same
    space, static plan and config, and broadcasts rank 0's cache decision. Each probing or
    re-check step runs two; a locked step none, or one all-reduce per ``drift_window`` steps with
    the drift watch.
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
        self._baseline_key = space.key(self.baseline)
        self._agree: Agreement | None = None
        self._state: TunerState = "new"
        self._phase = ""
        self._current: dict[str, Any] = {}
        self._steps = 0
        self._probe_steps = 0
        self._check_steps = 0
        self._cache_status = "disabled"
        self._cache_key: str | None = None
        self._fingerprint_details: dict[str, Any] = {}
        self._decision: dict[str, Any] | None = None
        self._collect_spans = False
        self._session: ProbeSession | None = None
        self._check: CheckSession | None = None
        self._cached_entry: Mapping[str, Any] | None = None
        self._window: list[float] = []
        self._drift_reference: float | None = None
        self._slow_windows = 0
        self._drift_events = 0
        self._reprobes = 0
        self._overhead_s = 0.0
        self._error: BaseException | None = None
        self._closed = False

    # -- public API -----------------------------------------------------------------------------

    @property
    def state(self) -> TunerState:
        return self._state

    @property
    def current(self) -> dict[str, Any]:
        """The setting in effect for the next step (a copy)."""
        return dict(self._current)

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
            directive = self._first_directive() if self._agree.rank == 0 else None
            directive = self._agree.broadcast(directive, step=None, what="broadcast of the cache decision")
            self._follow(directive, step=None)
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._overhead_s += self._clock() - began

    def observe(self, sample: StepSample) -> None:
        """Record one finished training step; may apply the next setting before returning."""
        if self._state == "new":
            raise RuntimeError(f"{OWNER}.observe() called before start()")
        if self._state == "failed":
            raise RuntimeError(f"{OWNER} failed earlier and cannot continue: {self._error}") from self._error
        if not isinstance(sample, StepSample):
            raise ValueError(f"{OWNER}.observe({sample!r}): expected a StepSample")
        step = self._steps
        self._steps += 1
        if self._state == "locked" and not self.config.drift_window:
            return  # locked: nothing to do, not even reading the clock
        began = self._clock()
        try:
            if self._state in ("probing", "checking"):
                self._observe_active(step, sample)
            elif self.config.drift_window:
                self._observe_locked(step, sample)
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
        latest decision (None before the first lock-in).
        """
        decision = self._decision or {}
        return {
            "state": self._state,
            "cache_hit": self._cache_status in ("hit", "stale"),
            "cache_status": self._cache_status,
            "cache_key": self._cache_key,
            "probe_steps": self._probe_steps,
            "check_steps": self._check_steps,
            "probe_budget": self.config.probe_steps,
            "sampler": decision.get("sampler"),
            "n_candidates": len(self.space),
            "baseline": dict(self.baseline),
            "current": dict(self._current),
            "winner": decision.get("winner"),
            "speedup": decision.get("speedup"),
            "baseline_median_s": decision.get("baseline_median_s"),
            "winner_median_s": decision.get("winner_median_s"),
            "kept_baseline": decision.get("kept_baseline"),
            "reason": decision.get("reason"),
            "measurements": decision.get("measurements", []),
            "finalists": decision.get("finalists", []),
            "steps": self._steps,
            "drift_events": self._drift_events,
            "reprobes": self._reprobes,
            "rank": self.rank,
            "local_world_size": self._agree.world_size if self._agree is not None else 1,
            "overhead_s": self._overhead_s,
        }

    def close(self) -> None:
        """Release the agreement's side channel. The tuner cannot be used afterwards.

        Closing while still probing or re-checking logs a warning on rank 0 saying how many steps
        tuning needs: nothing was locked in or cached, so the next run would start over.
        """
        if self._state in ("probing", "checking") and self.rank == 0 and not self._closed:
            logger.warning("%s", self._unfinished())
        self._closed = True
        if self._agree is not None:
            self._agree.close()

    def _unfinished(self) -> str:
        if self._state == "checking" and self._check is not None:
            return (
                f"{OWNER}: closed after {self._steps} step(s) while re-checking the cached choice "
                f"({self._check_steps} check step(s) so far): nothing was confirmed; the next run "
                "re-checks it again"
            )
        planned = self._session.plan.steps if self._session is not None else self.config.probe_steps
        done = self._session.steps if self._session is not None else self._probe_steps
        return (
            f"{OWNER}: closed after {self._steps} step(s) while still probing ({done} of the "
            f"{planned} probe steps it planned, at most {self.config.probe_steps}): nothing was "
            f"locked in or cached, the next run probes again; train for at least {planned} steps "
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

    def _first_directive(self) -> dict[str, Any]:
        """Rank 0: the cache decision and the first setting."""
        if len(self.space) == 1:
            decision = self._decision_from_measurements(
                winner=self._baseline_key, reason="only one candidate", measurements=[], sampler="none", steps=0
            )
            return self._directive(None, "locked", "locked", self.baseline, decision=decision, cache_status="skipped")
        status, entry = self._lookup()
        if status == "hit":
            assert entry is not None
            winner = self.space.check(entry["winner"])
            self._cached_entry = entry
            self._check = CheckSession(self.space.key(winner), float(entry["winner_median_s"]), self.config)
            return self._directive(None, "checking", self._check.slot.phase, winner, cache_status=status)
        return self._new_session_directive(None, cache_status=status)

    def _lookup(self) -> tuple[str, Mapping[str, Any] | None]:
        if self._cache is None:
            return "disabled", None
        assert self._agree is not None
        fp = self._fingerprint_fn(workload=self.workload, space=self.space, local_world_size=self._agree.world_size)
        self._cache_key, self._fingerprint_details = fp.key, dict(fp.details)
        if self.config.force_retune:
            logger.info("%s: force_retune: ignoring the cache for key %s", OWNER, fp.key)
            return "forced", None
        try:
            entry = self._cache.get(fp.key)
        except Exception as exc:  # a broken cache must never stop training
            logger.warning("%s: cache lookup for key %s failed (%s); tuning instead", OWNER, fp.key, exc)
            return "miss", None
        if entry is None:
            logger.info("%s: no cached choice for key %s; probing", OWNER, fp.key)
            return "miss", None
        reason = _validate_cached(entry, self.space)
        if reason is not None:
            logger.warning("%s: ignoring the cached choice for key %s: %s; re-tuning", OWNER, fp.key, reason)
            return "invalid", None
        logger.info(
            "%s: cached choice %s for key %s; re-checking it on its first steps",
            OWNER,
            self.space.describe(entry["winner"]),
            fp.key,
        )
        return "hit", entry

    def _new_session_directive(self, step: int | None, *, cache_status: str | None = None) -> dict[str, Any]:
        self._session = ProbeSession(self.space, self._baseline_key, self.config, owner=OWNER)
        plan = self._session.plan
        logger.info(
            "%s: probing %d of %d candidates (%s), %d of at most %d steps: %d warm-up + %d measured each, "
            "%d finalist(s) x %d round(s), up to %d duel round(s)",
            OWNER,
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
        assert self._session.slot is not None
        return self._directive(step, "probing", self._session.slot.phase, self.baseline, cache_status=cache_status)

    def _directive(
        self,
        step: int | None,
        state: TunerState,
        phase: str,
        setting: Mapping[str, Any],
        *,
        decision: dict[str, Any] | None = None,
        cache_status: str | None = None,
    ) -> dict[str, Any]:
        return {
            "step": step,
            "state": state,
            "phase": phase,
            "setting": dict(setting),
            "decision": decision,
            "cache_status": cache_status,
            "collect_spans": self._trace is not None,
            "cache_key": self._cache_key,
        }

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
        else:
            self._check_steps += 1
        directive = self._advance(step, node_time) if self._agree.rank == 0 else None
        if self._agree.rank == 0 and self._trace is not None:
            try:
                self._trace_step(step, ran_state, ran_phase, ran_setting, node_time, rows, directive)
            except Exception as exc:  # a trace must never stop training
                logger.warning("%s: trace disabled: add_step/add_spans failed (%s)", OWNER, exc)
                self._trace = None
        directive = self._agree.broadcast(directive, step=step, what="broadcast of the next setting")
        if directive["step"] != step:
            raise AgreementMismatch(
                f"{OWNER}: step {step}: local rank 0 sent the setting for step {directive['step']}",
                step=step,
                ranks=(0,),
            )
        self._follow(directive, step=step)

    def _advance(self, step: int, node_time: float) -> dict[str, Any]:
        """Rank 0: record the node time of ``step`` and say what the next step runs."""
        if self._state == "probing":
            session = self._session
            assert session is not None
            slot = session.record(node_time)
            if slot is not None:
                return self._directive(step, "probing", slot.phase, self.space.setting(slot.key))
            decision = self._decision_from_session(session)
            self._store(decision, session)
            return self._directive(step, "locked", "locked", decision["winner"], decision=decision)
        check = self._check
        assert check is not None and self._cached_entry is not None
        slot = check.record(node_time)
        if slot is not None:
            return self._directive(step, "checking", slot.phase, self.space.setting(slot.key))
        measured = check.measurement()
        described = self.space.describe(self.space.setting(check.key))
        reason = f"cached choice confirmed ({measured}; recorded median {format_ms(check.recorded_median_s)})"
        measurements = [(check.key, measured)]
        if check.clearly_slower():
            if check.baseline_key is None and check.key != self._baseline_key:
                # Slower than recorded: the choice, or the whole machine? Ask the static plan.
                slot = check.measure_baseline(self._baseline_key)
                return self._directive(step, "checking", slot.phase, self.space.setting(slot.key))
            if check.baseline_key is None or not check.still_ahead_of_baseline():
                logger.warning(
                    "%s: the cached choice %s is clearly slower than recorded (%s vs recorded median %s)%s; "
                    "re-tuning",
                    OWNER,
                    described,
                    measured,
                    format_ms(check.recorded_median_s),
                    "" if check.baseline_key is None else f" and than the static plan ({check.baseline_measurement()})",
                )
                return self._new_session_directive(step, cache_status="stale")
            static = check.baseline_measurement()
            logger.info(
                "%s: the cached choice %s is slower than recorded (%s vs %s) but so is the static plan (%s): "
                "the machine is slower, the choice holds",
                OWNER, described, measured, format_ms(check.recorded_median_s), static,
            )
            reason = (f"cached choice confirmed against the static plan measured next to it ({measured} vs "
                      f"{static}); both slower than recorded (median {format_ms(check.recorded_median_s)})")
            measurements.append((check.baseline_key, static))
        entry = self._cached_entry
        decision = self._decision_record(
            winner=self.space.setting(check.key),
            winner_median_s=float(entry["winner_median_s"]),
            baseline_median_s=float(entry["baseline_median_s"]),
            reason=reason,
            measurements=measurements,
            sampler="cache",
            steps=0,
            reference_s=measured.median,
        )
        return self._directive(step, "locked", "locked", decision["winner"], decision=decision)

    def _observe_locked(self, step: int, sample: StepSample) -> None:
        """Drift watch: one all-reduce of a float every ``drift_window`` steps."""
        assert self._agree is not None and self._decision is not None
        self._window.append(float(sample.time_s))
        if len(self._window) < self.config.drift_window:
            return
        local = statistics.median(self._window)
        self._window.clear()
        node = self._agree.max_float(local, step=step, what="drift check")
        if self._drift_reference is None:
            # Nothing was measured before lock-in (one candidate): the first window is the reference.
            self._drift_reference = node
            return
        reference = self._drift_reference
        self._slow_windows = self._slow_windows + 1 if node > reference * self.config.drift_factor else 0
        if self._slow_windows < self.config.drift_patience:
            return
        self._slow_windows = 0
        self._drift_events += 1
        reprobe = self.config.drift_reprobe and self._reprobes < self.config.max_reprobes and len(self.space) > 1
        if self._agree.rank == 0:
            logger.warning(
                "%s: step %d: locked setting %s runs slower than measured: window median %s vs locked "
                "median %s (x%.2f) for %d windows of %d steps; %s",
                OWNER,
                step,
                self.space.describe(self._current),
                format_ms(node),
                format_ms(reference),
                node / reference if reference > 0 else math.inf,
                self.config.drift_patience,
                self.config.drift_window,
                "re-probing" if reprobe else "keeping it",
            )
        if not reprobe:
            return
        # Every rank saw the same all-reduced value, so every rank starts re-probing at this step.
        self._reprobes += 1
        if self._agree.rank == 0:
            directive = self._new_session_directive(step)
        else:
            phase = "warmup" if self.config.warmup_steps else "measure"
            directive = self._directive(step, "probing", phase, self.baseline)
        self._follow(directive, step=step)

    def _follow(self, directive: Mapping[str, Any], *, step: int | None) -> None:
        """Every rank: apply the directive's setting (if it changed) and adopt its state."""
        setting = directive["setting"]
        if setting != self._current:
            logger.debug("%s: rank %d: step %s: applying %s", OWNER, self.rank, step, self.space.describe(setting))
            self._apply_fn(dict(setting))
            self._current = dict(setting)
        self._state = directive["state"]
        self._phase = directive["phase"]
        if directive.get("cache_status") is not None:
            self._cache_status = directive["cache_status"]
        if step is None:
            self._collect_spans = bool(directive.get("collect_spans"))
            self._cache_key = directive.get("cache_key")
        if directive.get("decision") is not None:
            self._lock(directive["decision"], step)

    def _lock(self, decision: dict[str, Any], step: int | None) -> None:
        self._decision = decision
        self._drift_reference = decision["reference_s"]
        self._window.clear()
        self._slow_windows = 0
        logger.debug(
            "%s: rank %d: step %s: locked %s (%s)",
            OWNER,
            self.rank,
            step,
            self.space.describe(decision["winner"]),
            decision["reason"],
        )
        if self.rank == 0:
            logger.info("%s", self._table(decision))
            if self._trace is not None:
                try:
                    self._trace.write_summary(self.summary())
                except Exception as exc:  # a trace must never stop training
                    logger.warning("%s: trace disabled: write_summary failed (%s)", OWNER, exc)
                    self._trace = None

    # -- decisions, cache and trace -------------------------------------------------------------

    def _decision_from_session(self, session: ProbeSession) -> dict[str, Any]:
        assert session.winner is not None
        return self._decision_from_measurements(
            winner=session.winner,
            reason=session.reason,
            measurements=session.measurements(),
            sampler=session.plan.sampler,
            steps=session.steps,
            finalists=[self.space.setting(k) for k in session.finalists],
        )

    def _decision_from_measurements(
        self,
        *,
        winner: tuple[Any, ...],
        reason: str,
        measurements: list[tuple[tuple[Any, ...], Measurement]],
        sampler: str,
        steps: int,
        finalists: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        by_key = dict(measurements)
        win = by_key.get(winner)
        base = by_key.get(self._baseline_key)
        return self._decision_record(
            winner=self.space.setting(winner),
            winner_median_s=win.median if win else None,
            baseline_median_s=base.median if base else None,
            reason=reason,
            measurements=measurements,
            sampler=sampler,
            steps=steps,
            reference_s=win.median if win else None,
            finalists=finalists,
        )

    def _decision_record(
        self,
        *,
        winner: dict[str, Any],
        winner_median_s: float | None,
        baseline_median_s: float | None,
        reason: str,
        measurements: list[tuple[tuple[Any, ...], Measurement]],
        sampler: str,
        steps: int,
        reference_s: float | None,
        finalists: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Plain (picklable, JSON-able) decision that rank 0 broadcasts and every rank records."""
        speedup = baseline_median_s / winner_median_s if baseline_median_s and winner_median_s else None
        return {
            "winner": dict(winner),
            "baseline": dict(self.baseline),
            "kept_baseline": dict(winner) == self.baseline,
            "winner_median_s": winner_median_s,
            "baseline_median_s": baseline_median_s,
            "speedup": speedup,
            "reason": reason,
            "sampler": sampler,
            "session_probe_steps": steps,
            "reference_s": reference_s,
            "finalists": finalists or [],
            "measurements": [{"candidate": self.space.setting(k), **m.to_dict()} for k, m in measurements],
        }

    def _store(self, decision: dict[str, Any], session: ProbeSession) -> None:
        """Rank 0: write the new choice to the cache (never fatal)."""
        if self._cache is None or self._cache_key is None:
            return
        entry = {
            "winner": decision["winner"],
            "baseline": decision["baseline"],
            "winner_median_s": decision["winner_median_s"],
            "baseline_median_s": decision["baseline_median_s"],
            "measurements": [{"candidate": m["candidate"], "samples": m["samples"]} for m in decision["measurements"]],
            "probe_steps": session.steps,
            "created_unix": time.time(),
            "fingerprint": self._fingerprint_details,
        }
        try:
            self._cache.put(self._cache_key, entry)
        except Exception as exc:  # a broken cache must never stop training
            logger.warning("%s: could not store the choice in the cache (%s)", OWNER, exc)

    def _trace_step(
        self,
        step: int,
        state: str,
        phase: str,
        setting: dict[str, Any],
        node_time: float,
        rows: list[Any],
        directive: Mapping[str, Any],
    ) -> None:
        assert self._trace is not None
        decision = directive.get("decision")
        self._trace.add_step(
            {
                "step": step,
                "phase": phase,
                "state": state,
                "candidate": setting,
                "node_time_s": node_time,
                "ranks": {rank: {"time_s": row[1], **row[2]} for rank, row in enumerate(rows)},
                "next": directive["setting"],
                "decision": f"locked {self.space.describe(decision['winner'])}" if decision else None,
                "clock_s": self._clock(),
            }
        )
        for rank, row in enumerate(rows):
            if row[3]:
                self._trace.add_spans(rank, step, row[3])

    def _table(self, decision: dict[str, Any]) -> str:
        """The lock-in line and its table, in ms, with one ratio: ``speedup`` (the medians' ratio,
        the figure summary.json, the cache and ``python -m autotune show`` report). The lock-in
        rule compares the medians without spikes: the reason states that gain and the table shows
        that statistic ("w/o spikes", and how many samples it kept)."""
        winner, baseline = decision["winner"], decision["baseline"]
        trimmed = {
            self.space.key(m["candidate"]): Measurement(tuple(m["samples"])).without_outliers()
            for m in decision["measurements"]
        }
        if decision["kept_baseline"]:
            ratio = " (the static plan)"
        elif decision["speedup"]:
            when = " when recorded" if decision["sampler"] == "cache" else ""
            ratio = f", {decision['speedup']:.3f}x faster than the static plan{when} (medians)"
        else:
            ratio = ""
        head = (
            f"{OWNER}: locked in {self.space.describe(winner)}{ratio}"
            + f" after {decision['session_probe_steps']} probe step(s) of {self.config.probe_steps}"
            + f" ({decision['sampler']}): "
            + decision["reason"]
        )
        rows = [head, f"  {'candidate':<44} {'median ms':>10} {'w/o spikes':>10} {'IQR ms':>10} {'n':>5}"]
        for m in sorted(decision["measurements"], key=lambda m: m["median_s"]):
            t = trimmed[self.space.key(m["candidate"])]
            mark = "*" if m["candidate"] == winner else " "
            note = " (static plan)" if m["candidate"] == baseline else ""
            kept = f"{t.n}/{m['n']}"
            rows.append(
                f"{mark} {self.space.describe(m['candidate']):<44} {m['median_s'] * 1e3:>10.3f}"
                f" {t.median * 1e3:>10.3f} {m['iqr_s'] * 1e3:>10.3f} {kept:>5}{note}"
            )
        return "\n".join(rows)

    def _fail(self, exc: BaseException) -> None:
        self._state = "failed"
        self._error = exc
        if isinstance(exc, AgreementError):
            logger.error("%s: rank %d: %s", OWNER, self.rank, exc)

    def __repr__(self) -> str:
        return f"OnlineTuner(state={self._state!r}, current={self._current!r}, steps={self._steps})"

