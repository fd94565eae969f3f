"""The report of ``python -m bench.simulate``: the Markdown file and the console lines.

Reads only the result dictionary ``bench.simulate._main.run`` returns (the JSON written next to the
Markdown), so a report can be re-rendered from a saved JSON.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from bench.simulate import _contention
from bench.simulate import _stepmodel
from bench.simulate._oracle import MAX_STEPS
from bench.simulate._stepmodel import Hardware, NoiseModel, Workload

__all__ = ["model_text", "render_markdown", "summary_line"]


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def _flips(n: dict[str, Any]) -> str:
    return _pct(n["flip_rate"]) if "flip_rate" in n else "-"  # results of older versions lack it


def _oracle(n: dict[str, Any], key: str = "oracle") -> str:
    o = n.get(key)  # results of older versions lack it
    if not o:
        return "-"
    best = o.get("best_split")
    if not best:
        return f"{_pct(o['median']['p95'])} / {_pct(o['mean']['p95'])}"
    return (f"{_pct(best['median']['p95'])} ({best['median']['above_2pct'] * 100:.1f} % > 2 %) / "
            f"{_pct(best['mean']['p95'])}")


def _above(n: dict[str, Any]) -> str:
    r = n["regret"]
    if "above_2pct" not in r:  # results of older versions lack it
        return "-"
    low, high = r["above_2pct_ci95"]
    return f"{r['above_2pct'] * 100:.1f} % ({low * 100:.1f}-{high * 100:.1f})"


def _needed(n: dict[str, Any]) -> str:
    o = n.get("oracle_steps_needed")  # results of older versions lack it
    if not o:
        return "-"
    return " / ".join(f"> {MAX_STEPS}" if o[s] is None else str(o[s]) for s in ("median", "mean"))


def _whole(n: dict[str, Any]) -> str:
    w = n.get("whole_run")  # results of older versions lack it; None: not run
    if not w:
        return "-"
    return f"{_pct(w['regret']['median'])} / {_pct(w['regret']['p95'])} ({w['seeds']})"


def _whole_lines(n: dict[str, Any]) -> list[str]:
    w = n.get("whole_run")
    if not w:
        return []
    states = ", ".join(f"{k} {v:g}" for k, v in w["steps_by_state_median"].items())
    return [
        f"- whole run ({w['seeds']} seeds x {w['horizon']} steps, every step observed): regret median "
        f"{_pct(w['regret']['median'])}, p95 {_pct(w['regret']['p95'])}, max {_pct(w['regret']['max'])}; had the "
        f"first winner stayed: median {_pct(w['stay_regret']['median'])}, p95 {_pct(w['stay_regret']['p95'])}; "
        f"median steps by state: {states}; setting switches after the first lock-in: median "
        f"{w['switches_after_lock']['median']:g}, max {w['switches_after_lock']['max']} ({w['elapsed_s']:.1f} s "
        "for these sessions)",
    ]


def _contention_lines(n: dict[str, Any]) -> list[str]:
    c = n.get("contention")
    if not c:
        return []
    kinds = " or ".join("(" + ", ".join(f"{x:g}" for x in k) + ")" for k in c["episodes"])
    return [
        f"- contention: load episodes of mean {c['mean_episode_steps']:g} steps after quiet spells of mean "
        f"{c['mean_quiet_steps']:g}, busy threads per socket {kinds}; 'true s' below is the long-run mean over "
        "the load process, 'quiet s' the time without load; each run's regret is measured against the "
        "candidates' means over its own load trace",
    ]


def render_markdown(result: dict[str, Any]) -> str:
    """The Markdown report of a simulation ``result``."""
    cfg = result["config"]
    targets = result["targets"]
    lines = [
        "# Simulated large nodes: the real online tuner on a step-time model",
        "",
        f"- command: `{result['command']}`",
        f"- date (UTC): {result['date']}; duration {result['duration_s']:.1f} s on this machine",
        f"- tuner: `autotune.OnlineTuner` with the default `AutotuneConfig` (probe budget {cfg['probe_steps']} steps, "
        f"{cfg['warmup_steps']} warm-up + {cfg['measure_steps']} measured per candidate, "
        f"{cfg['finalists']} finalists x "
        f"{cfg['final_rounds']} rounds, min gain {cfg['min_gain']:g}, noise factor {cfg['noise_factor']:g}, "
        f"Optuna seed {cfg['seed']}); "
        "one tuner per simulated local rank, agreeing through `autotune.testing.InProcessAgreement`",
        "- only the measurement is simulated: search space, static plan and thread caps come from the real "
        "`plan_cpu_threads` and `offload_search_space` on each node's topology and masks",
        f"- targets, on every node: median regret <= {_pct(targets['median_regret'])}, p95 <= "
        f"{_pct(targets['p95_regret'])}, median probe steps <= {targets.get('median_probe_steps', '-')} (within "
        "the default probe budget)",
        "",
        "Regret = (true time of the locked-in winner - true best of the space) / true best, true = the model "
        "without noise. Probe overhead = extra step-equivalents the probing steps cost over running the true best. "
        "Seeds above 2 % = the share of seeds whose regret exceeds 2 %, with its Wilson 95 % interval: the p95 "
        "target holds when it is at most 5 %, and the interval says how sure this many seeds make that. "
        "Winner flips = the share of seeds that locked in another candidate than the most frequent winner. "
        "Oracle p95 = the p95 regret of an oracle told the 3 truly fastest candidates that spends the target's "
        "median probe steps on them alone (one warm-up each, the rest measured; spikes dropped as the tuner drops "
        "them), with the best split of those samples over the three, chosen in hindsight on the seeds it is scored "
        "on, picking by median (and the share of its seeds above 2 %) / by mean (`bench.simulate._oracle`, 1000 "
        "seeds): a floor for any tuner with that budget under this noise, which must also find the three first; "
        f"\"at {cfg['probe_steps']}\": the same oracle spending the whole probe budget on them. \"Oracle needs\" = "
        "the fewest probe steps at which that oracle's p95 is at most 2 %, picking by median / by mean: where the "
        "median figure is above the target's median probe steps, no tuner that decides on medians (DESIGN.md) can "
        "meet the p95 target within them.",
        "",
        "Whole-run regret (median / p95, seeds) = what the steps of a run of the horizon's length cost (the true "
        "node time of each step under its load, a switch's first step `warmup_penalty` slower, probing included, "
        "every step passed to `observe()` and whatever the tuner applied after lock-in run) over as many steps of "
        "the best fixed setting under the same load trace, minus 1 (`bench.simulate._truth`). Contended nodes "
        "(`-contended`, `bench.simulate._contention`): load episodes come and go; a candidate's truth in a run is its mean "
        "step time over that run's load trace (the horizon's steps), for the lock-in regret too; no oracle.",
        "",
        "| node | ranks | seeds | candidates | regret median | regret p95 | seeds above 2 % (95 % CI) | regret max "
        "| whole-run regret median / p95 (seeds) | probe steps (median/max) "
        "| probe overhead (steps) | winner flips | oracle p95 (median / mean) "
        f"| oracle p95 at {cfg['probe_steps']} (median / mean) | oracle needs (median / mean) | static plan regret "
        "| static rule oversubscribes | static rule / tuner | targets |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---|---|---:|---|---:|---|",
    ]
    for n in result["nodes"]:
        sr = n["static_rule"]
        lines.append(
            f"| {n['node']} | {n['ranks']} | {n['seeds']} | {n['n_candidates']} | {_pct(n['regret']['median'])} "
            f"| {_pct(n['regret']['p95'])} | {_above(n)} | {_pct(n['regret']['max'])} | {_whole(n)} "
            f"| {n['probe_steps']['median']:g} / "
            f"{n['probe_steps']['max']} | {n['probe_overhead_steps_median']:.1f} | {_flips(n)} | {_oracle(n)} | {_oracle(n, 'oracle_budget')} | {_needed(n)} "
            f"| {_pct(n['baseline_regret'])} "
            f"| {'yes' if sr['oversubscribed'] else 'no'} ({sum(sr['threads'])} threads) "
            f"| {n['tuner_vs_static_median']:.2f}x | {'met' if n['meets_targets'] else '**not met**'} |"
        )
    over = [n for n in result["nodes"] if n["static_rule"]["oversubscribed"]]
    lines += [
        "",
        f"The static rule `min(len(mask), cpu_count // local ranks)` oversubscribes on {len(over)} of "
        f"{len(result['nodes'])} node types (it is deterministic per node: the same every seed).",
        "",
    ]
    for n in result["nodes"]:
        sr = n["static_rule"]
        lines += [
            f"## {n['node']}",
            "",
            f"{n['description']}.",
            "",
            f"- thread plan (rank 0, the real `plan_cpu_threads`, the masks handed in): "
            f"{n['plan_reason_rank0']}",
            f"- space: {n['n_candidates']} candidates, "
            + ", ".join(f"{k['name']} {k['values']}" for k in n['space']['knobs'])
            + "; static plan `" + " ".join(f"{k}={v}" for k, v in n['baseline'].items())
            + f"` ({n['baseline_true_s']:.4f} s, "
            f"regret {_pct(n['baseline_regret'])})",
            f"- true best `{n['best']['candidate']}`: {n['best']['true_s']:.4f} s",
            f"- static rule: threads {sorted(set(sr['threads']))} per rank, chunk {n['baseline']['chunk_numel']}: "
            f"{sr['true_s']:.4f} s = {sr['vs_best']:.3f}x the true best; "
            f"{'oversubscribes' if sr['oversubscribed'] else 'does not oversubscribe'} ({sr['detail']})",
            f"- regret: median {_pct(n['regret']['median'])}, p95 {_pct(n['regret']['p95'])}, max "
            f"{_pct(n['regret']['max'])}, {_pct(n['regret']['within_2pct'])} of seeds within 2 %; static plan kept in "
            f"{_pct(n['kept_baseline_rate'])} of seeds; the true best was measured at all in "
            f"{_pct(n['best_measured_rate'])} of seeds ({n['explored_median']:g} of {n['n_candidates']} candidates "
            "measured per session)",
            f"- probing cost: {n['probe_overhead_steps_median']:.1f} step-equivalents over running the true best for "
            f"{n['probe_steps']['median']:g} steps (slow candidates probed); the tuner's winner is "
            f"{n['tuner_vs_static_median']:.2f}x faster than the static rule (median)",
            *_whole_lines(n),
            *_contention_lines(n),
            "- winners (seeds): " + ", ".join(f"`{k}` {v}" for k, v in n["winners"].items()),
            "",
        ]
        quiet = n.get("quiet_s")
        lines += (["| candidate | true s | vs best | quiet s |", "|---|---:|---:|---:|"] if quiet
                  else ["| candidate | true s | vs best |", "|---|---:|---:|"])
        for cand, t in sorted(n["truth_s"].items(), key=lambda kv: kv[1]):
            lines.append(f"| {cand} | {t:.4f} | {t / n['best']['true_s']:.3f} |"
                         + (f" {quiet[cand]:.4f} |" if quiet else ""))
        lines.append("")
    if result.get("what_if"):
        lines += [
            "## What-if: the same tuner with another configuration",
            "",
            "Each row: the real tuner on the same model with one change (an `AutotuneConfig` field, or a quieter "
            "noise model), fewer seeds. Evidence for what limits the regret, not the product's numbers (those are "
            "the table above).",
            "",
            "| variant | node | seeds | regret median | regret p95 | probe steps (median/max) | static plan kept "
            "| true best measured | targets |",
            "|---|---|---:|---:|---:|---|---:|---:|---|",
        ]
        for v in result["what_if"]:
            for n in v["nodes"]:
                lines.append(
                    f"| {v['description']} | {n['node']} | {n['seeds']} | {_pct(n['regret']['median'])} "
                    f"| {_pct(n['regret']['p95'])} | {n['probe_steps']['median']:g} / {n['probe_steps']['max']} "
                    f"| {_pct(n['kept_baseline_rate'])} | {_pct(n['best_measured_rate'])} "
                    f"| {'met' if n['meets_targets'] else 'not met'} |"
                )
        lines.append("")
    check = result.get("gloo_check")
    if check:
        lines += [
            "## Cross-check over real gloo",
            "",
            f"Seeds {check['seeds']} of `{check['node']}` re-run with {check['processes']} real processes joined by "
            "a gloo group, each tuner building its own `GlooAgreement` (group=None), the same model times: "
            f"**{check['identical_decisions']} of {len(check['seeds'])} sessions took identical decisions** (winner, "
            "probe steps, reason, every measured median) to the in-process simulation. Cost on this 2-core machine: "
            f"{check['gloo_wall_s']:.1f} s for the processes (start-up included; sessions "
            f"{', '.join(f'{x:.2f}' for x in check['gloo_session_s'])} s each) against "
            f"{check['in_process_wall_s']:.2f} s in-process, which is why the main run uses threads.",
            "",
        ]
    lines += _change_lines(result.get("load_change"))
    lines += ["## The model", "", result["model"], ""]
    return "\n".join(lines)


def _change_lines(change: dict[str, Any] | None) -> list[str]:
    """The section on the watch following a scripted load change (``bench.simulate._main.follow_change``)."""
    if not change:
        return []
    lines = [
        "## The watch follows a load change",
        "",
        f"`{change['node']}`, {change['seeds']} seeds of {change['horizon']} steps each, its load scripted "
        f"instead of its episodes: it changes at step {change['change_at']} and stays. Followed = the setting "
        "the run follows (what its locked steps run between the watch's rounds) is within "
        f"{_pct(change['tolerance'])} of the best setting under the new load from some step on to the end; "
        "steps = from the change to that step. Regret at the change = what keeping the lock-in would cost. "
        "Watch cost = what the watch's steps cost beyond the followed setting's, as a share of every locked "
        f"step's time (its bound: {_pct(change['watch_cost_bound'])}).",
        "",
        "| change | best before | best after | followed | steps (median / p95 / max) | regret at the change "
        "(median) | final regret (median / p95 / max) | watch cost (median / max) | final settings |",
        "|---|---|---|---:|---|---:|---|---|---|",
    ]
    for c in change["changes"]:
        s = c["summary"]
        steps = s["follow_steps"]
        lines.append(
            f"| {c['change']} (busy threads per socket {c['busy_before']} to {c['busy_after']}) | {c['best_before']} "
            f"| {c['best_after']} | {s['followed']} of {s['seeds']} | "
            + (f"{steps['median']:g} / {steps['p95']:.0f} / {steps['max']}" if steps else "-")
            + f" | {_pct(s['regret_at_change_median'])} | {_pct(s['final_regret']['median'])} / "
            f"{_pct(s['final_regret']['p95'])} / {_pct(s['final_regret']['max'])} | "
            f"{_pct(s['watch_cost']['median'])} / {_pct(s['watch_cost']['max'])} | "
            + "; ".join(f"{k}: {n}" for k, n in s["finals"].items()) + " |")
    return lines + [""]


def model_text() -> str:
    """The step-time model's description and default parameters, for the report."""
    doc = (_stepmodel.__doc__ or "").strip()
    hw = Hardware(sockets=2, cores_per_socket=60)
    wl = Workload(params=1)
    nm = NoiseModel()
    params = ", ".join(f"{k}={v}" for k, v in asdict(hw).items() if k not in ("sockets", "cores_per_socket", "smt"))
    wlp = ", ".join(f"{k}={v}" for k, v in asdict(wl).items() if k != "params")
    noise = ", ".join(f"{k}={v}" for k, v in asdict(nm).items())
    load_doc = (_contention.__doc__ or "").strip()
    return (
        doc.split("\n\n", 1)[1]
        + "\n\nLoad episodes (`bench.simulate._contention`, the `-contended` nodes): " + load_doc.split("\n\n", 1)[1]
        + f"\n\nDefault hardware parameters: {params}.\nDefault workload parameters: {wlp}.\nNoise: {noise}.\n"
        "Per-node overrides are in the JSON (`hardware`, `workload`). These numbers are assumptions, loosely "
        "calibrated on `bench/results/bandwidth-h200host.md`; the tuner never sees them, only noisy step times."
    )


def summary_line(n: dict[str, Any]) -> str:
    """One console line for a simulated node ``n`` (an entry of ``result["nodes"]``)."""
    return (
        f"{n['node']:<30} seeds {n['seeds']:>3}  regret median {_pct(n['regret']['median']):>8}  p95 "
        f"{_pct(n['regret']['p95']):>8}  whole run {_whole(n):>22}  "
        f"probe steps {n['probe_steps']['median']:g}/{n['probe_steps']['max']}  "
        f"flips {_flips(n):>8}  "
        f"static rule {'oversubscribes' if n['static_rule']['oversubscribed'] else 'ok'} "
        f"({n['static_rule']['vs_best']:.2f}x best)  {'met' if n['meets_targets'] else 'NOT MET'}  "
        f"[{n['elapsed_s']:.1f} s]"
    )
