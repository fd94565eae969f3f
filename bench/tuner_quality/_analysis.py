"""``bench.tuner_quality``'s numbers: the statistics (regret, paired ratios, bootstrap intervals,
the noise rule, the probing cost) and the analysis of a run's raw samples into the result's
``analysis``, ``cache_hit_run`` and ``headline``. Pure functions of recorded data: no timing here,
so the tests recompute every figure from the stored samples.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

from bench._stats import iqr, median, quantile

__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "CI_LEVEL",
    "DEFINITIONS",
    "REFERENCE_RUN_STEPS",
    "TARGET_REGRET",
    "analyse",
    "bootstrap_ci",
    "cache_view",
    "chunk_text",
    "headline",
    "label",
    "paired_ratio",
    "regret",
    "run_cost",
    "slower_beyond_noise",
    "startup_cost",
]

#: Target: the tuner's choice within 3 % of the best swept setting (about what the sweep can
#: resolve on a shared machine).
TARGET_REGRET = 0.03
#: Confidence of the bootstrap intervals and resamples drawn for them.
CI_LEVEL = 0.95
BOOTSTRAP_RESAMPLES = 2000
#: A run of this many training steps is the reference for the probing cost.
REFERENCE_RUN_STEPS = 1000


def regret(winner_median: float, best_median: float) -> float:
    """Relative excess of the winner's median over the best one's (0 when the winner is the best)."""
    if not best_median > 0:
        raise ValueError(f"best_median={best_median!r}: expected a positive number of seconds")
    return (winner_median - best_median) / best_median


def paired_ratio(a_by_round: Sequence[Sequence[float]], b_by_round: Sequence[Sequence[float]]) -> list[float]:
    """Per round, median(a) / median(b): both measured in the same round, so slow drift cancels."""
    if len(a_by_round) != len(b_by_round):
        raise ValueError(f"{len(a_by_round)} rounds of a vs {len(b_by_round)} of b: expected the same rounds")
    return [median(a) / median(b) for a, b in zip(a_by_round, b_by_round) if a and b]


def bootstrap_ci(values: Sequence[float], *, level: float = CI_LEVEL, resamples: int = BOOTSTRAP_RESAMPLES,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of ``values`` (seeded: the same data give the same interval)."""
    if not values:
        raise ValueError("bootstrap_ci: expected at least one value, got none")
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(median([values[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    tail = (1.0 - level) / 2.0
    return quantile(medians, tail), quantile(medians, 1.0 - tail)


def slower_beyond_noise(candidate: Sequence[float], reference: Sequence[float]) -> bool:
    """True if ``candidate``'s median exceeds ``reference``'s by more than the larger IQR of the two."""
    return median(candidate) - median(reference) > max(iqr(candidate), iqr(reference))


def startup_cost(*, start_overhead_s: float, active_walls: Sequence[float], first_locked_wall: float,
                 locked_step_s: float) -> float:
    """Seconds a tuning (or re-check) phase costs over running the locked setting from the start.

    ``active_walls``: wall times of ``step()`` while probing or re-checking; the first locked step
    is charged too because it follows the switch to the winner.
    """
    return start_overhead_s + sum(active_walls) + first_locked_wall - (len(active_walls) + 1) * locked_step_s


def _dist(samples: Sequence[float]) -> dict[str, Any]:
    return {"median": median(samples), "iqr": iqr(samples), "q25": quantile(samples, 0.25),
            "q75": quantile(samples, 0.75), "n": len(samples)}


def label(setting: dict[str, Any]) -> str:
    text = f"threads={setting['threads']} chunk={chunk_text(setting['chunk_numel'])}"
    extra = [f"{k}={v}" for k, v in setting.items() if k not in ("threads", "chunk_numel")]
    return " ".join([text, *extra])


def chunk_text(numel: int) -> str:
    if numel % (1 << 20) == 0:
        return f"{numel >> 20}Mi"
    if numel % (1 << 10) == 0:
        return f"{numel >> 10}Ki"
    return str(numel)



def run_cost(start_overhead_s: float, active: Sequence[Any], locked: Sequence[Any], locked_step_s: float) -> float:
    """:func:`startup_cost` of one run. The run's first step is left out: it initialises the
    optimizer state (first touch of the host slabs), which every run pays, tuned or not."""
    if not active:
        return start_overhead_s  # locked at start (one candidate): nothing probed, no switch
    walls = [r["wall_s"] if isinstance(r, dict) else r.wall_s for r in active]
    first_locked = locked[0]["wall_s"] if isinstance(locked[0], dict) else locked[0].wall_s
    return startup_cost(start_overhead_s=start_overhead_s, active_walls=walls[1:], first_locked_wall=first_locked,
                        locked_step_s=locked_step_s)



# ------------------------------------------------------------------------------------ analysis
def analyse(candidates: list[dict[str, Any]], static: dict[str, Any], raw: dict[str, Any],
            reps: list[dict[str, Any]], *, seed: int) -> dict[str, Any]:
    """Per-candidate statistics of the sweep and each repetition's regret and check against the static plan."""
    by_round = raw["step_s_by_round"]
    flat = [[x for rnd in rows for x in rnd] for rows in by_round]
    medians = [median(s) for s in flat]
    wall_medians = [median([x for rnd in rows for x in rnd]) for rows in raw["wall_s_by_round"]]
    best = min(range(len(candidates)), key=lambda i: medians[i])
    static_i = candidates.index(static)
    rows = []
    for i, cand in enumerate(candidates):
        vs_best = paired_ratio(by_round[i], by_round[best])
        vs_static = paired_ratio(by_round[i], by_round[static_i])
        rows.append({
            "candidate": cand, "label": label(cand), "samples_s": flat[i], **_dist(flat[i]),
            "wall_median": wall_medians[i],
            "ratio_to_best": medians[i] / medians[best],
            "paired_ratio_to_best": {"median": median(vs_best), "ci": list(bootstrap_ci(vs_best, seed=seed))},
            "paired_ratio_to_static": {"median": median(vs_static), "ci": list(bootstrap_ci(vs_static, seed=seed))},
            "is_best": i == best, "is_static": i == static_i,
            "winner_of_reps": [k for k, rep in enumerate(reps) if rep["summary"]["winner"] == cand],
        })
    judged = []
    for k, rep in enumerate(reps):
        s = rep["summary"]
        w = candidates.index(s["winner"])
        explored = [m["candidate"] for m in s["measurements"]]
        r = regret(medians[w], medians[best])
        wb, ws = rows[w]["paired_ratio_to_best"], rows[w]["paired_ratio_to_static"]
        # The per-round (paired) view of the same regret: slow drifts of the machine cancel.
        r_paired = wb["median"] - 1.0
        saving = medians[static_i] - medians[w]
        # The same cost with the locked step time taken from the sweep (many interleaved samples of
        # the winner) instead of the run's own few locked steps.
        cost_sweep = run_cost(rep["start_overhead_s"], rep["active_steps"], rep["locked_steps"], wall_medians[w])
        judged.append({
            "startup_cost_sweep_ref_s": cost_sweep,
            "share_of_1000_steps_sweep_ref": cost_sweep / (REFERENCE_RUN_STEPS * wall_medians[w]),
            "claimed_speedup": s["speedup"],
            "rep": k, "seed": rep["seed"], "winner": s["winner"], "winner_label": label(s["winner"]),
            "kept_static_plan": bool(s["kept_baseline"]), "sampler": s["sampler"],
            "probe_steps": s["probe_steps"], "explored": len(explored), "n_candidates": len(candidates),
            "best_was_explored": candidates[best] in explored, "reason": s["reason"],
            "regret": r, "meets_target": r <= TARGET_REGRET, "regret_paired": r_paired,
            # Noise view of the regret: the winner's and the best's IQRs overlap, or the paired
            # interval of winner/best reaches down to 1.
            "iqr_overlaps_best": rows[w]["q25"] <= rows[best]["q75"],
            "paired_ci_includes_1": wb["ci"][0] <= 1.0,
            "paired_ratio_to_best": wb, "paired_ratio_to_static": ws,
            "slower_than_static_beyond_noise": slower_beyond_noise(flat[w], flat[static_i]),
            "saving_per_step_s": saving,
            "break_even_steps": rep["startup_cost_s"] / saving if saving > 0 else None,
            "startup_cost_s": rep["startup_cost_s"], "share_of_1000_steps": rep["share_of_1000_steps"],
            "share_of_1000_iterations": rep["share_of_1000_iterations"],
            "probe_wall_s": rep["active_wall_sum_s"], "locked_step_s": rep["locked_step_s"],
        })
    regrets = [j["regret"] for j in judged]
    paired = [j["regret_paired"] for j in judged]
    return {
        "regret_paired_median": median(paired), "regret_paired_max": max(paired),
        "candidates": rows, "best": candidates[best], "best_label": label(candidates[best]),
        "static": static, "static_label": label(static), "reps": judged,
        "regret_median": median(regrets), "regret_max": max(regrets),
        "reps_meeting_target": sum(j["meets_target"] for j in judged),
        "never_slower_than_static": not any(j["slower_than_static_beyond_noise"] for j in judged),
    }


def cache_view(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """The second run's start-up (cache hit: re-check only) next to the first run's (probing)."""
    s2 = second["summary"]
    k = len(second["active_steps"])
    return {
        "cache_hit": s2["cache_hit"], "cache_status": s2["cache_status"], "probe_steps": s2["probe_steps"],
        "check_steps": s2["check_steps"], "winner": s2["winner"], "winner_label": label(s2["winner"]),
        "same_winner_as_first_run": s2["winner"] == first["summary"]["winner"],
        "first_run": {"construct_s": first["construct_s"], "start_overhead_s": first["start_overhead_s"],
                      "first_step_s": first["first_step_s"],
                      "steps_to_lock": len(first["active_steps"]),
                      "wall_to_lock_s": first["active_wall_sum_s"],
                      "first_k_wall_s": sum(r["wall_s"] for r in first["active_steps"][:k]),
                      "startup_cost_s": first["startup_cost_s"], "locked_step_s": first["locked_step_s"]},
        "second_run": {"construct_s": second["construct_s"], "start_overhead_s": second["start_overhead_s"],
                       "first_step_s": second["first_step_s"],
                       "steps_to_lock": k, "wall_to_lock_s": second["active_wall_sum_s"],
                       "first_k_wall_s": second["active_wall_sum_s"],
                       "startup_cost_s": second["startup_cost_s"], "locked_step_s": second["locked_step_s"]},
        "k": k,
    }



def headline(a: dict[str, Any], reps: list[dict[str, Any]], second: dict[str, Any]) -> dict[str, Any]:
    r0 = a["reps"][0]
    s2 = second["summary"]
    return {
        "winner": r0["winner"], "best": a["best"], "static_plan": a["static"],
        "regret": r0["regret"], "regret_median": a["regret_median"], "regret_max": a["regret_max"],
        "regret_paired": r0["regret_paired"], "regret_paired_median": a["regret_paired_median"],
        "regret_paired_max": a["regret_paired_max"],
        "reps": len(reps), "reps_meeting_target": a["reps_meeting_target"],
        "meets_target": r0["regret"] <= TARGET_REGRET,
        "never_slower_than_static": a["never_slower_than_static"],
        "probe_steps": r0["probe_steps"], "probe_budget": reps[0]["summary"]["probe_budget"],
        "probe_wall_s": r0["probe_wall_s"], "startup_cost_s": r0["startup_cost_s"],
        "share_of_1000_steps": r0["share_of_1000_steps"],
        "share_of_1000_iterations": r0["share_of_1000_iterations"],
        "startup_cost_sweep_ref_s": r0["startup_cost_sweep_ref_s"],
        "share_of_1000_steps_sweep_ref": r0["share_of_1000_steps_sweep_ref"],
        "cache_hit": s2["cache_hit"], "cache_probe_steps": s2["probe_steps"], "cache_check_steps": s2["check_steps"],
        "cache_startup_cost_s": second["startup_cost_s"],
    }


DEFINITIONS = {
    "objective": "StepStats.step_s: wall time of CPUOffloadAdamW.step() (the tuner's objective without "
                 "overlap_backward)",
    "regret": "(median_sweep(winner) - median_sweep(best)) / median_sweep(best); best = smallest sweep median",
    "regret_paired": "median over sweep rounds of (median(winner) / median(best) in that round) - 1",
    "paired_ratio": "per sweep round: median(a's samples) / median(b's samples); median over rounds, "
                    f"{int(CI_LEVEL * 100)}% percentile bootstrap interval over rounds "
                    f"({BOOTSTRAP_RESAMPLES} resamples)",
    "slower_than_static_beyond_noise": "median_sweep(winner) - median_sweep(static) > max(IQR(winner), IQR(static))",
    "startup_cost_s": "tuner start overhead (summary()['overhead_s'] right after construction) + sum of step() wall "
                      "times while probing (or re-checking), except the run's first step + wall of the first locked "
                      "step - (active steps) x locked_step_s (one step out, one in). The first step of a run "
                      "(optimizer state "
                      "initialisation, first touch of the host slabs: first_step_s) is paid with or without a "
                      "tuner and left out",
    "locked_step_s": "median wall time of step() over locked steps 2..L of the same run",
    "share_of_1000_steps": "startup_cost_s / (1000 x locked_step_s)",
    "share_of_1000_iterations": "startup_cost_s / (1000 x (locked_step_s + median forward+backward time))",
    "startup_cost_sweep_ref_s": "startup_cost_s with locked_step_s replaced by the sweep's median step() wall time "
                                "of the winner (more samples, measured at another time)",
    "share_of_1000_steps_sweep_ref": "startup_cost_sweep_ref_s / (1000 x the sweep's median step() wall of the winner)",
    "break_even_steps": "startup_cost_s / (median_sweep(static) - median_sweep(winner)), when positive",
}


