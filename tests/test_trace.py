"""TraceWriter: every exported file parses and says what the tuner saw."""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from autotune import TraceWriter

REPO = Path(__file__).resolve().parents[1]
WINNER = {"threads": 2, "chunk_numel": 1 << 20}
BASELINE = {"threads": 1, "chunk_numel": 1 << 22}


def strict_json(text: str):
    def refuse(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def stage_spans(chunks: int, scale: float = 1.0, offset: float = 0.0) -> list[tuple[str, int, float, float]]:
    spans = []
    for c in range(chunks):
        t = offset + c * 0.010 * scale
        spans += [
            ("d2h", c, t, t + 0.002 * scale),
            ("adam_kernel", c, t + 0.002 * scale, t + 0.008 * scale),
            ("materialize", c, t + 0.008 * scale, t + 0.010 * scale),
        ]
    return spans


def run_rows() -> list[dict]:
    rows = []
    for step in range(12):
        candidate = BASELINE if step < 6 else WINNER
        phase = "probe" if step < 9 else "locked"
        t0, t1 = (0.030, 0.033) if candidate is BASELINE else (0.020, 0.021)
        rows.append({
            "step": step,
            "phase": phase,
            "candidate": candidate,
            "ranks": {"0": {"step_s": t0, "drain_s": t0 / 2}, "1": {"step_s": t1, "drain_s": t1 / 2}},
            "node_time_s": max(t0, t1),
            "decision": "lock-in" if step == 8 else None,
        })
    return rows


SUMMARY = {
    "state": "locked",
    "baseline": BASELINE,
    "winner": WINNER,
    "baseline_median_s": 0.033,
    "winner_median_s": 0.021,
    "probe_steps": 9,
    "cache_hit": False,
    "fingerprint": "ab" * 32,
}


def write_run(directory: Path, *, plot: bool = True, start_times: bool = False) -> TraceWriter:
    writer = TraceWriter(directory, rank=0, plot=plot)
    for row in run_rows():
        writer.add_step(row)
        scale = 1.0 if row["candidate"] is BASELINE else 0.6
        for rank in (0, 1):
            start = {"step_start_s": 100.0 + row["step"] * 0.05} if start_times else {}
            # rank 1 overlaps its first chunk with backward (negative start)
            writer.add_spans(rank, row["step"], stage_spans(3, scale, offset=-0.004 * rank), **start)
    writer.write_summary(SUMMARY)
    writer.close()
    return writer


def test_jsonl_and_csv_rows(tmp_path: Path) -> None:
    write_run(tmp_path, plot=False)
    lines = (tmp_path / "trace.jsonl").read_text().splitlines()
    rows = [strict_json(line) for line in lines]
    assert rows == run_rows()
    with open(tmp_path / "trace.csv", newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames
        table = list(reader)
    for column in ("step", "phase", "candidate.threads", "candidate.chunk_numel", "ranks.0.step_s",
                   "ranks.1.drain_s", "node_time_s", "decision"):
        assert column in header, column
    assert len(table) == 12
    assert [int(r["step"]) for r in table] == list(range(12))
    assert float(table[7]["ranks.1.step_s"]) == pytest.approx(0.021)
    assert table[8]["decision"] == "lock-in" and table[0]["decision"] == ""
    assert table[9]["phase"] == "locked"


def test_chrome_trace_events(tmp_path: Path) -> None:
    write_run(tmp_path, plot=False)
    doc = strict_json((tmp_path / "trace.chrome.json").read_text())
    assert doc["displayTimeUnit"] == "ms"
    events = doc["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    meta = [e for e in events if e["ph"] == "M"]
    for e in complete:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid"} <= set(e)
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
        assert e["dur"] >= 0 and isinstance(e["pid"], int) and isinstance(e["tid"], int)
    stages = [e for e in complete if e["cat"] == "stage"]
    assert len(stages) == 12 * 2 * 3 * 3  # steps x ranks x chunks x stages
    assert {e["pid"] for e in stages} == {0, 1}
    assert {e["name"] for e in stages} == {"d2h", "adam_kernel", "materialize"}
    # one lane (tid) per stage, named by thread_name metadata; one process_name per rank
    lanes = {(e["pid"], e["tid"]): e["name"] for e in stages}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    for key, stage in lanes.items():
        assert names[key] == stage
    assert {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"} == {0: "rank 0", 1: "rank 1"}
    # durations are the spans' durations in microseconds
    d2h0 = [e for e in stages if e["args"] == {"step": 0, "chunk": 0} and e["name"] == "d2h" and e["pid"] == 0]
    assert d2h0[0]["dur"] == pytest.approx(2000.0)
    # steps are laid out one after the other and never overlap, rank by rank
    step_events = sorted((e for e in complete if e["cat"] == "step" and e["pid"] == 1), key=lambda e: e["args"]["step"])
    assert [e["args"]["step"] for e in step_events] == list(range(12))
    for a, b in zip(step_events, step_events[1:]):
        assert a["ts"] + a["dur"] <= b["ts"]
    assert step_events[8]["args"]["decision"] == "lock-in"
    assert step_events[8]["args"]["candidate"] == WINNER
    # within a step, the spans keep their relative times (rank 1 starts 4 ms earlier)
    s0 = {e["pid"]: e["ts"] for e in stages if e["args"] == {"step": 3, "chunk": 0} and e["name"] == "d2h"}
    assert s0[0] - s0[1] == pytest.approx(4000.0)


def test_chrome_trace_uses_real_step_starts_when_given(tmp_path: Path) -> None:
    write_run(tmp_path, plot=False, start_times=True)
    doc = strict_json((tmp_path / "trace.chrome.json").read_text())
    stages = [e for e in doc["traceEvents"] if e.get("cat") == "stage"]
    first = min(stages, key=lambda e: e["ts"])
    assert first["ts"] == pytest.approx(0.0) and first["pid"] == 1  # rank 1 started during backward
    s5 = [e for e in stages if e["args"] == {"step": 5, "chunk": 0} and e["name"] == "d2h" and e["pid"] == 0]
    assert s5[0]["ts"] == pytest.approx((5 * 0.05 + 0.004) * 1e6)


def test_summary_json(tmp_path: Path) -> None:
    write_run(tmp_path, plot=False)
    summary = strict_json((tmp_path / "summary.json").read_text())
    for key in ("baseline", "winner", "speedup", "probe_steps", "cache_hit", "fingerprint"):
        assert key in summary, key
    assert summary["winner"] == WINNER and summary["baseline"] == BASELINE
    assert summary["speedup"] == pytest.approx(0.033 / 0.021)
    assert summary["cache_hit"] is False and summary["probe_steps"] == 9


def test_png_when_matplotlib_is_installed(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="tuning.png needs matplotlib (the [plot] extra)")
    write_run(tmp_path, plot=True)
    png = tmp_path / "tuning.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 5000
    write_run(tmp_path / "noplot", plot=False)
    assert not (tmp_path / "noplot" / "tuning.png").exists()


def test_matplotlib_is_not_imported_with_the_package() -> None:
    code = (
        "import sys, autotune, autotune.report._trace, autotune.cache._cache, autotune.cache._fingerprint\n"
        "import autotune.report._cli\n"
        "print('matplotlib' in sys.modules)\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_non_finite_and_odd_values_become_valid_json(tmp_path: Path) -> None:
    import numpy as np

    @dataclass(frozen=True)
    class Span:
        stage: str
        chunk: int
        start_s: float
        end_s: float

    with TraceWriter(tmp_path, plot=False) as writer:
        writer.add_step({"step": 0, "phase": "probe", "candidate": {"threads": np.int64(2)},
                         "node_time_s": float("nan"), "ranks": [{"step_s": np.float32(0.5)}], "tag": ("a", "b")})
        writer.add_spans(0, 0, [Span("d2h", 0, 0.0, 0.001), Span("adam_kernel", 0, 0.001, float("inf"))])
    row = strict_json((tmp_path / "trace.jsonl").read_text())
    assert row["node_time_s"] is None
    assert row["candidate"] == {"threads": 2} and row["tag"] == ["a", "b"]
    assert row["ranks"][0]["step_s"] == pytest.approx(0.5)
    doc = strict_json((tmp_path / "trace.chrome.json").read_text())
    assert [e["name"] for e in doc["traceEvents"] if e.get("cat") == "stage"] == ["d2h"]


def test_other_ranks_write_their_own_files(tmp_path: Path) -> None:
    with TraceWriter(tmp_path, rank=0, plot=False) as w0, TraceWriter(tmp_path, rank=1, plot=False) as w1:
        w0.add_step({"step": 0, "node_time_s": 1.0})
        w1.add_step({"step": 0, "node_time_s": 2.0})
        w1.add_spans(1, 0, stage_spans(1))
    assert strict_json((tmp_path / "trace.jsonl").read_text())["node_time_s"] == 1.0
    assert strict_json((tmp_path / "trace.rank1.jsonl").read_text())["node_time_s"] == 2.0
    assert (tmp_path / "trace.rank1.chrome.json").exists() and (tmp_path / "trace.rank1.csv").exists()


def test_unwritable_directory_warns_and_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING):
        writer = TraceWriter(blocker / "run")
        writer.add_step({"step": 0, "node_time_s": 1.0})
        writer.add_spans(0, 0, stage_spans(1))
        writer.write_summary(SUMMARY)
        writer.close()
        writer.close()  # idempotent
    warnings = [r for r in caplog.records if r.name == "autotune.report._trace" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "disabled" in warnings[0].getMessage()


def test_span_cap(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), TraceWriter(tmp_path, plot=False, max_spans=10) as writer:
        for step in range(3):
            writer.add_spans(0, step, stage_spans(2))  # 6 spans a step
    doc = strict_json((tmp_path / "trace.chrome.json").read_text())
    assert len([e for e in doc["traceEvents"] if e.get("cat") == "stage"]) == 10
    assert doc["otherData"]["dropped_spans"] == 8
    assert sum("at most" in r.getMessage() for r in caplog.records) == 1


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rank"):
        TraceWriter(tmp_path, rank=-1)
    with pytest.raises(ValueError, match="max_spans=-1"):
        TraceWriter(tmp_path, max_spans=-1)
    writer = TraceWriter(tmp_path, plot=False)
    with pytest.raises(TypeError, match="row"):
        writer.add_step([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step"):
        writer.add_spans(0, 1.5, [])  # type: ignore[arg-type]
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.add_step({"step": 1})


def test_a_new_run_in_the_same_directory_starts_clean(tmp_path: Path) -> None:
    write_run(tmp_path, plot=False)
    with TraceWriter(tmp_path, plot=False) as writer:
        writer.add_step({"step": 0, "node_time_s": 1.0})
    assert not (tmp_path / "summary.json").exists()
    assert len((tmp_path / "trace.jsonl").read_text().splitlines()) == 1
    with open(tmp_path / "trace.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 1


def test_a_writer_nobody_closes_is_closed_at_exit(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from autotune.report._trace import TraceWriter\n"
        "w = TraceWriter(sys.argv[1], plot=False)\n"
        "w.add_step({'step': 0, 'phase': 'probe', 'node_time_s': 0.5})\n"
        "w.add_spans(0, 0, [('d2h', 0, 0.0, 0.1)])\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, cwd=REPO, timeout=120, check=True)
    with open(tmp_path / "trace.csv", newline="") as f:
        assert [r["node_time_s"] for r in csv.DictReader(f)] == ["0.5"]
    doc = strict_json((tmp_path / "trace.chrome.json").read_text())
    assert [e["name"] for e in doc["traceEvents"] if e.get("cat") == "stage"] == ["d2h"]


def test_plot_words_match_the_console_and_the_objective() -> None:
    """tuning.png reads on its own: steps from 1, what the y axis measures, "static plan"."""
    from autotune.report._trace import plot_text

    rows = [{"step": 0, "phase": "probe", "node_time_s": 0.02,
             "ranks": {"0": {"time_s": 0.02, "iteration_s": 0.02, "step_s": 0.01}}}]
    summary = {"cache_hit": False, "speedup": 1.5, "winner_median_s": 0.02, "baseline_median_s": 0.03}
    text = plot_text(rows, summary)
    assert "from 1" in text["xlabel"] and text["ylabel"].startswith("training iteration time")
    assert "static plan" in text["title"] and "baseline" not in str(text)
    assert [name for _, _, name in text["medians"]] == ["winner median", "static plan median"]
    rows[0]["ranks"]["0"]["time_s"] = 0.01  # the objective was the optimizer step
    assert plot_text(rows, summary)["ylabel"].startswith("optimizer step time")
    hit = plot_text(rows, {**summary, "cache_hit": True})
    assert "re-check" in hit["title"] and all("recorded" in name for _, _, name in hit["medians"])


def test_a_cache_hit_plot_draws_its_check_steps(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="tuning.png needs matplotlib (the [plot] extra)")
    from autotune.report._trace import plot_trace

    rows = [{"step": i, "phase": "check_warmup" if i == 0 else "check", "candidate": WINNER,
             "node_time_s": 0.02 + 0.001 * i} for i in range(4)]
    png = plot_trace(rows, {"cache_hit": True, "winner": WINNER, "winner_median_s": 0.021}, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
