"""``tuning.png``: a tuning run's step times per step, coloured by candidate, the winner marked.

Drawn from the rows and summary a :class:`~autotune.TraceWriter` keeps (``trace.jsonl``,
``summary.json``), by the writer itself at close and by ``python -m autotune plot``. matplotlib
is imported only here, lazily, and only its Agg canvas is used (no pyplot state is touched); the
words of the figure are :func:`plot_text`, so tests check them without matplotlib.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["STEP_TIME_KEYS", "plot_text", "plot_trace", "step_time_of"]

#: Keys tried, in order, for a row's step time (the node time: max over local ranks).
STEP_TIME_KEYS = ("node_time_s", "time_s", "step_s")
#: Legend rows kept in tuning.png (a big space probes many candidates).
_MAX_LEGEND = 28


def step_time_of(row: Mapping[str, Any]) -> float | None:
    """The step time of a trace row (the first of :data:`STEP_TIME_KEYS` that is a finite number)."""
    for key in STEP_TIME_KEYS:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None


def _candidate_label(row: Mapping[str, Any]) -> str:
    candidate = row.get("candidate")
    if isinstance(candidate, Mapping):  # sorted: summary.json is written with sorted keys
        return ", ".join(f"{k}={v}" for k, v in sorted(candidate.items()))
    return str(candidate) if candidate is not None else "?"


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _measured_what(rows: Sequence[Mapping[str, Any]]) -> str:
    """What the tuner's step time was, read off the rows: the training iteration (from one step()
    return to the next) or the optimizer step, as the client's objective chose."""
    for row in rows:
        ranks = row.get("ranks")
        first = next(iter(ranks.values()), None) if isinstance(ranks, Mapping) and ranks else None
        if isinstance(first, Mapping) and _finite(first.get("time_s")):
            for key, what in (("iteration_s", "training iteration time"), ("step_s", "optimizer step time")):
                if _finite(first.get(key)) and first[key] == first["time_s"]:
                    return what
    return "step time"


def plot_text(rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any] | None) -> dict[str, Any]:
    """The words of ``tuning.png`` (title, axis labels, median lines), so they can be checked
    without matplotlib. Steps are numbered from 1, as the trainer's console numbers them."""
    cache_hit = bool(summary.get("cache_hit")) if summary else False
    recorded = " (recorded when it was tuned)" if cache_hit else ""
    medians = []
    for key, style, name in (("winner_median_s", "-", "winner median"),
                             ("baseline_median_s", "--", "static plan median")):
        value = summary.get(key) if summary else None
        if _finite(value):
            medians.append((value, style, name + recorded))
    title = "Online tuning: " + ("re-check of the cached choice" if cache_hit else "step time per step")
    speedup = summary.get("speedup") if summary else None
    if _finite(speedup):
        title += f" (winner {speedup:.2f}x vs the static plan{recorded})"
    what = _measured_what(rows)
    return {
        "title": title,
        "xlabel": "training step (from 1, as the console numbers them)",
        "ylabel": f"{what}, slowest local rank (ms)",
        "medians": medians,
    }


def plot_trace(
    rows: Sequence[Mapping[str, Any]],
    summary: Mapping[str, Any] | None,
    path: str | os.PathLike[str],
) -> Path:
    """Draw step time per step, coloured by candidate, marker by phase, the winner marked.

    Raises ImportError when matplotlib is not installed. Uses the Agg canvas directly, so the
    caller's pyplot backend and figures are untouched. Words: :func:`plot_text`.
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    text = plot_text(rows, summary)
    points = [(row.get("step"), step_time_of(row), row) for row in rows]
    points = [(s + 1, t, r) for s, t, r in points if isinstance(s, (int, float)) and t is not None]
    winner = summary.get("winner") if summary else None
    winner_label = _candidate_label({"candidate": winner}) if isinstance(winner, Mapping) else None

    fig = Figure(figsize=(10, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    labels = list(dict.fromkeys(_candidate_label(r) for _, _, r in points))
    phases = list(dict.fromkeys(str(r.get("phase", "")) for _, _, r in points))
    markers = "o^sDvP*X<>"
    cmap = colormaps["tab20"]
    legend: list[tuple[Any, str]] = []
    for li, label in enumerate(labels):
        color = cmap(li % 20)
        for pi, phase in enumerate(phases):
            sel = [(s, t) for s, t, r in points if _candidate_label(r) == label and str(r.get("phase", "")) == phase]
            if sel:
                ax.scatter([s for s, _ in sel], [t * 1e3 for _, t in sel], color=color,
                           marker=markers[pi % len(markers)], s=28, edgecolors="none")
        legend.append((Line2D([], [], color=color, marker="o", linestyle="none"), label))
    if len(phases) > 1 or any(p.startswith("check") for p in phases):  # a legend row per phase marker
        for pi, phase in enumerate(phases):
            marker = markers[pi % len(markers)]
            legend.append((Line2D([], [], color="grey", marker=marker, linestyle="none"), f"phase: {phase}"))
    if winner_label is not None:  # stars on the probing steps; a re-check's own markers stay visible
        win = [(s, t) for s, t, r in points
               if _candidate_label(r) == winner_label and not str(r.get("phase", "")).startswith("check")]
        if win:
            ax.scatter([s for s, _ in win], [t * 1e3 for _, t in win], marker="*", s=150,
                       facecolors="none", edgecolors="black", zorder=3)
            star = Line2D([], [], color="black", marker="*", markerfacecolor="none", markersize=11, linestyle="none")
            legend.append((star, f"winner: {winner_label}"))
    for value, style, name in text["medians"]:
        ax.axhline(value * 1e3, linestyle=style, color="grey", linewidth=1)
        legend.append((Line2D([], [], color="grey", linestyle=style, linewidth=1), name))
    ax.set_title(text["title"])
    ax.set_xlabel(text["xlabel"])
    ax.set_ylabel(text["ylabel"])
    ax.grid(True, alpha=0.3)
    if legend:
        legend = legend[:_MAX_LEGEND]
        ax.legend([h for h, _ in legend], [n for _, n in legend], loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  fontsize=7, frameon=False)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    return out
