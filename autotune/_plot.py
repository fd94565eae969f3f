"""``tuning.png``: a tuning run's step times per step, coloured by candidate, the winner marked.

Drawn from the rows and summary a :class:`~autotune.TraceWriter` keeps (``trace.jsonl``,
``summary.json``), by the writer itself at close and by ``python -m autotune plot``. matplotlib
is imported only here, lazily, and only its Agg canvas is used (no pyplot state is touched); the
words of the figure are :func:`plot_text`, so tests check them without matplotlib.

Why the y axis is clipped: the plot exists to show gaps of a few percent between candidates (1.6 ms
at 30 ms a step), and one stalled step (a checkpoint, a page-in: 92 ms) would stretch a linear
axis until that gap is a pixel; a log axis would still leave it at a few pixels. So step times
beyond Tukey's far-out fences (:data:`OUTLIER_IQRS` IQRs past the quartiles) are left off the axis
and drawn as triangles on its edge, and a legend row says how many there were and how far out.
"""

from __future__ import annotations

import math
import os
import statistics
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["STEP_TIME_KEYS", "YRange", "draw_trace", "plot_text", "plot_trace", "step_time_of", "y_range"]

#: Keys tried, in order, for a row's step time (the node time: max over local ranks).
STEP_TIME_KEYS = ("node_time_s", "time_s", "step_s")
#: A step time more than this many IQRs beyond the quartiles is drawn on the axis edge (Tukey's
#: "far out"); closer ones, slow candidates included, keep their place.
OUTLIER_IQRS = 3.0
#: The fences are at least this fraction of the median away from the quartiles, so steps that are
#: nearly all equal (IQR ~ 0) do not push a candidate only a little slower off the axis.
MIN_FENCE = 0.1
#: Space above and below the points kept, as a fraction of their range.
_Y_MARGIN = 0.06
#: Legend rows kept in tuning.png (a big space probes many candidates).
_MAX_LEGEND = 28
#: Title characters per line: fits above the axes beside the legend (10 in wide figure, 12 pt).
_TITLE_WIDTH = 60


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


@dataclass(frozen=True, kw_only=True, slots=True)
class YRange:
    """The y axis of tuning.png, in ms: the points within it, and how many were left off it."""

    lo_ms: float
    hi_ms: float
    above: int = 0
    """Step times above :attr:`hi_ms` (drawn as triangles on the top edge)."""
    below: int = 0
    """Step times below :attr:`lo_ms` (drawn on the bottom edge)."""
    max_ms: float = math.nan
    """The highest step time (also when it is above the axis)."""
    min_ms: float = math.nan
    """The lowest step time."""

    @property
    def clipped(self) -> bool:
        return bool(self.above or self.below)

    def note(self) -> str | None:
        """The legend row that says the axis is clipped (None when it is not)."""
        if not self.clipped:
            return None
        parts = []
        if self.above:
            parts.append(f"{self.above} step{'s' if self.above > 1 else ''} above, up to {self.max_ms:.1f} ms")
        if self.below:
            parts.append(f"{self.below} step{'s' if self.below > 1 else ''} below, down to {self.min_ms:.1f} ms")
        return "y axis clipped (on the edge):\n" + ";\n".join(parts)

    def side_of(self, ms: float) -> str | None:
        """``"top"`` or ``"bottom"`` for a step time off the axis, None for one on it."""
        return "top" if ms > self.hi_ms else "bottom" if ms < self.lo_ms else None

    def edge_ms(self, side: str) -> float:
        """Where a step off the axis is drawn: just inside the ``"top"`` or ``"bottom"`` edge."""
        inset = (self.hi_ms - self.lo_ms) * _Y_MARGIN / 3
        return self.hi_ms - inset if side == "top" else self.lo_ms + inset


