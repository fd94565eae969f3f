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
from autotune.report._plot import OTHER_COLOUR, PALETTE, plot_text, y_range
from autotune.report._trace import read_rows

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
    from autotune.report._plot import draw_trace

    ax = draw_trace(read_rows(tmp_path), None).axes[0]
    drawn = sorted({float(x) for c in ax.collections for x, _ in c.get_offsets()})
    assert drawn == [float(s) for s in steps]


def test_a_long_title_fits_and_steps_are_whole_numbers() -> None:
    pytest.importorskip("matplotlib", reason="tuning.png needs matplotlib (the [plot] extra)")
    from matplotlib.text import Text

    from autotune.report._plot import draw_trace

    rows = [{"step": s, "phase": "check", "candidate": WINNER, "node_time_s": 0.030 + 0.0001 * s} for s in (1, 2, 3)]
    summary = {**SUMMARY, "cache_hit": True}  # the longest title: a re-check, its recorded speed-up
    assert len(plot_text(rows, summary)["title"]) > 80
    fig = draw_trace(rows, summary)
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    page = fig.bbox
    (suptitle,) = fig.findobj(lambda a: isinstance(a, Text) and a.get_text().startswith("Online tuning"))
    for text in (suptitle, ax.title):  # the figure's title and the panel's (what the panel shows)
        box = text.get_window_extent(renderer)
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and box.y1 <= page.y1, (text.get_text(), box, page)
        assert box.y0 >= ax.get_window_extent(renderer).y1 - 1  # above the axes, not over the points
    assert suptitle.get_window_extent(renderer).y0 >= ax.title.get_window_extent(renderer).y1 - 1
    assert ax.title.get_text().startswith("re-check of the cached choice")
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_the_clipped_axis_is_drawn_with_the_stall_on_its_edge() -> None:
    pytest.importorskip("matplotlib", reason="tuning.png needs matplotlib (the [plot] extra)")
    from autotune.report._plot import draw_trace

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


def a_tuning_run() -> list[dict]:
    """Every phase a tuning run writes: exploring, finals and duel, then (after the lock-in on
    step 10) two watch rounds; each stage with its warm-up step."""
    other = {"threads": 2, "chunk_numel": 1 << 22}
    phases = [("warmup", BASELINE), ("measure", BASELINE), ("warmup", WINNER), ("measure", WINNER),
              ("warmup", other), ("measure", other), ("final_warmup", WINNER), ("final", WINNER),
              ("final_warmup", BASELINE), ("final", BASELINE)]
    rows = [{"step": i + 1, "phase": ph, "candidate": c, "node_time_s": 0.030} for i, (ph, c) in enumerate(phases)]
    rows[-1]["decision"] = "locked threads=4 chunk_numel=4194304"
    for step, ph, c in ((60, "watch_warmup", BASELINE), (61, "watch", BASELINE), (62, "watch_warmup", WINNER),
                        (63, "watch", WINNER)):
        rows.append({"step": step, "phase": ph, "state": "locked", "candidate": c, "node_time_s": 0.031})
    return rows


