"""Ground truth and whole-run regret for ``python -m bench.simulate``.

On a quiet node a setting's truth is its noise-free model time. On a contended node
(:mod:`bench.simulate._contention`) a setting's step time depends on the load of the step, so its truth in a
run is its *mean* step time over that run's load trace (``horizon`` steps, the whole run): a run's
time is the sum of its steps, and a setting that is fastest in the quiet spells can lose the run in
the episodes. The per-node tables show the long-run expectation over the load process (each level
weighted by its stationary share) beside the quiet time.

Whole-run regret of a run of ``horizon`` steps = (what its steps cost: the true node time of each
step under its load, a switch's first step ``warmup_penalty`` slower, the probing steps included,
and whatever the tuner ran after its lock-in) / (``horizon`` steps of the best fixed setting under
the same load trace) - 1. The measurement noise is left out of both sides: it is the same for every
setting and would only blur the ratio. "If it stayed" is the same run with the first winner kept
from the lock-in to the end: the difference says what the tuner's steps after lock-in bought.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import Any, Callable, Sequence

import numpy as np

from bench.simulate._contention import load_trace
from bench.simulate._stepmodel import Node

__all__ = ["FOLLOW_TOLERANCE", "NodeTruth", "follow_row", "follow_summary", "trace_means", "whole_run_row",
           "whole_run_summary"]


def _quantile(xs: Sequence[float], q: float) -> float:
    return float(np.quantile(np.asarray(xs, dtype=float), q))


def trace_means(node: Node, settings: Sequence[dict[str, Any]], threads_of: Callable[[dict[str, Any]], list[int]],
                traces: Sequence[np.ndarray]) -> np.ndarray:
    """``[trace, setting]``: each setting's mean noise-free node time over each load trace of a
    contended node (``threads_of(setting)``: each rank's threads)."""
    if node.contention is None:
        raise ValueError(f"trace_means: node {node.name!r} has no load episodes")
    levels = node.contention.levels
    per_level = np.asarray([[node.node_time(threads_of(s), int(s["chunk_numel"]),
                                            bind_numa=bool(s.get("bind_numa", False)), load=lv) for lv in levels]
                            for s in settings])  # [setting, level]
    counts = np.stack([np.bincount(t, minlength=len(levels)) for t in traces])  # [trace, level]
    return counts @ per_level.T / counts.sum(axis=1, keepdims=True)


class NodeTruth:
    """Every candidate's true step time on a node: quiet, per load level, and per run."""

    def __init__(self, node: Node, candidates: Sequence[dict[str, Any]], describe: Callable[[dict[str, Any]], str],
                 threads_of: Callable[[dict[str, Any]], list[int]]) -> None:
        self.node = node
        self.candidates = list(candidates)
        self.keys = [describe(c) for c in self.candidates]
        self._threads_of = threads_of
        levels = node.contention.levels if node.contention is not None else ((),)
        #: [candidate, level] noise-free node times (one level, quiet, on a quiet node).
        self.per_level = np.asarray([
            [node.node_time(threads_of(c), int(c["chunk_numel"]), bind_numa=bool(c.get("bind_numa", False)), load=lv)
             for lv in levels] for c in self.candidates])
        self.quiet = {k: float(t) for k, t in zip(self.keys, self.per_level[:, 0])}
        if node.contention is None:
            self.expected = dict(self.quiet)
        else:
            weights = np.asarray(node.contention.level_weights)
            self.expected = {k: float(t) for k, t in zip(self.keys, self.per_level @ weights)}

    @property
    def contended(self) -> bool:
        return self.node.contention is not None

    def trace(self, seed: int, horizon: int) -> np.ndarray:
        """The load levels of run ``seed`` (all 0 on a quiet node)."""
        if self.node.contention is None:
            return np.zeros(horizon, dtype=np.int64)
        return load_trace(self.node.contention, self.node.name, seed, horizon)

    def of_seed(self, seed: int, horizon: int) -> dict[str, float]:
        """Each candidate's mean step time over run ``seed``'s ``horizon`` steps (quiet node: its time)."""
        if self.node.contention is None:
            return self.quiet
        means = trace_means(self.node, self.candidates, self._threads_of, [self.trace(seed, horizon)])[0]
        return {k: float(t) for k, t in zip(self.keys, means)}

    def cost(self, key: str, levels: np.ndarray) -> float:
        """The true time of ``len(levels)`` steps of candidate ``key`` at those load levels."""
        i = self.keys.index(key)
        counts = np.bincount(levels, minlength=self.per_level.shape[1])
        return float(counts @ self.per_level[i])


def whole_run_row(truth: NodeTruth, row: dict[str, Any], winner: str, seed_truth: dict[str, float],
                  horizon: int) -> dict[str, Any]:
    """The whole-run figures of one session run for ``horizon`` steps (``row["whole_run"]``, from
    ``bench.simulate._session.run_seed(steps=horizon)``); ``winner``: its first lock-in's, described."""
    rec = row["whole_run"]
    costs = rec["costs"]
    if len(costs) != horizon:
        raise RuntimeError(f"whole run of seed {row['seed']}: {len(costs)} steps recorded, expected {horizon}")
    best = horizon * min(seed_truth.values())
    total = float(sum(costs))
    lock = rec["lock_step"]
    # The first locked step runs the winner whatever follows (its warm-up included): kept as paid.
    stay = float(sum(costs[:lock + 1])) + truth.cost(winner, truth.trace(row["seed"], horizon)[lock + 1:])
    states: dict[str, int] = {}
    for s in rec["states"]:
        states[s] = states.get(s, 0) + 1
    return {
        "regret": total / best - 1.0,
        "stay_regret": stay / best - 1.0,
        "run_s": total,
        "best_fixed_s": best,
        "lock_step": lock,
        "steps_by_state": states,
        "switches_after_lock": rec["switches_after_lock"],
        "final": rec["final"],
    }


def whole_run_summary(rows: Sequence[dict[str, Any]], horizon: int, elapsed_s: float) -> dict[str, Any] | None:
    """Median, p95 and max of the whole-run regret over the sessions that ran ``horizon`` steps."""
    if not rows:
        return None
    regrets = [r["regret"] for r in rows]
    stays = [r["stay_regret"] for r in rows]
    state_names = sorted({s for r in rows for s in r["steps_by_state"]})
    return {
        "seeds": len(rows),
        "horizon": horizon,
        "regret": {"median": statistics.median(regrets), "p95": _quantile(regrets, 0.95), "max": max(regrets),
                   "mean": statistics.fmean(regrets)},
        "stay_regret": {"median": statistics.median(stays), "p95": _quantile(stays, 0.95), "max": max(stays)},
        "steps_by_state_median": {s: statistics.median(r["steps_by_state"].get(s, 0) for r in rows)
                                  for s in state_names},
        "switches_after_lock": {"median": statistics.median(r["switches_after_lock"] for r in rows),
                                "max": max(r["switches_after_lock"] for r in rows)},
        "elapsed_s": elapsed_s,
    }


#: A run follows a load change once the setting it runs (outside the watch's rounds) is within this
#: much of the best setting under the new load, and stays there to the end.
FOLLOW_TOLERANCE = 0.05


def follow_row(truth: NodeTruth, rec: dict[str, Any], levels: Sequence[int], change_at: int) -> dict[str, Any]:
    """How one run of :func:`bench.simulate._main.follow_change` followed a change of load at step
    ``change_at`` (``levels``: each step's load level; ``rec``: ``run_seed(steps=...)``'s record).

    The setting the run *follows* at a step is what ran in the latest locked step the tuner did not
    measure (the winner, between the watch's rounds). ``follow_steps``: steps from the change until
    the followed setting is within :data:`FOLLOW_TOLERANCE` of the best under the new load for the
    rest of the run (None: not by the end). ``watch_cost``: what the watch's steps cost beyond the
    followed setting's true time at their load, as a share of every locked step's cost."""
    keys = {k: i for i, k in enumerate(truth.keys)}
    after = truth.per_level[:, levels[change_at]]
    best = float(after.min())
    followed: list[str | None] = []
    current = None
    for state, measured, setting in zip(rec["states"], rec["measuring"], rec["settings"]):
        if state == "locked" and not measured:
            current = setting
        followed.append(current)

    def regret(key: str | None) -> float:
        return math.nan if key is None else float(after[keys[key]]) / best - 1.0

    start = None
    for step in range(len(followed) - 1, change_at - 1, -1):
        if not regret(followed[step]) <= FOLLOW_TOLERANCE:
            break
        start = step
    excess = locked = 0.0
    for step, (state, measured, cost) in enumerate(zip(rec["states"], rec["measuring"], rec["costs"])):
        if state != "locked":
            continue
        locked += cost
        if measured and followed[step] is not None:
            excess += cost - float(truth.per_level[keys[followed[step]], levels[step]])
    return {
        "regret_at_change": regret(followed[change_at]),
        "follow_steps": None if start is None else start - change_at,
        "final": followed[-1],
        "final_regret": regret(followed[-1]),
        "watch_cost": excess / locked if locked else math.nan,
        "switches_after_lock": rec["switches_after_lock"],
    }


def follow_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Over the seeds of one load change: how many followed it, how fast, at what cost."""
    steps = [r["follow_steps"] for r in rows if r["follow_steps"] is not None]
    finals = [r["final_regret"] for r in rows]
    costs = [r["watch_cost"] for r in rows]
    return {
        "seeds": len(rows),
        "followed": len(steps),
        "follow_steps": {"median": statistics.median(steps), "p95": _quantile(steps, 0.95), "max": max(steps)}
        if steps else None,
        "regret_at_change_median": statistics.median(r["regret_at_change"] for r in rows),
        "final_regret": {"median": statistics.median(finals), "p95": _quantile(finals, 0.95), "max": max(finals)},
        "watch_cost": {"median": statistics.median(costs), "max": max(costs)},
        "finals": dict(Counter(str(r["final"]) for r in rows).most_common()),
    }
