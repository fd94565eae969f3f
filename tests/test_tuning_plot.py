"""tuning.png: a stalled step does not hide the gap the plot exists to show, long titles fit,
steps are whole numbers counted as the trace counts them. Words through ``plot_text`` (no
matplotlib); the figure through ``draw_trace`` where matplotlib is installed."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

import pytest
from test_tuner_logic import Client, fake_fingerprint, make_space, table

from autotune import AutotuneConfig, OnlineTuner, TraceWriter
from autotune._plot import plot_text, y_range
from autotune._trace import read_rows

WINNER = {"threads": 4, "chunk_numel": 1 << 22}
BASELINE = {"threads": 8, "chunk_numel": 1 << 20}
SUMMARY = {"cache_hit": False, "winner": WINNER, "baseline": BASELINE, "speedup": 31.6 / 30.0,
           "winner_median_s": 0.0300, "baseline_median_s": 0.0316}


def rows_with_a_stall(n: int = 24, stall_ms: float = 92.0) -> list[dict]:
    """Static plan at ~31.6 ms and winner at ~30.0 ms, alternating, one step stalled."""
    rows = []
    for i in range(n):
        candidate, ms = (BASELINE, 31.6) if i % 2 == 0 else (WINNER, 30.0)
        ms += 0.1 * (i % 3)
        rows.append({"step": i + 1, "phase": "measure", "candidate": candidate, "node_time_s": ms / 1e3})
    rows[7]["node_time_s"] = stall_ms / 1e3
    return rows


def test_a_stalled_step_is_left_off_the_axis_so_the_gap_shows() -> None:
    text = plot_text(rows_with_a_stall(), SUMMARY)
    axis = text["y_range"]
    assert axis is not None and axis.above == 1 and axis.below == 0 and axis.hi_ms < 40.0
    gap = 31.6 - 30.0
    assert gap / (axis.hi_ms - axis.lo_ms) > 0.4  # with 92 ms on the axis it was under 0.03
    assert axis.lo_ms < 30.0 and axis.hi_ms > 31.6 + 0.2  # the medians and every other step stay on it
    assert "clipped" in text["note"] and "1 step above, up to 92.0 ms" in text["note"]


def test_steps_without_a_stall_keep_matplotlibs_own_axis() -> None:
    rows = rows_with_a_stall(stall_ms=31.7)
    text = plot_text(rows, SUMMARY)
    assert text["y_range"] is None and text["note"] is None
    # a slower candidate is no stall: a third of the steps at 45 ms keep their place
    slow = [{**r, "node_time_s": 0.045} if i % 3 == 0 else r for i, r in enumerate(rows)]
    assert plot_text(slow, SUMMARY)["y_range"] is None


def test_nearly_equal_steps_do_not_push_a_slightly_slower_one_off() -> None:
    times = [30.0] * 20 + [31.0]  # IQR 0: the fence is still 10% of the median away
    assert y_range(times) is None
    low = y_range([30.0] * 20 + [1.0])
    assert low is not None and low.below == 1 and low.above == 0 and low.lo_ms > 25.0
    assert "1 step below, down to 1.0 ms" in low.note()


def test_the_trace_and_the_plot_count_steps_from_1(tmp_path: Path) -> None:
    space = make_space(threads=(4, 8), chunks=(1 << 20,))
    client = Client(table({(4, 1 << 20): 0.030}, default=0.0316))
    trace = TraceWriter(tmp_path, plot=False)
    tuner = OnlineTuner(space, baseline={"threads": 8, "chunk_numel": 1 << 20}, apply=client.apply,
                        config=AutotuneConfig(probe_steps=40), clock=itertools.count().__next__,
                        trace=trace, fingerprint=fake_fingerprint)
    tuner.start()
    client.run(tuner, 40, until_locked=True)
    trace.close()
    steps = [r["step"] for r in read_rows(tmp_path)]
    assert steps == list(range(1, len(steps) + 1)) and tuner.summary()["probe_steps"] == len(steps)
    with open(tmp_path / "trace.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == steps
    chrome = [e["args"]["step"] for e in trace.chrome_trace()["traceEvents"] if e.get("cat") == "step"]
    assert sorted(set(chrome)) == steps
    pytest.importorskip("matplotlib", reason="tuning.png needs matplotlib (the [plot] extra)")
    from autotune._plot import draw_trace

    ax = draw_trace(read_rows(tmp_path), None).axes[0]
    drawn = sorted({float(x) for c in ax.collections for x, _ in c.get_offsets()})
    assert drawn == [float(s) for s in steps]


def test_a_long_title_fits_and_steps_are_whole_numbers() -> None:
    pytest.importorskip("matplotlib", reason="tuning.png needs matplotlib (the [plot] extra)")
    from autotune._plot import draw_trace

    rows = [{"step": s, "phase": "check", "candidate": WINNER, "node_time_s": 0.030 + 0.0001 * s} for s in (1, 2, 3)]
    summary = {**SUMMARY, "cache_hit": True}  # the longest title: a re-check, its recorded speed-up
    assert len(plot_text(rows, summary)["title"]) > 80
    fig = draw_trace(rows, summary)
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    title = ax.title.get_window_extent(renderer)
    page = fig.bbox
    assert page.x0 <= title.x0 and title.x1 <= page.x1 and title.y1 <= page.y1, (title, page)
    assert title.y0 >= ax.get_window_extent(renderer).y1 - 1  # above the axes, not over the points
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_the_clipped_axis_is_drawn_with_the_stall_on_its_edge() -> None:
    pytest.importorskip("matplotlib", reason="tuning.png needs matplotlib (the [plot] extra)")
    from autotune._plot import draw_trace

    rows = rows_with_a_stall()
    fig = draw_trace(rows, SUMMARY)
    ax = fig.axes[0]
    lo, hi = ax.get_ylim()
    axis = plot_text(rows, SUMMARY)["y_range"]
    assert (lo, hi) == pytest.approx((axis.lo_ms, axis.hi_ms)) and hi < 40.0
    shown = [(x, y) for c in ax.collections for x, y in c.get_offsets() if lo <= y <= hi]
    on_edge = [(x, y) for x, y in shown if y > 31.6 + 0.2 + 1e-6]  # above every step kept
    assert on_edge == [(8.0, pytest.approx(axis.edge_ms("top")))] and lo < axis.edge_ms("top") < hi
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("clipped" in label and "92.0 ms" in label for label in labels), labels
