"""The figures, report and plot of :mod:`bench.overlap`, from the per-iteration records.

Everything here is arithmetic on records (dicts with ``iter_s``, ``fb_s``, ``exposed_s``, ...
as :func:`bench.overlap._emulation.iteration` writes them), so tests hand it numbers of their
own. A *round* holds one visit of every mode (a few iterations in a row); a round's value is
the median of its visit, and comparisons are made round by round (neighbours in time: this
machine is shared and its speed drifts from one minute to the next).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from bench._stats import iqr, median, quantile

__all__ = ["compare", "hidden_fraction", "mode_summary", "plot", "render_markdown", "round_values", "spread"]

Record = Mapping[str, Any]
Round = Mapping[str, Sequence[Record]]
"""mode -> the records of its visit in this round."""

#: The per-iteration times a round's value is taken of (its median).
TIMES = ("iter_s", "fb_s", "exposed_s", "clip_s", "step_s", "redo_kernel_s", "materialize_s")


def hidden_fraction(iter_off_s: float, iter_on_s: float, step_off_s: float) -> float:
    """The share of the off mode's step (its time after backward) that the other mode hides:
    ``(iteration_off - iteration_on) / step_off``; 1 = all of it, 0 = none, negative = slower."""
    return (iter_off_s - iter_on_s) / step_off_s if step_off_s > 0 else math.nan


def spread(xs: Sequence[float]) -> dict[str, Any]:
    """Median, quartiles, IQR, min and max of ``xs`` (``nan``s where there are none)."""
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return {"median": math.nan, "q25": math.nan, "q75": math.nan, "iqr": math.nan, "min": math.nan,
                "max": math.nan, "n": 0}
    return {"median": median(xs), "q25": quantile(xs, 0.25), "q75": quantile(xs, 0.75), "iqr": iqr(xs),
            "min": min(xs), "max": max(xs), "n": len(xs)}


def round_values(records: Sequence[Record]) -> dict[str, float]:
    """One visit's value of each of :data:`TIMES`: the median over its iterations."""
    return {k: median([r[k] for r in records]) for k in TIMES}


def mode_summary(rounds: Sequence[Round], mode: str) -> dict[str, Any]:
    """One mode over the rounds: the spread of its round values and its speculation counts."""
    values = [round_values(r[mode]) for r in rounds]
    records = [rec for r in rounds for rec in r[mode]]
    speculated = sum(rec["speculated"] for rec in records)
    committed = sum(rec["committed"] for rec in records)
    norms = [rec["grad_norm"] for rec in records if rec.get("grad_norm") is not None]
    return {
        **{k: spread([v[k] for v in values]) for k in TIMES},
        "iterations": len(records),
        "speculated_chunks": speculated,
        "committed_chunks": committed,
        "commit_rate": committed / speculated if speculated else None,
        "redone_chunks_per_step": (speculated - committed) / len(records) if records else math.nan,
        "speculated_chunks_per_step": speculated / len(records) if records else math.nan,
        "num_chunks": records[0]["num_chunks"] if records else None,
        "paused_steps": sum(bool(rec.get("paused")) for rec in records),
        "grad_norm_min": min(norms) if norms else None,
    }


def compare(rounds: Sequence[Round], mode: str, base: str = "off") -> dict[str, Any]:
    """``mode`` against ``base`` round by round: the hidden fraction, the forward+backward
    slowdown (mode / base) and the exposed time after backward (mode - base). The redo cost is
    taken over the iterations that redid chunks (a speculation that did not commit: checksums
    read again, chunks recomputed from the committed state): their exposed time minus ``base``'s in the
    same round, and the recomputed chunks' own stage time (``redo_kernel_s``)."""
    hidden, slowdown, delta, redo, redo_kernels = [], [], [], [], []
    for r in rounds:
        b, m = round_values(r[base]), round_values(r[mode])
        hidden.append(hidden_fraction(b["iter_s"], m["iter_s"], b["exposed_s"]))
        slowdown.append(m["fb_s"] / b["fb_s"] if b["fb_s"] > 0 else math.nan)
        delta.append(m["exposed_s"] - b["exposed_s"])
        for rec in r[mode]:
            if rec["speculated"] > rec["committed"]:
                redo.append(rec["exposed_s"] - b["exposed_s"])
                redo_kernels.append(rec["redo_kernel_s"])
    ours, theirs = mode_summary(rounds, mode), mode_summary(rounds, base)
    return {
        "mode": mode, "base": base,
        "hidden_fraction": spread(hidden),
        "hidden_fraction_of_medians": hidden_fraction(theirs["iter_s"]["median"], ours["iter_s"]["median"],
                                                      theirs["exposed_s"]["median"]),
        "fb_slowdown": spread(slowdown),
        "exposed_delta_s": spread(delta),
        "redo_steps": len(redo),
        "redo_cost_s": median(redo) if redo else None,
        "redo_kernel_s": median(redo_kernels) if redo else None,
        "per_round_hidden_fraction": hidden,
    }


