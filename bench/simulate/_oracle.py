"""An oracle bound for ``python -m bench.simulate``: how small the regret can be at all, for a
given number of probe steps, under the step-time model's noise.

The oracle is told the node's ``contenders`` truly fastest distinct candidates up front (a real
tuner has to find them first; two candidates that run the same, such as thread counts above a
bound rank's cap, count once) and spends every one of ``steps`` probe steps on them: one warm-up
each, the rest measured. It drops samples above 1.5x each contender's fastest (the tuner's stall rule) and
picks the smallest median, or mean, of what is left. Two ways to share the samples:

* equal shares (``median``, ``mean``);
* the best split (``best_split``): every way to share them out (at least one sample each), the
  one with the fewest seeds above 2 % chosen on the very seeds it is scored on (a hindsight
  choice, so an optimistic floor).

Its regret over many seeds is a floor for any tuner that probes that many steps on that node:
when even the best split's p95 regret is above a target, no schedule and no lock-in rule using
that statistic meets the target within that budget; only more samples, or a quieter machine, can.
:func:`steps_needed` finds the smallest budget at which it would.
"""

from __future__ import annotations

import itertools
import zlib
from typing import Any, Callable, Sequence

import numpy as np

from bench.simulate._stepmodel import Node, NoiseModel

__all__ = ["MAX_STEPS", "ORACLE_CONTENDERS", "ORACLE_SEEDS", "oracle_bound", "steps_needed"]

#: Candidates the oracle is told (the closest ones decide the tail: 2-3 within 3 % of the best).
ORACLE_CONTENDERS = 3
#: Simulated sessions per node; seeded, so the bound is deterministic.
ORACLE_SEEDS = 1000
#: The tuner's stall rule (``autotune.measure._measurement.OUTLIER_FACTOR``).
_OUTLIER_FACTOR = 1.5
#: Steps of every draw (more when a budget asks for more): a contender's first ``n`` samples are
#: then the same whatever the budget, so :func:`oracle_bound` and :func:`steps_needed` agree.
MAX_STEPS = 96
#: Regret above which a seed counts as missing the target (``bench.simulate``'s 2 %).
_TARGET = 0.02
_STATS = {"median": np.nanmedian, "mean": np.nanmean}


class _Draws:
    """Seeded node times of the contenders: ``times[c][seed, i]`` is contender ``c``'s ``i``-th
    measured step, and ``stat(name, c, n)`` the statistic of its first ``n`` steps, stalls dropped."""

    def __init__(self, node: Node, rank_times: Sequence[np.ndarray], noise: NoiseModel, seeds: int,
                 samples: int) -> None:
        rng = np.random.default_rng([seeds, zlib.crc32(node.name.encode())])
        self.times = [np.max(t * noise.factors_array(rng, (seeds, samples), node.ranks), axis=-1) for t in rank_times]
        self._cache: dict[tuple[str, int, int], np.ndarray] = {}

    def stat(self, name: str, contender: int, n: int) -> np.ndarray:
        key = (name, contender, n)
        if key not in self._cache:
            x = self.times[contender][:, :n]
            kept = np.where(x <= _OUTLIER_FACTOR * x.min(axis=1, keepdims=True), x, np.nan)
            self._cache[key] = _STATS[name](kept, axis=1)
        return self._cache[key]


def _regrets(draws: _Draws, name: str, split: Sequence[int], truth: np.ndarray) -> np.ndarray:
    picks = np.argmin(np.stack([draws.stat(name, c, n) for c, n in enumerate(split)]), axis=0)
    return truth[picks] / truth[0] - 1.0


def _summary(regrets: np.ndarray) -> dict[str, float]:
    return {"p95": float(np.quantile(regrets, 0.95)), "above_2pct": float(np.mean(regrets > _TARGET))}


