"""What ``bench.train`` prints: its figures named once before the first step line, and a tuner's
lock-in on the step line that triggered it, so that line's own setting never contradicts it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.train import _main as train
from bench.train._summary import format_step, locked_setting, step_legend

TINY = ["--model-size", "tiny", "--device", "cpu", "--batch-size", "4", "--seq-len", "32"]
STATS = {"step_s": 0.0294, "d2h_s": 0.001, "adam_kernel_s": 0.02, "materialize_s": 0.002, "drain_s": 0.025}

pytestmark = pytest.mark.usefixtures("isolated_trainer")


def test_the_legend_names_opt_and_step_once() -> None:
    legend = step_legend(offloaded=True)
    assert "opt = the trainer's wall time of clip + opt.step()" in legend
    assert "step() = StepStats.step_s" in legend and "the setting that step ran with" in legend
    assert "StepStats" not in step_legend(offloaded=False)  # the stock optimizer has none
    line = format_step(3, 20, 4.5, 0.0512, 0.0397, STATS, (4, 1048576))
    assert "| opt     39.7 ms (d2h 1.0 adam 20.0 mat 2.0 drain 25.0 step() 29.4) |" in line


def test_a_lock_in_is_reported_on_its_step_line_as_the_next_steps_setting() -> None:
    tuner = SimpleNamespace(state="probing", current={"threads": 4, "chunk_numel": 1048576})
    opt = SimpleNamespace(tuner=tuner)
    assert locked_setting(opt, False) == (None, False)
    tuner.state, tuner.current = "locked", {"threads": 4, "chunk_numel": 8388608}
    locked, was_locked = locked_setting(opt, False)
    assert locked == {"threads": 4, "chunk_numel": 8388608} and was_locked
    assert locked_setting(opt, was_locked) == (None, True)  # said once
    line = format_step(16, 40, 4.2, 0.04, 0.03, STATS, (4, 1048576), locked=locked)
    assert line.endswith("| threads 4 chunk 1048576 | tuner locked in threads 4 chunk 8388608: from the next step")
    assert locked_setting(SimpleNamespace(), False) == (None, False)  # the stock optimizer: no tuner


def test_run_prints_the_legend_first_and_the_lock_in_where_it_happened(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The default probe budget (40 steps and the finals) locks in well before step 90; a cache of
    # this test's own keeps a cached choice from skipping the probing.
    out, n = tmp_path / "s.json", 90
    assert train.main([*TINY, "--optim-cpu-offload", "--autotune", "--steps", str(n), "--trace-dir",
                       str(tmp_path / "t"), "--cache", str(tmp_path / "cache.json"), "--summary-json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    steps = [i for i, line in enumerate(lines) if line.startswith("step ") and f"/{n} |" in line]
    legend = [i for i, line in enumerate(lines) if line.startswith("per step: step = ")]
    assert len(steps) == n and len(legend) == 1 and legend[0] < steps[0]
    assert any("StepStats medians: step() " in line for line in lines)
    assert not any("optimizer stage medians" in line for line in lines)

    ran = [json.loads(row) for row in (tmp_path / "t" / "run-1" / train.TRAIN_STEPS).read_text().splitlines()]
    noted = [i for i in steps if "tuner locked in" in lines[i]]
    assert len(noted) == 1, "\n".join(lines)
    k = steps.index(noted[0])  # 0-based: the step that locked in
    setting = lines[noted[0]].split("tuner locked in ")[1].split(":")[0].split()
    locked = {"threads": int(setting[1]), "chunk_numel": int(setting[3])}
    assert f"| threads {ran[k]['threads']} chunk {ran[k]['chunk_numel']} |" in lines[noted[0]]  # what it ran
    # After lock-in every step runs the locked setting, but the watch's rounds (the trace's
    # "watch" rows), which compare it now and then with the runner-up and the static plan.
    traced = [json.loads(row) for row in (tmp_path / "t" / "run-1" / "trace.jsonl").read_text().splitlines()]
    watched = {row["step"] for row in traced if str(row.get("phase", "")).startswith("watch")}
    assert k + 1 < len(ran) and all({key: r[key] for key in locked} == locked or r["step"] in watched
                                    for r in ran[k + 1:])
    summary = json.loads(out.read_text())
    assert summary["tuner"]["state"] == "locked" and summary["tuner"]["winner"] == locked
    assert {"step_s_median", "opt_s_median", "opt_stats_median", "step_times_s", "opt_times_s"} <= set(summary)