# ------------------------------------------------------------------ report

def _ms(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:.1f}"


def _mi(s: Mapping[str, Any]) -> str:
    """A time's median (IQR) over the rounds, ms."""
    return f"{_ms(s['median'])} ({_ms(s['iqr'])})"


def _frac(s: Mapping[str, Any]) -> str:
    if s["n"] == 0:
        return "n/a"
    return f"{s['median']:+.2f} ({s['q25']:+.2f}..{s['q75']:+.2f}; {s['min']:+.2f}..{s['max']:+.2f})"


def _rate(m: Mapping[str, Any]) -> str:
    if m["commit_rate"] is None:
        return "n/a (0 speculated)" if m["speculated_chunks"] == 0 else "n/a"
    return f"{m['commit_rate'] * 100:.0f}% ({m['committed_chunks']}/{m['speculated_chunks']})"


def _case_label(c: Mapping[str, Any]) -> str:
    return f"{c['dtype']}{' + clip' if c['clip'] is not None else ''}"


MEASURES = """\
**What this measures.** The CPU side of a GPU node: the trainer thread sleeps (GIL and core
released) for a modelled GPU time in every layer's forward and backward, as it would wait on the
GPU, while the optimizer's worker thread runs the early chunks on the core that leaves free. So
the figures are those of the host: how much of the step the early chunks hide behind backward
(hidden fraction), what a speculation that does not commit costs after backward (redo cost:
checksums read again, chunks recomputed from the committed state), and how much the early work slows
the trainer's own thread (forward+backward on/off: GIL hand-offs, memory bandwidth shared with
the model's real, small, math). **What it cannot measure:** PCIe transfers (gradients to the
host, weights back; here the gradients are already in host memory and the weights are updated
in place), GPU kernels and their launch latency, the GPU's own memory traffic, and the CPU
cores a real node leaves to the optimizer (here one thread on a 2-core VM shared with others).
The model's math runs for real on the trainer's core (batch {batch}, so it is short against the
waits) and competes with the optimizer for memory bandwidth, which a GPU node's trainer does not.
"""