def y_range(times_ms: Sequence[float], lines_ms: Sequence[float] = ()) -> YRange | None:
    """The y axis for step times ``times_ms`` and horizontal lines ``lines_ms`` (the medians, always
    inside): clipped at the fences when a step time lies beyond them, else None (matplotlib's own)."""
    if len(times_ms) < 4:
        return None
    q1, _, q3 = statistics.quantiles(times_ms, n=4, method="inclusive")
    reach = max(OUTLIER_IQRS * (q3 - q1), MIN_FENCE * abs(statistics.median(times_ms)))
    shown = [t for t in times_ms if q1 - reach <= t <= q3 + reach] + [v for v in lines_ms if math.isfinite(v)]
    lo, hi = min(shown), max(shown)
    pad = (hi - lo) * _Y_MARGIN or abs(hi) * _Y_MARGIN or 1.0
    lo, hi = lo - pad, hi + pad
    above, below = sum(t > hi for t in times_ms), sum(t < lo for t in times_ms)
    if not (above or below):  # nothing beyond the fences, or only just (inside the margin)
        return None
    return YRange(lo_ms=lo, hi_ms=hi, above=above, below=below, max_ms=max(times_ms), min_ms=min(times_ms))


def _points(rows: Sequence[Mapping[str, Any]]) -> list[tuple[int | float, float, Mapping[str, Any]]]:
    """(step, step time in s, row) of every row that has both."""
    points = [(row.get("step"), step_time_of(row), row) for row in rows]
    return [(s, t, r) for s, t, r in points if _finite(s) and t is not None]  # type: ignore[misc]


def plot_text(rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any] | None) -> dict[str, Any]:
    """The words of ``tuning.png`` (title, axis labels, median lines, the clipped axis's note), so
    they can be checked without matplotlib. The x axis is the rows' ``step``: the tuner counts
    from 1, as the trainer's console does; the title is one line here and wrapped when drawn."""
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
        when = ", as recorded when it was tuned" if cache_hit else ""
        title += f" (winner {speedup:.2f}x vs the static plan{when})"
    what = _measured_what(rows)
    axis = y_range([t * 1e3 for _, t, _ in _points(rows)], [value * 1e3 for value, _, _ in medians])
    return {
        "title": title,
        "xlabel": "training step (from 1, as the console and trace.csv number them)",
        "ylabel": f"{what}, slowest local rank (ms)",
        "medians": medians,
        "y_range": axis,
        "note": axis.note() if axis is not None else None,
    }


def plot_trace(
    rows: Sequence[Mapping[str, Any]],
    summary: Mapping[str, Any] | None,
    path: str | os.PathLike[str],
) -> Path:
    """Draw step time per step, coloured by candidate, marker by phase, the winner marked, into
    the PNG file ``path`` (the figure: :func:`draw_trace`).

    Raises ImportError when matplotlib is not installed. Uses the Agg canvas directly, so the
    caller's pyplot backend and figures are untouched. Words: :func:`plot_text`.
    """
    out = Path(path)
    draw_trace(rows, summary).savefig(out, format="png")
    return out


def draw_trace(rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any] | None) -> Any:
    """The figure of :func:`plot_trace` (a matplotlib ``Figure`` on an Agg canvas, laid out)."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    text = plot_text(rows, summary)
    points = _points(rows)
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
    legend = legend[:_MAX_LEGEND]
    axis: YRange | None = text["y_range"]
    if axis is not None:
        ax.set_ylim(axis.lo_ms, axis.hi_ms)
        for side, marker in (("top", "^"), ("bottom", "v")):
            out = [(s, r) for s, t, r in points if axis.side_of(t * 1e3) == side]
            if out:  # just inside the edge, in the candidate's colour
                colors = [cmap(labels.index(_candidate_label(r)) % 20) for _, r in out]
                ax.scatter([s for s, _ in out], [axis.edge_ms(side)] * len(out), marker=marker, s=60, zorder=4,
                           color=colors, edgecolors="black")
        note = Line2D([], [], color="white", marker="^", markerfacecolor="white", markeredgecolor="black",
                      linestyle="none")
        legend.append((note, text["note"]))
    ax.set_title("\n".join(textwrap.wrap(text["title"], _TITLE_WIDTH)))
    ax.set_xlabel(text["xlabel"])
    ax.set_ylabel(text["ylabel"])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if legend:
        ax.legend([h for h, _ in legend], [n for _, n in legend], loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  fontsize=7, frameon=False)
    fig.tight_layout()
    return fig