def test_each_phase_has_its_own_marker_and_is_named_in_words() -> None:
    """A phase is told by shape (hollow for a warm-up), not by shade; the legend says which is which."""
    rows = a_tuning_run() + [{"step": 70, "phase": "probe", "candidate": WINNER, "node_time_s": 0.03}]
    text = plot_text(rows, SUMMARY)
    styles = {p.phase: p for p in text["phases"]}
    assert set(styles) == {r["phase"] for r in rows}
    assert len({(p.marker, p.filled) for p in styles.values()}) == len(styles)  # each phase its own marker
    for stage, warm in (("measure", "warmup"), ("final", "final_warmup"), ("watch", "watch_warmup")):
        assert styles[stage].marker == styles[warm].marker and styles[stage].filled and not styles[warm].filled
    assert len({styles[p].marker for p in ("measure", "final", "watch", "probe")}) == 4  # stages differ in shape
    legend = text["legend"]
    assert all(phase.words in legend for phase in styles.values())
    words = "\n".join(legend)
    for said in ("exploring", "finals and duel", "watch after lock-in", "warm-up step (not counted)", "phase probe"):
        assert said in words, said
    assert "final_warmup" not in words and "watch_warmup" not in words  # words, not field values
    assert any(row.startswith("shape = phase") for row in legend) and any(row.startswith("colour = ") for row in legend)
    # The winner is ringed, its phase marker kept; the lock-in splits the panels.
    assert any(row.startswith("ring: a step of the winner (chunk_numel=4194304, threads=4)") for row in legend)
    assert any("locked in threads=4 chunk_numel=4194304, from step 11 on" in row for row in legend)
    panels = plot_text(a_tuning_run(), SUMMARY)["panels"]
    assert [(lo, hi) for _, lo, hi in panels] == [(1, 10), (60, 63)]
    assert panels[0][0].startswith("probing") and panels[1][0].startswith("after lock-in")


def test_candidates_beyond_the_palette_are_grey_under_one_legend_row() -> None:
    """The fastest candidates (and always the winner and the static plan) get distinct colour-blind
    safe colours; the rest are grey, so the legend stays short."""
    n = len(PALETTE) + 4
    rows = [{"step": i + 1, "phase": "measure", "candidate": {"threads": 1 + i}, "node_time_s": (20 + i) / 1e3}
            for i in range(n)]
    summary = {"winner": {"threads": n}, "baseline": {"threads": n - 1}}  # the two slowest
    text = plot_text(rows, summary)
    candidates = text["candidates"]
    assert [c.median_ms for c in candidates] == sorted(c.median_ms for c in candidates)  # fastest first
    coloured = [c for c in candidates if c.colour != OTHER_COLOUR]
    assert len(coloured) == len(PALETTE) and len({c.colour for c in coloured}) == len(PALETTE)
    assert {c.label for c in coloured} >= {f"threads={n}", f"threads={n - 1}"}
    assert [c.label for c in coloured][:len(PALETTE) - 2] == [f"threads={i + 1}" for i in range(len(PALETTE) - 2)]
    legend = text["legend"]
    assert f"{n - len(PALETTE)} slower candidates (grey)" in legend
    assert f"threads={n}: {20 + n - 1:.2f} ms median of 1 (winner)" in legend
    assert sum(row.startswith("threads=") for row in legend) == len(PALETTE)


def test_a_kept_static_plan_is_said_once_and_in_the_title() -> None:
    rows = a_tuning_run()
    text = plot_text(rows, {**SUMMARY, "winner": BASELINE, "kept_baseline": True, "speedup": 1.0,
                            "winner_median_s": 0.0316, "baseline_median_s": 0.0316})
    assert "kept the static plan chunk_numel=1048576, threads=8" in text["title"]
    assert [name for _, _, name in text["medians"]] == ["winner median = static plan median"]
    (static,) = [c for c in text["candidates"] if c.static_plan]
    assert static.winner and "(winner, static plan)" in static.words()


def test_the_drawn_legend_is_plot_texts_and_the_watch_has_its_own_panel() -> None:
    pytest.importorskip("matplotlib", reason="tuning.png needs matplotlib (the [plot] extra)")
    from autotune.report._plot import draw_trace

    rows = a_tuning_run()
    fig = draw_trace(rows, SUMMARY)
    text = plot_text(rows, SUMMARY)
    probing, watch = fig.axes
    assert [t.get_text() for t in watch.get_legend().get_texts()] == text["legend"]
    assert probing.get_title() == text["panels"][0][0] and watch.get_title().startswith("after lock-in")
    steps = {ax: {float(x) for c in ax.collections for x, _ in c.get_offsets()} for ax in fig.axes}
    assert steps[probing] == set(map(float, range(1, 11))) and steps[watch] == {60.0, 61.0, 62.0, 63.0}
    assert probing.get_shared_y_axes().joined(probing, watch)