def render_markdown(r: Mapping[str, Any]) -> str:
    m = r["machine"]
    cfg = r["config"]
    code = r.get("code") or {}
    changed = code.get("offload_changed")
    lines = [
        "# Overlap with backward on an emulated accelerator", "",
        f"Command: `{r['command']}` ({r['wall_s']:.0f} s)", "",
    ]
    if code.get("commit"):
        lines += [f"Code: commit {code['commit']}" + ("" if changed is None else (
            ", offload/ as committed" if not changed else f", with uncommitted changes to {', '.join(changed)}"))
            + ".", ""]
    lines += [
        f"Machine: {m['cpu_model']}, {m['logical_cpus']} logical CPUs ({m['affinity_cpus']} in the affinity "
        f"mask), {m['memory_gib']} GiB, load average {m['load_avg_1_5_15']} at the end, torch {m['torch']}, "
        f"{m['date_utc']}.", "",
        f"Model: {cfg['layers']} x Linear({cfg['width']}, {cfg['width']}) ({r['params']:,} parameters), batch "
        f"{cfg['batch']}; optimizer `CPUOffloadAdamW(settings=OffloadSettings(threads="
        f"{r.get('optimizer_threads', 1)}, chunk_numel={cfg['chunk_numel']}))`"
        + ("" if r.get("backward_threads") is None else
           f", overlapped with `backward_threads={r['backward_threads']}` (the chunks started during backward)")
        + f", lr {cfg['lr']:g}; `torch.set_num_threads(1)` for the model. Per layer a "
        f"backward wait of ratio x (the plain step, measured first, overlap off) / {cfg['layers']}, and a "
        f"forward wait of {cfg['forward_fraction']:g} x that. Clip cases call `opt.clip_grad_norm_("
        f"{cfg['max_norm']:g})` between backward and `step()` (every step clips: smallest norm seen in the "
        f"table's notes). {cfg['rounds']} rounds x {cfg['iters']} iterations per mode, modes in rotating order "
        f"(off, on / on, off / ...), {cfg['warmup']} warm-up iteration(s) per mode and case discarded. "
        + _ranks_text(r), "",
        "Times are medians (IQR) over the rounds, ms. *bwd wait (x off step)*: the whole backward's wait and "
        "its ratio to the step off measured in the case. *exposed* = `clip_grad_norm_` + `step()` + `zero_grad()` "
        "after backward; iteration = forward+backward + exposed. *hidden fraction* = (iteration_off - "
        "iteration_on) / exposed_off per round: median (quartiles; min..max). *redo ms* = exposed_on - "
        "exposed_off (same round) over the steps that redid chunks, median (the recomputed chunks' own stage time; how "
        "many such steps). Host B/param = "
        "(`opt._layout.slabs.nbytes` + `opt._layout.slabs.next_nbytes`: the second generation) / parameters.", "",
    ]
    for d in r["dtypes"]:
        lines.append(f"- {d['dtype']}: plain step {_ms(d['step_s']['median'])} ms (IQR {_ms(d['step_s']['iqr'])}, "
                     f"{d['step_s']['n']} steps, {d['num_chunks']} chunks); the model's own forward+backward math "
                     f"without waits {_ms(d['model_fb_s']['median'])} ms (the early chunks can also run during it: "
                     f"their window is the backward wait plus the real backward)")
    checked = [c for c in r["cases"] if c["params_equal_to_off"] is not None]
    if checked:
        unequal = [f"{_case_label(c)} ratio {c['ratio']:g}" for c in checked if not c["params_equal_to_off"]]
        lines.append(f"- parameters bitwise equal across modes at the end of every case: "
                     f"{'yes' if not unequal else 'NO: ' + ', '.join(unequal)} ({len(checked)} cases)")
    lines.append("")
    comparisons = [(c, k) for c in r["cases"] for k in c["compare"]]
    if comparisons:
        lines += [
            "| case | mode | bwd/step | bwd wait ms (x off step) | iteration off / on | fwd+bwd off / on (on/off) "
            "| exposed off / on | hidden fraction | commit | redone / step | redo ms (kernels) "
            "| host B/param off / on |",
            "|---|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|",
        ]
        for c, name in comparisons:
            k = c["compare"][name]
            off, on = c["modes"][k["base"]], c["modes"][name]
            redo = "-" if k["redo_cost_s"] is None else (f"{_ms(k['redo_cost_s'])} ({_ms(k['redo_kernel_s'])}; "
                                                         f"{k['redo_steps']} steps)")
            lines.append(
                f"| {_case_label(c)} | {name} | {c['ratio']:g} | {_ms(c['backward_wait_s'])} "
                f"({c['effective_ratio']:.2f}) | {_mi(off['iter_s'])} / {_mi(on['iter_s'])} "
                f"| {_mi(off['fb_s'])} / {_mi(on['fb_s'])} ({k['fb_slowdown']['median']:.2f}, IQR "
                f"{k['fb_slowdown']['iqr']:.2f}) | {_mi(off['exposed_s'])} / {_mi(on['exposed_s'])} "
                f"| {_frac(k['hidden_fraction'])} | {_rate(on)} | {on['redone_chunks_per_step']:.1f} | {redo} "
                f"| {off['host_bytes_per_param']:.1f} / {on['host_bytes_per_param']:.1f} |")
    else:
        lines += ["| case | mode | bwd/step | bwd wait ms | iteration | fwd+bwd | exposed | commit | host B/param |",
                  "|---|---|---:|---:|---:|---:|---:|---|---:|"]
        for c in r["cases"]:
            for name, s in c["modes"].items():
                lines.append(f"| {_case_label(c)} | {name} | {c['ratio']:g} | {_ms(c['backward_wait_s'])} "
                             f"| {_mi(s['iter_s'])} | {_mi(s['fb_s'])} | {_mi(s['exposed_s'])} | {_rate(s)} "
                             f"| {s['host_bytes_per_param']:.1f} |")
    if comparisons:
        faster = [c for c, k in comparisons if c["compare"][k]["hidden_fraction"]["q25"] > 0]
        slower = [c for c, k in comparisons if c["compare"][k]["hidden_fraction"]["q75"] < 0]
        lines += ["", f"Verdict: the compared mode is faster than off (hidden fraction's lower quartile above 0) in "
                  f"{len(faster)} of {len(comparisons)} cases, slower (upper quartile below 0) in {len(slower)}, "
                  f"within the noise in {len(comparisons) - len(faster) - len(slower)}."]
        lines += ["", "Where the exposed time goes (medians, ms): `clip_grad_norm_`, `step()`, and of the step the "
                  "`materialize` stage (weights back into the parameters; StepStats.materialize_s).", "",
                  "| case | bwd/step | clip off / on | step() off / on | materialize off / on |",
                  "|---|---:|---:|---:|---:|"]
        for c, name in comparisons:
            off, on = c["modes"][c["compare"][name]["base"]], c["modes"][name]
            pair = lambda k: f"{_ms(off[k]['median'])} / {_ms(on[k]['median'])}"  # noqa: E731
            lines.append(f"| {_case_label(c)}, {name} | {c['ratio']:g} | {pair('clip_s')} | {pair('step_s')} "
                         f"| {pair('materialize_s')} |")
    notes = []
    for c in r["cases"]:
        for name, s in c["modes"].items():
            if s["paused_steps"]:
                notes.append(f"{_case_label(c)} ratio {c['ratio']:g}, {name}: speculation paused after "
                             f"{s['paused_steps']} of {s['iterations']} steps")
    norms = [s["grad_norm_min"] for c in r["cases"] for s in c["modes"].values() if s["grad_norm_min"] is not None]
    if norms:
        notes.append(f"clip cases: smallest total gradient norm {min(norms):.4g} (max_norm {cfg['max_norm']:g})")
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    if r.get("plot"):
        lines += ["", f"![hidden fraction vs backward/step ratio]({Path(r['plot']).name})"]
    lines += ["", MEASURES.format(batch=cfg["batch"]).rstrip()]
    if r.get("note"):
        lines += ["", r["note"]]
    return "\n".join(lines) + "\n"