def _contenders(node: Node, candidates: Sequence[dict[str, Any]], threads_of: Callable[[dict[str, Any]], list[int]],
                contenders: int) -> list[tuple[np.ndarray, float]]:
    def times(c: dict[str, Any]) -> np.ndarray:
        return np.asarray(node.rank_times(threads_of(c), int(c["chunk_numel"]),
                                          bind_numa=bool(c.get("bind_numa", False))))

    timed = sorted(((t, float(np.max(t))) for t in map(times, candidates)), key=lambda tt: tt[1])
    distinct: list[tuple[np.ndarray, float]] = []
    for rank_times, node_time in timed:  # one of each effective setting (bound threads above the cap repeat one)
        if not any(np.array_equal(rank_times, kept) for kept, _ in distinct):
            distinct.append((rank_times, node_time))
    return distinct[:contenders]


def _bound(draws: _Draws, truth: np.ndarray, steps: int) -> dict[str, Any]:
    k = len(truth)
    measured = max(k, steps - k)  # one warm-up per contender, at least one sample each
    per = measured // k
    out: dict[str, Any] = {"steps": steps, "contenders": k, "contender_s": [float(t) for t in truth],
                           "samples_each": per}
    for name in _STATS:
        out[name] = _summary(_regrets(draws, name, [per] * k, truth))
    out["best_split"] = {}
    for name in _STATS:
        best: tuple[float, float, tuple[int, ...]] | None = None
        for head in itertools.product(range(1, measured - k + 2), repeat=k - 1):
            split = (*head, measured - sum(head))
            if split[-1] < 1:
                continue
            r = _regrets(draws, name, split, truth)
            score = (float(np.mean(r > _TARGET)), float(np.quantile(r, 0.95)), split)
            best = score if best is None or score[:2] < best[:2] else best
        assert best is not None
        out["best_split"][name] = {"above_2pct": best[0], "p95": best[1], "split": list(best[2])}
    return out


def oracle_bound(
    node: Node, candidates: Sequence[dict[str, Any]], threads_of: Callable[[dict[str, Any]], list[int]], *,
    steps: int, noise: NoiseModel | None = None, seeds: int = ORACLE_SEEDS, contenders: int = ORACLE_CONTENDERS,
) -> dict[str, Any]:
    """The oracle's regret on ``node`` for ``steps`` probe steps: p95 and the share of seeds above
    2 %, picking by median and by mean, with equal shares and with the best split of the samples.
    ``threads_of(candidate)``: each rank's threads for it."""
    timed = _contenders(node, candidates, threads_of, contenders)
    truth = np.asarray([t for _, t in timed])
    draws = _Draws(node, [rt for rt, _ in timed], noise or NoiseModel(), seeds, max(MAX_STEPS, steps))
    out = _bound(draws, truth, steps)
    out["seeds"] = seeds
    return out


def steps_needed(
    node: Node, candidates: Sequence[dict[str, Any]], threads_of: Callable[[dict[str, Any]], list[int]], *,
    statistic: str = "median", noise: NoiseModel | None = None, seeds: int = ORACLE_SEEDS,
    contenders: int = ORACLE_CONTENDERS, start: int = 8, limit: int = MAX_STEPS,
) -> int | None:
    """The fewest probe steps (from ``start``, up to ``limit``) at which the best-split oracle
    picking by ``statistic`` has a p95 regret of at most 2 %; None if it needs more than ``limit``."""
    if statistic not in _STATS:
        raise ValueError(f"steps_needed: statistic={statistic!r}: expected one of {sorted(_STATS)}")
    timed = _contenders(node, candidates, threads_of, contenders)
    truth = np.asarray([t for _, t in timed])
    draws = _Draws(node, [rt for rt, _ in timed], noise or NoiseModel(), seeds, max(MAX_STEPS, limit))
    for steps in range(max(start, 2 * len(timed)), limit + 1):
        if _bound(draws, truth, steps)["best_split"][statistic]["p95"] <= _TARGET:
            return steps
    return None
