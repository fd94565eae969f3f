"""The tuner's messages as typed records: a :class:`Directive` (what local rank 0 broadcasts for
the next step) and a :class:`Decision` (a lock-in), plus the lock-in table that logs a decision.

Both travel through the agreement's object collectives (pickled, as gloo's are), so they hold
plain values only: settings as dicts, measurements as JSON-able dicts. ``OnlineTuner.summary()``
reads a decision through :meth:`Decision.summary_fields`, the one place its summary keys are
spelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

from autotune.measure._measurement import COST_REFERENCE_STEPS, Measurement, format_ms, probe_cost_pct, probe_cost_s
from autotune.measure._paired import PairedComparison
from autotune.measure._space import Scalar, SearchSpace

__all__ = ["NO_DECISION", "Decision", "Directive", "TunerState", "lock_in_table"]

TunerState = Literal["new", "checking", "probing", "locked", "failed"]
Key = tuple[Scalar, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """A lock-in: which setting won, against what, and why. The same on every local rank."""

    winner: dict[str, Any]
    """The setting locked in."""
    baseline: dict[str, Any]
    """The static plan it was compared with."""
    winner_median_s: float | None
    """The winner's median step time (recorded in the cache for a cached choice); None when unmeasured."""
    baseline_median_s: float | None
    """The static plan's median step time (as recorded, for a cached choice); None when unmeasured."""
    reason: str
    """Why the winner won, in words (the statistic that decided)."""
    sampler: str
    """How it was found: ``"grid"``, ``"tpe"``, ``"none"`` (one candidate) or ``"cache"``."""
    session_probe_steps: int
    """Probe steps of the session that decided (0 for a cached or single candidate)."""
    reference_s: float | None
    """The winner's step time at the decision: the watch's unit of cost (None: unmeasured)."""
    finalists: tuple[dict[str, Any], ...] = ()
    """The settings re-measured interleaved in the finals (empty without finals)."""
    measurements: tuple[dict[str, Any], ...] = ()
    """Every measured candidate: ``{"candidate": setting, "samples", "median_s", "iqr_s", "n"}``."""
    probe_cost_s: float | None = None
    """Seconds the session's probe steps took beyond as many steps at the winner's median
    (:func:`autotune.measure._measurement.probe_cost_s`); 0 for a cache hit or one candidate (nothing
    probed), None when the winner is unmeasured."""
    paired: tuple[dict[str, Any], ...] = ()
    """The paired evidence that decided: ``{"candidate", "ratio", "rounds"}`` per arm compared with
    the static plan (ratio: its mean step time over the plan's in the same rounds, below 1 faster)."""
    runner_up: dict[str, Any] | None = None
    """The setting the post-lock watch compares the winner with (None: nothing to compare)."""

    @classmethod
    def of(
        cls,
        space: SearchSpace,
        baseline: dict[str, Any],
        *,
        winner: dict[str, Any],
        winner_median_s: float | None,
        baseline_median_s: float | None,
        reason: str,
        measurements: Sequence[tuple[Key, Measurement]],
        sampler: str,
        steps: int,
        reference_s: float | None,
        probe_cost_s: float | None,
        finalists: Sequence[dict[str, Any]] = (),
        paired: Sequence[tuple[Key, PairedComparison]] = (),
        runner_up: Key | None = None,
    ) -> Decision:
        """A decision with its measurements turned into plain dicts (picklable, JSON-able)."""
        return cls(
            winner=dict(winner),
            baseline=dict(baseline),
            winner_median_s=winner_median_s,
            baseline_median_s=baseline_median_s,
            reason=reason,
            sampler=sampler,
            session_probe_steps=steps,
            reference_s=reference_s,
            finalists=tuple(dict(f) for f in finalists),
            measurements=tuple({"candidate": space.setting(k), **m.to_dict()} for k, m in measurements),
            probe_cost_s=probe_cost_s,
            paired=tuple(
                {"candidate": space.setting(k), "ratio": c.ratio, "rounds": c.n} for k, c in paired
            ),
            runner_up=space.setting(runner_up) if runner_up is not None else None,
        )

    @classmethod
    def measured(
        cls,
        space: SearchSpace,
        baseline: dict[str, Any],
        *,
        winner: Key,
        reason: str,
        measurements: Sequence[tuple[Key, Measurement]],
        sampler: str,
        steps: int,
        finalists: Sequence[dict[str, Any]] = (),
        step_times: Sequence[float] = (),
        paired: Sequence[tuple[Key, PairedComparison]] = (),
        runner_up: Key | None = None,
    ) -> Decision:
        """A decision of a probing session: the medians (and the watch's reference) from its
        measurements, the probing cost from the node times of all its ``step_times``."""
        by_key = dict(measurements)
        win = by_key.get(winner)
        base = by_key.get(space.key(baseline))
        return cls.of(
            space,
            baseline,
            winner=space.setting(winner),
            winner_median_s=win.median if win else None,
            baseline_median_s=base.median if base else None,
            reason=reason,
            measurements=measurements,
            sampler=sampler,
            steps=steps,
            reference_s=win.median if win else None,
            finalists=finalists,
            probe_cost_s=probe_cost_s(step_times, win.median if win else None),
            paired=paired,
            runner_up=runner_up,
        )

    @property
    def kept_baseline(self) -> bool:
        """The static plan stayed."""
        return self.winner == self.baseline

    @property
    def paired_ratio(self) -> float | None:
        """The winner's time / the static plan's, from the paired rounds that decided (None without)."""
        for p in self.paired:
            if p["candidate"] == self.winner and p["ratio"] > 0:
                return float(p["ratio"])
        return None

    @property
    def speedup(self) -> float | None:
        """How much faster than the static plan the winner is: from the paired rounds that decided
        when there are some (1 / :attr:`paired_ratio`), else the static plan's median / the
        winner's (None unless both were measured)."""
        paired = self.paired_ratio
        if paired is not None and self.sampler != "watch":
            return 1.0 / paired
        if self.baseline_median_s and self.winner_median_s:
            return self.baseline_median_s / self.winner_median_s
        return None

    @property
    def probe_cost_pct(self) -> float | None:
        """:attr:`probe_cost_s` as a percentage of 1000 steps at the winner's median."""
        if self.probe_cost_s == 0.0:
            return 0.0  # nothing probed: zero whether or not a median is known
        return probe_cost_pct(self.probe_cost_s, self.winner_median_s)

    def summary_fields(self) -> dict[str, Any]:
        """The decision's keys of ``OnlineTuner.summary()`` (copies)."""
        return {
            "sampler": self.sampler,
            "winner": dict(self.winner),
            "speedup": self.speedup,
            "baseline_median_s": self.baseline_median_s,
            "winner_median_s": self.winner_median_s,
            "kept_baseline": self.kept_baseline,
            "reason": self.reason,
            "measurements": [dict(m) for m in self.measurements],
            "finalists": [dict(f) for f in self.finalists],
            "probe_cost_s": self.probe_cost_s,
            "probe_cost_pct_of_1000_steps": self.probe_cost_pct,
            "paired": [dict(p) for p in self.paired],
            "runner_up": dict(self.runner_up) if self.runner_up is not None else None,
        }

    def cost_text(self) -> str:
        """The probing cost in words, as the lock-in line states it."""
        if self.sampler == "cache":
            return "no probing cost (cache hit: nothing probed)"
        if self.session_probe_steps == 0:
            return "no probing cost (nothing probed)"
        pct = self.probe_cost_pct
        if self.probe_cost_s is None or pct is None:
            return "probing cost unknown (the winner was not measured)"
        return (
            f"probing cost {format_ms(self.probe_cost_s)} beyond the winner's median"
            f" = {pct:.2f}% of {COST_REFERENCE_STEPS} steps at it"
        )