def plot(r: Mapping[str, Any], path: Path) -> Path | None:
    """Hidden fraction (median, quartile bars) against the backward/step ratio, one line per case
    and compared mode; None where matplotlib is missing or nothing was compared."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    series: dict[str, list[tuple[float, Mapping[str, Any]]]] = {}
    for c in r["cases"]:
        for name, k in c["compare"].items():
            series.setdefault(f"{_case_label(c)}, {name}", []).append((c["ratio"], k["hidden_fraction"]))
    if not series:
        return None
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for label, pts in series.items():
        pts.sort(key=lambda p: p[0])
        xs = [p[0] for p in pts]
        ys = [p[1]["median"] for p in pts]
        err = [[y - p[1]["q25"] for y, p in zip(ys, pts)], [p[1]["q75"] - y for y, p in zip(ys, pts)]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("backward wait / plain step")
    ax.set_ylabel("hidden fraction (iter_off - iter_on) / step_off")
    ax.set_title(f"overlap_backward on an emulated accelerator ({r['params']:,} params, 1 optimizer thread)",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return path


def _ranks_text(r: dict[str, Any]) -> str:
    if r.get("ranks", 1) == 1:
        return "1 rank (`--ranks 2` runs two side by side)."
    cpus = r.get("rank_cpus") or []
    return (f"{r['ranks']} ranks (torchrun, gloo) side by side on this host, each with its own replica and optimizer "
            f"and CPUs {', '.join(str(c) for c in cpus)} (rank order); a barrier (untimed) before every "
            "iteration, no gradient reduction (a GPU node reduces on its GPUs); per round, mode and iteration "
            "the slowest rank's record is the node's.")
