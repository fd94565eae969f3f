"""``tuning.png``: a tuning run's step times per step; colour tells the candidate, marker shape the
phase, a ring the winner.

Drawn from the rows and summary a :class:`~autotune.TraceWriter` keeps (``trace.jsonl``,
``summary.json``), by the writer itself at close and by ``python -m autotune plot``. matplotlib
is imported only here, lazily, and only its Agg canvas is used (no pyplot state is touched); the
words of the figure, its legend's included, are :func:`plot_text`, so tests check them without
matplotlib.

Why the y axis is clipped: the plot exists to show gaps of a few percent between candidates (1.6 ms
at 30 ms a step), and one stalled step (a checkpoint, a page-in: 92 ms) would stretch a linear
axis until that gap is a pixel; a log axis would still leave it at a few pixels. So step times
beyond Tukey's far-out fences (:data:`OUTLIER_IQRS` IQRs past the quartiles) are left off the axis
and drawn as arrows on its edge, and a legend row says how many there were and how far out.

Why shapes and a short palette: the README's first run drew 6 candidates in tab20's light/dark
pairs and starred the winner's points over their phase markers; two blues or two oranges could not
be told apart, nor the winner's warm-up from its measured steps. Now the phase is the marker
(shape; hollow for a warm-up step, which no decision counts) and, after the lock-in, a second
panel; candidates take Okabe and Ito's colour-blind-safe colours (:data:`PALETTE`), the fastest
first, and beyond those the rest are grey under one legend row; the winner's steps are ringed and
its median drawn as a line, so the marker inside still shows the phase.
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

__all__ = [
    "PALETTE", "STEP_TIME_KEYS", "CandidateStyle", "PhaseStyle", "YRange", "draw_trace", "plot_text", "plot_trace",
    "step_time_of", "y_range",
]

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
#: Title characters per line: fits above the axes beside the legend (12 in wide figure, 12 pt).
_TITLE_WIDTH = 80
#: Candidate colours: Okabe and Ito's colour-blind-safe set (blue, orange, bluish green, reddish
#: purple, vermillion, sky blue), without its yellow (faint on white) and black (the winner's
#: ring and median line). More candidates than colours: the fastest keep one, the rest are grey.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9")
OTHER_COLOUR = "#a0a0a0"
#: Each phase a tuner row may carry: (marker, filled, words). A stage keeps one shape; its warm-up
#: steps (run so the setting settles, never counted) are the hollow form of it.
_PHASES: dict[str, tuple[str, bool, str]] = {
    "warmup": ("o", False, "exploring: warm-up step (not counted)"),
    "measure": ("o", True, "exploring: each candidate measured in turn"),
    "final_warmup": ("s", False, "finals and duel: warm-up step (not counted)"),
    "final": ("s", True, "finals and duel: paired rounds of the best vs the static plan"),
    "check_warmup": ("D", False, "re-check of the cached choice: warm-up step (not counted)"),
    "check": ("D", True, "re-check: the cached choice vs the static plan, paired"),
    "watch_warmup": ("^", False, "watch after lock-in: warm-up step (not counted)"),
    "watch": ("^", True, "watch after lock-in: winner vs runner-up and static plan"),
    "watch_pulse": ("v", True, "watch after lock-in: a pulse, the winner alone"),
    "locked": ("P", True, "locked in: a step of the winner"),
}
#: Markers for phases a client of the tuner named itself, in order of appearance.
_OTHER_MARKERS = ("<", ">", "h", "X", "*", "p", "8")


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


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseStyle:
    """How tuning.png draws the steps of one phase (the rows' ``phase``)."""

    phase: str
    marker: str
    """A matplotlib marker: one shape per stage (exploring, finals and duel, re-check, watch)."""
    filled: bool
    """False for a warm-up step (drawn hollow, in the candidate's colour)."""
    words: str
    """Its legend row."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CandidateStyle:
    """How tuning.png draws one candidate's steps, and what its legend row says."""

    label: str
    colour: str
    """A :data:`PALETTE` colour, or :data:`OTHER_COLOUR` (grey) beyond the palette's length."""
    median_ms: float | None
    """Median of its measured steps (warm-ups left out), in ms; None when it has none."""
    n: int
    """Its measured steps."""
    winner: bool = False
    static_plan: bool = False

    def words(self) -> str:
        median = f"{self.median_ms:.2f} ms median of {self.n}" if self.median_ms is not None else "warm-up only"
        roles = [r for r, on in (("winner", self.winner), ("static plan", self.static_plan)) if on]
        return f"{self.label}: {median}" + (f" ({', '.join(roles)})" if roles else "")


def _points(rows: Sequence[Mapping[str, Any]]) -> list[tuple[int | float, float, Mapping[str, Any]]]:
    """(step, step time in s, row) of every row that has both."""
    points = [(row.get("step"), step_time_of(row), row) for row in rows]
    return [(s, t, r) for s, t, r in points if _finite(s) and t is not None]  # type: ignore[misc]


def _phase(row: Mapping[str, Any]) -> str:
    return str(row.get("phase", ""))


def _phase_styles(points: Sequence[tuple[Any, float, Mapping[str, Any]]]) -> list[PhaseStyle]:
    present = list(dict.fromkeys(_phase(r) for _, _, r in points))
    known = [p for p in _PHASES if p in present]  # the tuner's order, not the rows'
    styles = [PhaseStyle(phase=p, marker=_PHASES[p][0], filled=_PHASES[p][1], words=_PHASES[p][2]) for p in known]
    others = [p for p in present if p not in _PHASES]
    for i, phase in enumerate(others):
        warm = phase.endswith("warmup")
        styles.append(PhaseStyle(phase=phase, marker=_OTHER_MARKERS[i % len(_OTHER_MARKERS)], filled=not warm,
                                 words=f"phase {phase or '(none)'}" + (" (not counted)" if warm else "")))
    return styles


def _candidate_styles(points: Sequence[tuple[Any, float, Mapping[str, Any]]],
                      summary: Mapping[str, Any] | None) -> list[CandidateStyle]:
    """The candidates, fastest median first; the winner and the static plan always coloured."""
    roles = {}
    for key in ("winner", "baseline"):
        value = summary.get(key) if summary else None
        roles[key] = _candidate_label({"candidate": value}) if isinstance(value, Mapping) else None
    measured: dict[str, list[float]] = {}
    for _, t, row in points:
        times = measured.setdefault(_candidate_label(row), [])
        if not _phase(row).endswith("warmup"):
            times.append(t * 1e3)
    order = sorted(measured, key=lambda c: statistics.median(measured[c]) if measured[c] else math.inf)
    coloured = [c for c in (roles["winner"], roles["baseline"]) if c in measured]
    coloured = list(dict.fromkeys(coloured + order))[: len(PALETTE)]
    colours = dict(zip([c for c in order if c in coloured], PALETTE))
    return [
        CandidateStyle(label=c, colour=colours.get(c, OTHER_COLOUR), n=len(measured[c]),
                       median_ms=statistics.median(measured[c]) if measured[c] else None,
                       winner=c == roles["winner"], static_plan=c == roles["baseline"])
        for c in order
    ]


def _decisions(points: Sequence[tuple[Any, float, Mapping[str, Any]]]) -> list[tuple[int, str]]:
    """(step, words) of each row that locked in or switched: the step after it runs the choice."""
    out = []
    for step, _, row in points:
        words = row.get("decision")
        if isinstance(words, str) and words:
            for verb, said in (("locked ", "locked in"), ("switched to ", "switched to")):
                if words.startswith(verb):
                    words = f"{said} {words[len(verb):]}"
            out.append((int(step), f"{words}, from step {int(step) + 1} on"))
    return out


def _panels(points: Sequence[tuple[Any, float, Mapping[str, Any]]], lock_in: int | None) -> list[tuple[str, int, int]]:
    """(title, first step, last step) of each panel: the tuning up to the lock-in, and what the rows
    show after it (the watch's rounds; the steps between them run the winner and are not traced)."""
    steps = [int(s) for s, _, _ in points]
    if not steps:
        return [("no steps", 0, 0)]
    split = lock_in if lock_in is not None and any(s > lock_in for s in steps) else max(steps)
    before = [s for s in steps if s <= split] or [split]
    checking = any(_phase(r).startswith("check") for s, _, r in points if s <= split)
    name = "re-check of the cached choice" if checking else "probing"
    ends = f", locked in after step {lock_in}" if lock_in is not None and lock_in <= split else ""
    panels = [(f"{name} (steps {min(before)}-{max(before)}{ends})", min(before), max(before))]
    after = [s for s in steps if s > split]
    if after:
        panels.append((f"after lock-in (steps {min(after)}-{max(after)}): the winner runs; only the watch's "
                       "rounds are traced", min(after), max(after)))
    return panels


def _legend(text: Mapping[str, Any]) -> list[tuple[dict[str, Any], str, bool]]:
    """(matplotlib Line2D keywords, words, is a heading) of each legend row: the words are in
    :func:`plot_text`'s ``legend``, the keywords make the handle without importing matplotlib here."""
    blank = {"linestyle": "none", "marker": "none"}
    candidates: list[CandidateStyle] = text["candidates"]
    rows: list[tuple[dict[str, Any], str, bool]] = [(blank, "colour = candidate (median of its measured steps)", True)]
    for c in candidates:
        if c.colour != OTHER_COLOUR:
            rows.append(({"color": c.colour, "linewidth": 6}, c.words(), False))
    grey = [c for c in candidates if c.colour == OTHER_COLOUR]
    if grey:
        rows.append(({"color": OTHER_COLOUR, "linewidth": 6}, f"{len(grey)} slower candidates (grey)", False))
    rows.append((blank, "shape = phase (hollow: warm-up step)", True))
    for p in text["phases"]:
        face = "dimgrey" if p.filled else "none"
        rows.append(({"linestyle": "none", "marker": p.marker, "markerfacecolor": face, "markeredgecolor": "dimgrey",
                      "markersize": 7}, p.words, False))
    rows.append((blank, "lines and marks", True))
    winner = next((c for c in candidates if c.winner), None)
    if winner is not None:
        rows.append(({"linestyle": "none", "marker": "o", "markersize": 11, "markerfacecolor": "none",
                      "markeredgecolor": "black"}, f"ring: a step of the winner ({winner.label})", False))
    for _, style, name in text["medians"]:
        colour = "black" if name.startswith("winner") else "grey"
        rows.append(({"color": colour, "linestyle": style, "linewidth": 1.2}, name, False))
    for step, words in text["decisions"]:
        rows.append(({"color": "black", "linestyle": ":", "linewidth": 1.2}, words, False))
    if text["note"] is not None:
        rows.append(({"linestyle": "none", "marker": r"$\uparrow$", "color": "black", "markersize": 8},
                     text["note"], False))
    return rows[:_MAX_LEGEND]


def plot_text(rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any] | None) -> dict[str, Any]:
    """The words of ``tuning.png`` and what each mark stands for, so they can be checked without
    matplotlib: title, axis labels, median lines, the clipped axis's note, ``phases`` (a
    :class:`PhaseStyle` per phase in the rows), ``candidates`` (a :class:`CandidateStyle` each,
    fastest first), ``decisions`` (the lock-in and any switch), ``panels`` and ``legend`` (its rows'
    words, headings included). The x axis is the rows' ``step``: the tuner counts from 1, as the
    trainer's console does; the title is one line here and wrapped when drawn."""
    points = _points(rows)
    cache_hit = bool(summary.get("cache_hit")) if summary else False
    recorded = " (recorded when it was tuned)" if cache_hit else ""
    candidates = _candidate_styles(points, summary)
    winner = next((c.label for c in candidates if c.winner), None)
    kept = winner is not None and any(c.winner and c.static_plan for c in candidates)
    medians = []
    for key, style, name in (("winner_median_s", "-", "winner median"),
                             ("baseline_median_s", "--", "static plan median")):
        value = summary.get(key) if summary else None
        if _finite(value) and not (kept and key == "baseline_median_s"):
            medians.append((value, style, name + (" = static plan median" if kept else "") + recorded))
    title = "Online tuning: " + ("re-check of the cached choice" if cache_hit else "step time per step")
    speedup = summary.get("speedup") if summary else None
    if kept and not cache_hit:
        title += f" (kept the static plan {winner}: no candidate was clearly faster)"
    elif _finite(speedup):
        when = ", as recorded when it was tuned" if cache_hit else ""
        title += f" (winner {winner + ', ' if winner else ''}{speedup:.2f}x vs the static plan{when})"
    what = _measured_what(rows)
    axis = y_range([t * 1e3 for _, t, _ in points], [value * 1e3 for value, _, _ in medians])
    decisions = _decisions(points)
    first = decisions[0][0] if decisions else None
    lock_in = next((s for s, words in decisions if words.startswith("locked in")), first)
    text: dict[str, Any] = {
        "title": title,
        "xlabel": "training step (from 1, as the console and trace.csv number them)",
        "ylabel": f"{what}, slowest local rank (ms)",
        "medians": medians,
        "y_range": axis,
        "note": axis.note() if axis is not None else None,
        "phases": _phase_styles(points),
        "candidates": candidates,
        "decisions": decisions,
        "panels": _panels(points, lock_in),
    }
    text["legend"] = [words for _, words, _ in _legend(text)]
    return text


