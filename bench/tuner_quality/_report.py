"""``bench.tuner_quality``'s report: the console text, the Markdown file and the PNG, rendered
from the result dict alone (so a stored JSON can be re-rendered without re-measuring).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from bench.tuner_quality._analysis import TARGET_REGRET, label

__all__ = ["plot", "render_markdown", "render_text"]

logger = logging.getLogger(__name__)

_MS = 1e3

def _ci(d: dict[str, Any]) -> str:
    return f"{d['median']:.3f} [{d['ci'][0]:.3f}, {d['ci'][1]:.3f}]"


def render_text(result: dict[str, Any]) -> str:
    h, a = result["headline"], result["analysis"]
    lines = [f"{'candidate':<26} {'median ms':>10} {'IQR ms':>8} {'n':>3} {'x best':>7}  marks"]
    for row in sorted(a["candidates"], key=lambda r: r["median"]):
        lines.append(f"{row['label']:<26} {row['median'] * _MS:>10.2f} {row['iqr'] * _MS:>8.2f} {row['n']:>3} "
                     f"{row['ratio_to_best']:>7.3f}  {_marks(row)}")
    lines.append(f"regret (rep 0): {h['regret'] * 100:.2f}% (target <= {TARGET_REGRET * 100:.0f}%: "
                 f"{'met' if h['meets_target'] else 'NOT met'}); over {h['reps']} reps: median "
                 f"{h['regret_median'] * 100:.2f}%, max {h['regret_max'] * 100:.2f}%")
    lines.append(f"paired per round: regret (rep 0) {h['regret_paired'] * 100:.2f}%, median "
                 f"{h['regret_paired_median'] * 100:.2f}%, max {h['regret_paired_max'] * 100:.2f}%")
    lines.append(f"never slower than the static plan beyond noise: {h['never_slower_than_static']}")
    lines.append(f"probe steps {h['probe_steps']} of {h['probe_budget']}; probing cost {h['startup_cost_s']:.3f} s = "
                 f"{h['share_of_1000_steps'] * 100:.2f}% of 1000 steps, {h['share_of_1000_iterations'] * 100:.2f}% "
                 "of 1000 iterations")
    lines.append(f"cache-hit run: cache_hit {h['cache_hit']}, probe_steps {h['cache_probe_steps']}, re-check steps "
                 f"{h['cache_check_steps']}, start-up cost {h['cache_startup_cost_s']:.3f} s")
    return "\n".join(lines)


def _marks(row: dict[str, Any]) -> str:
    marks = []
    if row["is_best"]:
        marks.append("best")
    if row["is_static"]:
        marks.append("static plan")
    if row["winner_of_reps"]:
        marks.append("tuner winner (rep " + ", ".join(map(str, row["winner_of_reps"])) + ")")
    return "; ".join(marks)


def render_markdown(result: dict[str, Any]) -> str:
    m, c, h, a = result["machine"], result["config"], result["headline"], result["analysis"]
    cv, w = result["cache_hit_run"], result["workload"]
    grads = (f"the trainer's forward+backward (batch {c['batch_size']}, seq {c['seq_len']}, "
             f"{c['forward_backward_threads']} intra-op threads) before every step" if c["grads"] == "backward"
             else "fixed synthetic gradients (no forward/backward)")
    out = [
        "# Tuner quality: the online tuner vs. an exhaustive sweep",
        "",
        f"- command: `{result['command']}`",
        f"- date (UTC): {m['date_utc']}; duration {result['duration_s']} s",
        f"- CPU: {m['cpu_model']}; {m['physical_cores']} physical cores, {m['logical_cpus']} logical, "
        f"{m['affinity_cpus']} in the affinity mask; {m['memory_gib']} GiB; torch {m['torch']} "
        f"({m['torch_parallel_backend']}); Python {m['python']}",
        _code_text(result.get("code")),
        f"- `uptime` before: `{result['uptime_before']}`",
        f"- `uptime` after: `{result['uptime_after']}`",
        f"- load average (1/5/15 min) at the start and end of each phase: {_loads_text(result)}",
        f"- workload: reference trainer model `{c['model_size']}` {c['dtype']} ({w['params']:,} parameters, the "
        f"trainer's 2 parameter groups), {grads}; objective `StepStats.step_s` (wall time of `step()`)",
        f"- tuner: `AutotuneConfig` defaults ({_config_text(result['autotune_config'])}), a fresh temporary "
        f"cache per repetition, seeds {c['seed']}..{c['seed'] + c['reps'] - 1}",
        f"- sweep: {len(a['candidates'])} candidates x {c['rounds']} interleaved rounds (fresh random order per "
        f"round), each visit 1 discarded warm-up step + {c['per_visit']} measured",
    ]
    if result["note"]:
        out.append(f"- note: {result['note']}")
    out += [
        "",
        "## Headline",
        "",
        f"- **regret {h['regret'] * 100:.2f}%** (repetition 0; target <= {TARGET_REGRET * 100:.0f}%: "
        f"{'met' if h['meets_target'] else 'not met'}): the tuner chose {label(h['winner'])}, the sweep's best "
        f"is {label(h['best'])}, the static plan is {label(h['static_plan'])}.",
        f"- over {h['reps']} repetitions: regret median {h['regret_median'] * 100:.2f}%, max "
        f"{h['regret_max'] * 100:.2f}%, {h['reps_meeting_target']} of {h['reps']} within "
        f"{TARGET_REGRET * 100:.0f}%. Paired per round (drift cancels): regret {h['regret_paired'] * 100:.2f}% "
        f"(rep 0), median {h['regret_paired_median'] * 100:.2f}%, max {h['regret_paired_max'] * 100:.2f}%.",
        f"- never slower than the static plan beyond noise: **{'yes' if h['never_slower_than_static'] else 'NO'}**.",
        f"- probe steps: {h['probe_steps']} of a budget of {h['probe_budget']}; probing wall time (sum of "
        f"`step()` while probing) {h['probe_wall_s']:.2f} s; probing cost with the locked step time taken from "
        f"the sweep (the winner's median over every round) {h['startup_cost_sweep_ref_s']:.3f} s = "
        f"**{h['share_of_1000_steps_sweep_ref'] * 100:.2f}% of a 1000-step run** (optimizer steps only); with the "
        f"run's own few locked steps as the reference instead (exposed to load spikes right after lock-in): "
        f"{h['startup_cost_s']:.3f} s = {h['share_of_1000_steps'] * 100:.2f}% of 1000 steps, "
        f"{h['share_of_1000_iterations'] * 100:.2f}% of 1000 iterations.",
        f"- second run with the same cache: cache_hit **{h['cache_hit']}** ({cv['cache_status']}), probe steps "
        f"**{h['cache_probe_steps']}**, {h['cache_check_steps']} re-check steps; start-up cost "
        f"{h['cache_startup_cost_s']:.3f} s vs {h['startup_cost_s']:.3f} s on the first run.",
        "",
        "## Sweep (all candidates, interleaved)",
        "",
        "Step times in ms. `x best` is the ratio of medians; `paired / best` and `paired / static` are the",
        "per-round ratios (median over rounds, 95% bootstrap interval).",
        "",
        "| candidate | median | IQR | n | x best | paired / best | paired / static | |",
        "|---|---:|---:|---:|---:|---|---|---|",
    ]
    for row in sorted(a["candidates"], key=lambda r: r["median"]):
        out.append(f"| {row['label']} | {row['median'] * _MS:.2f} | {row['iqr'] * _MS:.2f} | {row['n']} | "
                   f"{row['ratio_to_best']:.3f} | {_ci(row['paired_ratio_to_best'])} | "
                   f"{_ci(row['paired_ratio_to_static'])} | {_marks(row)} |")
    out += [
        "",
        "## Tuner repetitions",
        "",
        "| rep | seed | sampler | probe steps | explored | winner | regret | winner / best (paired) | IQRs overlap | "
        "slower than static beyond noise | speedup over static: tuner's claim / sweep (paired) | probing cost s | "
        "share of 1000 steps (sweep ref.) | break-even steps |",
        "|---:|---:|---|---:|---:|---|---:|---|---|---|---|---:|---|---:|",
    ]
    for j in a["reps"]:
        be = f"{j['break_even_steps']:.0f}" if j["break_even_steps"] is not None else "-"
        out.append(f"| {j['rep']} | {j['seed']} | {j['sampler']} | {j['probe_steps']} | {j['explored']} of "
                   f"{j['n_candidates']}{'' if j['best_was_explored'] else ' (best not explored)'} | "
                   f"{j['winner_label']}{' (static plan)' if j['kept_static_plan'] else ''} | "
                   f"{j['regret'] * 100:.2f}% | {_ci(j['paired_ratio_to_best'])} | "
                   f"{'yes' if j['iqr_overlaps_best'] else 'no'} | "
                   f"{'YES' if j['slower_than_static_beyond_noise'] else 'no'} | {_speedups(j)} | "
                   f"{j['startup_cost_s']:.3f} | "
                   f"{j['share_of_1000_steps'] * 100:.2f}% ({j['share_of_1000_steps_sweep_ref'] * 100:.2f}%) | {be} |")
    out += ["", "Each repetition's reason for its decision:", ""]
    out += [f"- rep {j['rep']}: {j['reason']}" for j in a["reps"]]
    over = [j for j in a["reps"] if not j["meets_target"]]
    if over:
        out += ["", "Repetitions over the target, from the data (the paired interval decides noise vs. a real "
                "difference: both were measured in every round):", ""]
        out += [f"- rep {j['rep']}: regret {j['regret'] * 100:.2f}% (paired {j['regret_paired'] * 100:.2f}%): "
                + _explain(j) for j in over]
    f1, f2 = cv["first_run"], cv["second_run"]
    out += [
        "",
        "## Second run: start-up with a cache hit",
        "",
        f"A new optimizer with the same cache file (same fingerprint) right after repetition 0: cache_hit "
        f"{cv['cache_hit']}, probe steps {cv['probe_steps']}, re-check steps {cv['check_steps']}, winner "
        f"{cv['winner_label']} ({'same as' if cv['same_winner_as_first_run'] else 'DIFFERENT from'} the first run). "
        f"`first {cv['k']} steps` compares the second run's steps up to its lock-in with the first run's first "
        f"{cv['k']} (probing) steps."
        + (" The re-check found the static plan clearly faster than the cached choice in its paired rounds, "
           "so the tuner re-tuned: its probe steps are counted above." if cv["cache_status"] == "stale"
           else ""),
        "",
        "| run | construct s | tuner start s | first step s (state init) | steps to lock | step() wall to lock s | "
        f"first {cv['k']} steps s | start-up cost s | locked step ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, f in (("first (probing)", f1), ("second (cache hit)", f2)):
        out.append(f"| {name} | {f['construct_s']:.3f} | {f['start_overhead_s']:.3f} | {f['first_step_s']:.3f} | "
                   f"{f['steps_to_lock']} | {f['wall_to_lock_s']:.3f} | {f['first_k_wall_s']:.3f} | "
                   f"{f['startup_cost_s']:.3f} | {f['locked_step_s'] * _MS:.2f} |")
    out += ["", "## Definitions", ""]
    out += [f"- {k}: {v}" for k, v in result["definitions"].items()]
    return "\n".join(out) + "\n"


def _explain(j: dict[str, Any]) -> str:
    """Why a repetition missed the target, from its numbers."""
    ci = _ci(j["paired_ratio_to_best"])
    if j["paired_ci_includes_1"]:
        return f"within the noise of this machine: the paired ratio winner/best {ci} includes 1."
    why = f"a real difference: the paired ratio winner/best {ci} excludes 1; "
    if not j["best_was_explored"]:
        return why + f"the tuner never measured the best (it explored {j['explored']} of {j['n_candidates']})."
    if j["kept_static_plan"]:
        return why + f"the tuner measured the best but kept the static plan on its few samples ({j['reason']})."
    return why + f"the tuner measured the best but ranked it behind its winner on its few samples ({j['reason']})."


def _code_text(code: dict[str, Any] | None) -> str:
    if not code or not code.get("commit"):
        return "- code: not recorded"
    return f"- code: commit {code['commit']}; changed since: {', '.join(code['changed']) or 'nothing'}"


def _speedups(j: dict[str, Any]) -> str:
    claimed = j["claimed_speedup"]
    return f"{claimed:.3f}x / {1.0 / j['paired_ratio_to_static']['median']:.3f}x" if claimed else "-"


def _loads_text(result: dict[str, Any]) -> str:
    phases = [("tuner rep 0", result["tuner_runs"][0]), ("cache-hit run", result["second_run"]),
              ("sweep", result["sweep_raw"])]
    phases += [(f"rep {k}", run) for k, run in enumerate(result["tuner_runs"]) if k]
    return "; ".join(f"{name} {run['load_before']} -> {run['load_after']} (CPU capacity used by other processes "
                     f"{run['cpu_use']['others_share'] * 100:.0f}%, by this one "
                     f"{run['cpu_use']['own_share'] * 100:.0f}%)"
                     for name, run in phases)


def _config_text(cfg: dict[str, Any]) -> str:
    keys = ("probe_steps", "warmup_steps", "measure_steps", "finalists", "final_rounds", "min_gain",
            "noise_factor", "tie_tolerance")
    return ", ".join(f"{k}={cfg[k]}" for k in keys)


def plot(result: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot")
        return None
    rows = sorted(result["analysis"]["candidates"], key=lambda r: r["median"])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for x, row in enumerate(rows):
        color = "tab:green" if row["is_best"] else ("tab:orange" if row["winner_of_reps"] else "tab:gray")
        ax.bar(x, row["median"] * _MS, color=color, hatch="//" if row["is_static"] else None, edgecolor="black")
        spread = [[(row["median"] - row["q25"]) * _MS], [(row["q75"] - row["median"]) * _MS]]
        ax.errorbar(x, row["median"] * _MS, yerr=spread, color="black", capsize=3)
        ax.scatter([x] * row["n"], [s * _MS for s in row["samples_s"]], s=6, color="black", alpha=0.3, zorder=3)
    ax.set_xticks(range(len(rows)), [r["label"].replace(" ", "\n") for r in rows], fontsize=8)
    ax.set_ylabel("step() ms (median, IQR, samples)")
    h = result["headline"]
    ax.set_title(f"green: best; orange: a tuner winner; hatched: static plan. Regret (rep 0) "
                 f"{h['regret'] * 100:.1f}%, max over {h['reps']} reps {h['regret_max'] * 100:.1f}%", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
