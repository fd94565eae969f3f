"""An oracle bound for ``python -m bench.simulate``: how small the regret can be at all, for a
given number of probe steps, under the step-time model's noise.

The oracle is told the node's ``contenders`` truly fastest candidates up front (a real tuner has
to find them first) and spends every one of ``steps`` probe steps on them: one warm-up each, the
rest measured in equal shares. It drops samples above 1.5x each contender's fastest (the tuner's
stall rule) and picks the smallest median, or mean, of what is left. Its regret over many seeds
is a floor for any tuner that probes that many steps on that node: when the oracle's p95 regret
is above a target, no schedule and no lock-in rule meets the target within that budget; only
more samples, or a quieter machine, can.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from bench._stepmodel import Node, NoiseModel

__all__ = ["ORACLE_CONTENDERS", "ORACLE_SEEDS", "oracle_bound"]

#: Candidates the oracle is told (the closest ones decide the tail: 2-3 within 3 % of the best).
ORACLE_CONTENDERS = 3
#: Simulated sessions per node; seeded, so the bound is deterministic.
ORACLE_SEEDS = 1000
#: The tuner's stall rule (``autotune._measurement.OUTLIER_FACTOR``).
_OUTLIER_FACTOR = 1.5


def oracle_bound(
    node: Node, candidates: Sequence[dict[str, Any]], threads_of: Callable[[dict[str, Any]], list[int]], *,
    steps: int, noise: NoiseModel | None = None, seeds: int = ORACLE_SEEDS, contenders: int = ORACLE_CONTENDERS,
) -> dict[str, Any]:
    """The oracle's regret on ``node`` for ``steps`` probe steps: p95 and the share of seeds above
    2 %, picking by median and by mean. ``threads_of(candidate)``: each rank's threads for it."""
    noise = noise or NoiseModel()
    def times(c: dict[str, Any]) -> tuple[float, ...]:
        return node.rank_times(threads_of(c), int(c["chunk_numel"]), bind_numa=bool(c.get("bind_numa", False)))

    timed = sorted(((c, max(times(c))) for c in candidates), key=lambda ct: ct[1])[:contenders]
    best = timed[0][1]
    per = max(1, (steps - len(timed)) // len(timed))
    rank_times = [np.asarray(times(c)) for c, _ in timed]
    regrets: dict[str, list[float]] = {"median": [], "mean": []}
    rng = np.random.default_rng([seeds, sum(map(ord, node.name))])
    for _ in range(seeds):
        kept = []
        for times in rank_times:
            xs = np.array([float(np.max(times * noise.factors(rng, node.ranks))) for _ in range(per)])
            kept.append(xs[xs <= _OUTLIER_FACTOR * xs.min()])
        for stat, fn in (("median", np.median), ("mean", np.mean)):
            pick = int(np.argmin([fn(x) for x in kept]))
            regrets[stat].append(timed[pick][1] / best - 1.0)
    out: dict[str, Any] = {"steps": steps, "contenders": len(timed), "samples_each": per, "seeds": seeds}
    for stat, values in regrets.items():
        arr = np.asarray(values)
        out[stat] = {"p95": float(np.quantile(arr, 0.95)), "above_2pct": float(np.mean(arr > 0.02))}
    return out