def plot_trace(
    rows: Sequence[Mapping[str, Any]],
    summary: Mapping[str, Any] | None,
    path: str | os.PathLike[str],
) -> Path:
    """Draw step time per step (colour: candidate, shape: phase, ring: the winner) into the PNG
    file ``path`` (the figure: :func:`draw_trace`).

    Raises ImportError when matplotlib is not installed. Uses the Agg canvas directly, so the
    caller's pyplot backend and figures are untouched. Words: :func:`plot_text`.
    """
    out = Path(path)
    draw_trace(rows, summary).savefig(out, format="png")
    return out


def draw_trace(rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any] | None) -> Any:
    """The figure of :func:`plot_trace` (a matplotlib ``Figure`` on an Agg canvas, laid out): one
    panel up to the lock-in and, when rows follow it (the watch), a second one sharing its y axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    text = plot_text(rows, summary)
    points = _points(rows)
    axis: YRange | None = text["y_range"]
    colour = {c.label: c.colour for c in text["candidates"]}
    winner = next((c.label for c in text["candidates"] if c.winner), None)
    phases = {p.phase: p for p in text["phases"]}
    panels = text["panels"]

    fig = Figure(figsize=(12, 5.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    counts = [sum(lo <= s <= hi for s, _, _ in points) for _, lo, hi in panels]
    widths = [1.0] + [min(max(n / max(counts[0], 1), 0.35), 1.0) for n in counts[1:]]
    grid = fig.add_gridspec(1, len(panels), width_ratios=widths)
    axes = [fig.add_subplot(grid[0, 0])]
    axes += [fig.add_subplot(grid[0, i], sharey=axes[0]) for i in range(1, len(panels))]
    for ax, width, (panel, lo, hi) in zip(axes, widths, panels):
        mine = [(s, t, r) for s, t, r in points if lo <= s <= hi]
        on_axis = [(s, t * 1e3, r) for s, t, r in mine if axis is None or axis.side_of(t * 1e3) is None]
        # Grey (slower) candidates first, so the coloured ones are drawn over them.
        for label in sorted(colour, key=lambda c: colour[c] != OTHER_COLOUR):
            for phase in phases.values():
                sel = [(s, ms) for s, ms, r in on_axis if _candidate_label(r) == label and _phase(r) == phase.phase]
                if sel:
                    ax.scatter([s for s, _ in sel], [ms for _, ms in sel], marker=phase.marker, s=34, zorder=3,
                               facecolors=colour[label] if phase.filled else "none", edgecolors=colour[label],
                               linewidths=1.3)
        ring = [(s, ms) for s, ms, r in on_axis if _candidate_label(r) == winner]
        if ring:  # around the marker, so its shape (the phase) still shows
            ax.scatter([s for s, _ in ring], [ms for _, ms in ring], marker="o", s=150, facecolors="none",
                       edgecolors="black", linewidths=1.0, zorder=2)
        if axis is not None:
            for side, marker in (("top", r"$\uparrow$"), ("bottom", r"$\downarrow$")):
                out = [(s, r) for s, t, r in mine if axis.side_of(t * 1e3) == side]
                if out:  # just inside the edge, in the candidate's colour
                    ax.scatter([s for s, _ in out], [axis.edge_ms(side)] * len(out), marker=marker, s=90, zorder=4,
                               color=[colour[_candidate_label(r)] for _, r in out])
        for value, style, line in text["medians"]:
            ax.axhline(value * 1e3, linestyle=style, color="black" if line.startswith("winner") else "grey",
                       linewidth=1.2, zorder=1)
        for step, _ in text["decisions"]:
            if lo <= step <= hi:
                ax.axvline(step + 0.5, linestyle=":", color="black", linewidth=1.2)
        wrap = max(30, int(_TITLE_WIDTH * 1.4 * width / sum(widths)))  # characters that fit over this panel
        ax.set_title("\n".join(textwrap.wrap(panel, wrap)), fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=max(3, round(9 * width)), integer=True))
        ax.grid(True, alpha=0.3)
    if axis is not None:
        axes[0].set_ylim(axis.lo_ms, axis.hi_ms)
    for ax in axes[1:]:
        ax.tick_params(labelleft=True)
    fig.suptitle("\n".join(textwrap.wrap(text["title"], _TITLE_WIDTH)))
    if len(axes) == 1:
        axes[0].set_xlabel(text["xlabel"])
    else:
        fig.supxlabel(text["xlabel"], fontsize=10)
    axes[0].set_ylabel(text["ylabel"])
    entries = _legend(text)
    legend = axes[-1].legend([Line2D([], [], **spec) for spec, _, _ in entries], [w for _, w, _ in entries],
                             loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7.5, frameon=False)
    for label, (_, _, heading) in zip(legend.get_texts(), entries):
        if heading:
            label.set_fontweight("bold")
    fig.draw_without_rendering()  # lays it out, so callers may measure it
    return fig