#: ``OnlineTuner.summary()``'s decision keys before the first lock-in.
NO_DECISION: dict[str, Any] = {
    "sampler": None,
    "winner": None,
    "speedup": None,
    "baseline_median_s": None,
    "winner_median_s": None,
    "kept_baseline": None,
    "reason": None,
    "measurements": [],
    "finalists": [],
    "probe_cost_s": None,
    "probe_cost_pct_of_1000_steps": None,
    "paired": [],
    "runner_up": None,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Directive:
    """What local rank 0 broadcasts before a step (or at start): every rank follows it."""

    step: int | None
    """The step just observed (None at start); a rank that observed another one fails."""
    state: TunerState
    """The state every rank adopts."""
    phase: str
    """The role of the next step (``"warmup"``, ``"measure"``, ``"check"``, ..., ``"locked"``)."""
    setting: dict[str, Any]
    """The setting the next step runs (applied only where it changed)."""
    decision: Decision | None = None
    """The lock-in, when this directive locks."""
    cache_status: str | None = None
    """The new cache status (None: unchanged)."""
    collect_spans: bool = False
    """Whether ranks send their spans with their step times (rank 0 has a trace); read at start."""
    cache_key: str | None = None
    """Rank 0's cache key (the fingerprint); read at start."""
    watch_at: int | None = None
    """A locked directive: the index of the step that starts the next watch round (None: none)."""
    watch_phase: str = ""
    """The phase of that step (``"watch_warmup"``, ``"watch"`` or ``"watch_pulse"``)."""
    watch_setting: dict[str, Any] | None = None
    """The setting that step runs."""


def lock_in_table(decision: Decision, space: SearchSpace, *, probe_budget: int, owner: str) -> str:
    """The lock-in line and its table, in ms, with one ratio: ``speedup`` (the medians' ratio,
    the figure summary.json, the cache and ``python -m autotune show`` report). The decision rests
    on paired rounds: the reason states the paired ratio that decided, and the table's "paired"
    column shows each finalist's mean-time ratio to the static plan over its rounds (see
    :mod:`autotune.measure._paired`). The line also states the probing cost (:meth:`Decision.cost_text`)."""
    winner, baseline = decision.winner, decision.baseline
    paired = {space.key(p["candidate"]): p for p in decision.paired}
    if decision.kept_baseline:
        ratio = " (the static plan)"
    elif decision.speedup:
        when = " when recorded" if decision.sampler == "cache" and decision.paired_ratio is None else ""
        how = "paired rounds" if decision.paired_ratio is not None else "medians"
        ratio = f", {decision.speedup:.3f}x faster than the static plan{when} ({how})"
    else:
        ratio = ""
    head = (
        f"{owner}: locked in {space.describe(winner)}{ratio}"
        + f" after {decision.session_probe_steps} probe step(s) of {probe_budget}"
        + f" ({decision.sampler}), {decision.cost_text()}: "
        + decision.reason
    )
    if not decision.measurements:  # "only one candidate", a cache hit: no table, no empty header
        return head
    rows = [head, f"  {'candidate':<44} {'median ms':>10} {'IQR ms':>10} {'n':>4} {'paired ratio/rounds':>20}"]
    for m in sorted(decision.measurements, key=lambda m: m["median_s"]):
        key = space.key(m["candidate"])
        mark = "*" if m["candidate"] == winner else " "
        note = " (static plan)" if m["candidate"] == baseline else ""
        p = paired.get(key)
        shown = f"{p['ratio']:.3f}/{p['rounds']}" if p else ("1 (ref)" if m["candidate"] == baseline and paired else "-")
        rows.append(
            f"{mark} {space.describe(m['candidate']):<44} {m['median_s'] * 1e3:>10.3f}"
            f" {m['iqr_s'] * 1e3:>10.3f} {m['n']:>4} {shown:>20}{note}"
        )
    return "\n".join(rows)
