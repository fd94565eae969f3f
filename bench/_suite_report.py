"""The report of ``python -m bench``: the suite's Markdown, the roofline's, and their plots.

Reads only the result dictionaries ``bench.suite`` builds (the JSON it writes), so a report can be
re-rendered from a saved result. Plots need matplotlib (drawn with the Agg canvas, no pyplot
state); without it they are left out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench._scenarios import TABLE_LABEL, TABLE_ROWS

__all__ = ["plot_roofline", "plot_scenarios", "render_roofline_md", "render_scenarios_md", "render_suite_md"]


def _ms(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x * 1e3:.{digits}f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _group_title(g: dict[str, Any]) -> str:
    params = f", {g['params']:,} parameters" if g.get("params") else ""
    return f"{g['ranks']} rank{'s' if g['ranks'] > 1 else ''}, {g['dtype']}{params} ({g['launcher']})"


def render_scenarios_md(s: dict[str, Any]) -> list[str]:
    c = s["config"]
    out = ["## Scenarios", "",
           f"Model `{c['model_size']}`, batch {c['batch_size']}, seq-len {c['seq_len']}, {c['steps']} steps per "
           f"plain run (first left out), first autotuned run {c['first_autotuned_run_steps']} steps (probe budget "
           f"{c['probe_budget']}), second {c['second_autotuned_run_steps']}; {c['rounds']} interleaved round(s), "
           f"{s['runs']} trainer runs, {s['duration_s']} s. Machine: {c['cpu_count']} CPUs, {c['affinity']} in "
           "the affinity mask.", ""]
    if s.get("rounds_completed", c["rounds"]) < c["rounds"]:
        out += [f"**Partial result: {s['rounds_completed']} of {c['rounds']} rounds completed.**", ""]
    out += ["Step = wall time of one training iteration on rank 0 (forward, backward, gradient all-reduce, "
           "optimizer step). Median = median over rounds of each round's median; IQR over all rounds' steps. "
           "Mean = mean step over the same steps (median over rounds): unlike the median it carries the "
           "cost of probing. Stage columns are the offloaded optimizer's `StepStats` medians. Ratios divide "
           "a row's median step by row 1's and by row 5's cache-hit run of the same group (below 1 = faster). "
            "Threads/chunk used: the optimizer settings of the measured steps (the tuner's kernel knob is in the "
            "notes; materialize 0.0 means the fused-mp kernel ran, which writes the bf16 parameters in its own "
            "pass). Rows 1-4 differ only in thread counts and environment.", ""]
    if s["groups"]:
        out += _headline_table(s)
    for g in s["groups"]:
        out += ["", f"### {_group_title(g)}", "",
                "| scenario | threads/chunk used | step ms | IQR ms | mean ms | n | adam_kernel ms | materialize ms "
                "| drain ms | / row 1 | / row 5b |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in g["rows"]:
            used = ", ".join(f"{t}/{ch if ch is not None else '-'}" for t, ch in r["threads_chunk_used"]) or "-"
            st = r["stages_s"]
            out.append(f"| {r['label']} | {used} | {_ms(r['step_s_median'])} | {_ms(r['step_s_iqr'])} | "
                       f"{_ms(r['step_s_mean'])} | {r['n']} | {_ms(st['adam_kernel_s'])} | "
                       f"{_ms(st['materialize_s'])} | {_ms(st['drain_s'])} | "
                       f"{_ratio(r['ratio_to_row1'])} | {_ratio(r['ratio_to_row5b'])} |")
        notes = []
        for r in g["rows"]:
            if r["shared_with"]:
                notes.append(f"row {r['row']} has the same command and environment as row(s) "
                             f"{', '.join(r['shared_with'])} here: measured once, shown in each")
            for rnd, t in enumerate(r["tuner"] or [], start=1):
                if r["row"] in ("5a-incl", "5b"):
                    notes.append(f"row {r['row'][:2]}, round {rnd}: tuner {t['state']}, cache {t['cache_status']}, "
                                 f"probe steps "
                                 f"{t['probe_steps']}, re-check steps {t['check_steps']}, {t['n_candidates']} "
                                 f"candidates, baseline {_knobs(t['baseline'])}, winner {_knobs(t['winner'])}")
        if notes:
            out += [""] + [f"- {n}" for n in dict.fromkeys(notes)]
    out += ["", "### How each row is run", "",
            "The thread rules of rows 1-3 are applied the way a user applies them: by the thread count they "
            "give, passed to the trainer as `--threads T` (optimizer) and `--compute-threads T` "
            "(forward/backward), with the environment the rule implies. Every run gets "
            "`OMP_NUM_THREADS=1` (what torchrun sets for each rank) except row 2.", ""]
    seen = set()
    for g in s["groups"]:
        for r in g["rows"]:
            key = (g["ranks"], r["row"])
            if key in seen or r["row"] == "5a-excl":
                continue
            seen.add(key)
            out.append(f"- {g['ranks']} rank(s), row {r['row']}: {r['mapping']}")
    rules = s["thread_rules"].items()
    out += ["", "Thread rules per local rank count: " + "; ".join(
        f"{k} rank(s): launcher {v['launcher']}, env {v['env']}, static {v['static']}" for k, v in rules)]
    out += [""] + [f"- {n}" for n in s["notes"]]
    if s["errors"]:
        out += ["", "**Failed runs:**", ""] + [f"- `{e.splitlines()[0]}`" for e in s["errors"]]
    return out


def _knobs(k: dict[str, Any] | None) -> str:
    if not k:
        return "-"
    return ", ".join(f"{name} {value}" for name, value in k.items())


def _headline_table(s: dict[str, Any]) -> list[str]:
    groups = s["groups"]
    head = "| scenario | " + " | ".join(f"{g['ranks']}r {g['dtype']}" for g in groups) + " |"
    out = ["Headline: median step ms (ratio to row 1; to row 5b).", "", head,
           "|---|" + "---:|" * len(groups)]
    for key in TABLE_ROWS:
        cells = []
        present = False
        for g in groups:
            r = next((x for x in g["rows"] if x["row"] == key), None)
            if r is None:
                cells.append("")
                continue
            present = True
            cells.append(f"{_ms(r['step_s_median'])} ({_ratio(r['ratio_to_row1'])}; {_ratio(r['ratio_to_row5b'])})")
        if present:
            out.append(f"| {TABLE_LABEL[key]} | " + " | ".join(cells) + " |")
    return out


def render_roofline_md(r: dict[str, Any], header: list[str], png: str = "roofline.png") -> str:
    from bench.membus.bandwidth import verdict_text

    out = ["# Roofline: memory-bandwidth probe vs. the offload kernel, per thread count", "", *header,
           f"- command: `{r['command']}` ({r['duration_s']} s)",
           f"- uptime right after the roofline: `{r.get('uptime_after_roofline')}`",
           f"- C probe: {r['c_probe_status']}", "",
           f"adam_kernel GB/s counts {r['adam_bytes_per_param']} B per parameter; the probe is the best "
           "read-4/write-3 in-place variant at that thread count (`bench/membus/_stream.py`), slab-sized, measured "
           f"interleaved with the optimizer. Ratio = kernel / probe. Plot: `{png}`.", ""]
    for s in r["series"]:
        h = s["headline"]
        out += [f"## {s['model_size']} ({s['params']:,} parameters), {s['dtype']}", "",
                f"At the probe's best thread count ({h['probe_best_threads']}): ratio **{h['ratio']:.3f}** "
                f"({verdict_text(h)}).", "",
                "| threads | probe | probe GB/s | adam_kernel GB/s | ratio | best chunk | step GB/s |",
                "|---:|---|---:|---:|---:|---:|---:|"]
        for p in s["points"]:
            out.append(f"| {p['threads']} | {p['probe']} | {p['probe_gbps']:.2f} | {p['adam_gbps']:.2f} | "
                       f"{p['ratio']:.3f} | {p['best_chunk_numel']} | {p['step_gbps']:.2f} |")
        out.append("")
    return "\n".join(out)


def render_suite_md(result: dict[str, Any]) -> str:
    out = ["# Benchmark suite", "", *result["header"], ""]
    if "scenarios" in result:
        out += render_scenarios_md(result["scenarios"])
    if "roofline" in result:
        r = result["roofline"]
        out += ["", "## Roofline", "", f"Full table: `{result['roofline_file']}`.", "",
                "| model | dtype | threads | probe GB/s | adam_kernel GB/s | ratio |", "|---|---|---:|---:|---:|---:|"]
        for s in r.get("series", []):
            for p in s["points"]:
                out.append(f"| {s['model_size']} | {s['dtype']} | {p['threads']} | {p['probe_gbps']:.2f} | "
                           f"{p['adam_gbps']:.2f} | {p['ratio']:.3f} |")
        if r.get("error"):
            out.append(f"\nRoofline failed: {r['error']}")
    for section, title in (("fused_mp", "fused-mp kernel vs the torch path (whole optimizer step)"),
                           ("tuner_quality", "Tuner quality"), ("simulate", "Simulated large nodes")):
        if section in result:
            e = result[section]
            line = f"- status: {e['status']}"
            if e.get("headline"):
                line += f"; {e['headline']}"
            if e.get("note"):
                line += f"; {e['note']}"
            if e.get("command"):
                line += f"; `{e['command']}` ({e.get('duration_s')} s)"
            if e.get("files"):
                line += "; files: " + ", ".join(f"`{f}`" for f in e["files"])
            out += ["", f"## {title}", "", line]
    return "\n".join(out) + "\n"


def plot_scenarios(s: dict[str, Any], path: Path) -> Path | None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    groups = s["groups"]
    if not groups:
        return None
    ncols = min(2, len(groups))
    nrows = -(-len(groups) // ncols)
    fig = Figure(figsize=(6.5 * ncols, 3.6 * nrows))
    FigureCanvasAgg(fig)
    for i, g in enumerate(groups):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        rows = [r for r in g["rows"] if r["step_s_median"] is not None]
        ys = range(len(rows))
        ax.barh(list(ys), [r["step_s_median"] * 1e3 for r in rows],
                xerr=[(r["step_s_iqr"] or 0) * 1e3 / 2 for r in rows], color="tab:blue", alpha=0.75)
        ax.set_yticks(list(ys))
        ax.set_yticklabels([r["label"] for r in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("step ms (median; whisker width = IQR)")
        ax.set_title(f"{g['ranks']} rank(s), {g['dtype']}", fontsize=9)
        ax.margins(x=0.25)
        for y, r in zip(ys, rows):
            if r["ratio_to_row1"] is not None:
                x = (r["step_s_median"] + (r["step_s_iqr"] or 0) / 2) * 1e3
                ax.text(x, y, f" {r['ratio_to_row1']:.2f}x row 1", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_roofline(r: dict[str, Any], path: Path) -> Path | None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    series = r.get("series") or []
    if not series:
        return None
    fig = Figure(figsize=(5.5 * len(series), 4))
    FigureCanvasAgg(fig)
    for i, s in enumerate(series):
        ax = fig.add_subplot(1, len(series), i + 1)
        t = [p["threads"] for p in s["points"]]
        ax.plot(t, [p["probe_gbps"] for p in s["points"]], "o-", label="probe (read-4/write-3)")
        ax.plot(t, [p["adam_gbps"] for p in s["points"]], "s-", label="offload adam_kernel")
        for p in s["points"]:
            ax.annotate(f"{p['ratio']:.2f}", (p["threads"], p["adam_gbps"]), textcoords="offset points",
                        xytext=(0, -12), ha="center", fontsize=7)
        ax.set_xticks(t)
        ax.set_xlabel("threads")
        ax.set_ylabel("GB/s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{s['model_size']} {s['dtype']} (labels: kernel/probe)", fontsize=9)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
