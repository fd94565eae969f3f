"""Run directories: each trainer run writes a new ``run-N`` under ``--trace-dir`` (numbered past
gaps and stray files, ``latest`` pointing at the newest), and ``python -m autotune show/export
--run`` finds the newest run from the parent directory."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from autotune.report import _cli
from autotune.report._runs import new_run_dir, resolve_run_dir, runs_in
from bench.train import _main as train

TINY = ["--model-size", "tiny", "--device", "cpu", "--batch-size", "2", "--seq-len", "16"]


@pytest.mark.usefixtures("isolated_trainer")
def test_two_runs_keep_both_traces_and_the_cli_finds_the_newest(tmp_path: Path, capsys) -> None:
    trace, cache = tmp_path / "demo", tmp_path / "cache.json"
    for _ in range(2):
        assert train.main([*TINY, "--optim-cpu-offload", "--autotune", "--steps", "2",
                           "--cache", str(cache), "--trace-dir", str(trace)]) == 0
    assert [p.name for p in runs_in(trace)] == ["run-1", "run-2"]
    for run in runs_in(trace):
        for name in ("trace.jsonl", "train_steps.jsonl", "run.json", "summary.json"):
            assert (run / name).is_file(), (run, name)
        assert json.loads((run / "run.json").read_text())["steps"] == 2
    assert (trace / "latest").resolve() == (trace / "run-2").resolve()
    assert "trace: " in capsys.readouterr().out
    assert resolve_run_dir(trace) == trace / "run-2"
    assert resolve_run_dir(trace / "run-1") == trace / "run-1"
    out = io.StringIO()
    assert _cli.main(["show", "--run", str(trace), "--json"], stdout=out) == 0
    assert json.loads(out.getvalue())["steps"] == 2
    out = io.StringIO()
    assert _cli.main(["export", "--run", str(trace), "--format", "csv"], stdout=out) == 0
    assert out.getvalue().count("\n") >= 3  # header + 2 steps


def test_new_run_dir_numbers_past_gaps_and_stray_files(tmp_path: Path) -> None:
    (tmp_path / "run-3").mkdir()
    (tmp_path / "run-x").mkdir()
    assert new_run_dir(tmp_path).name == "run-4"
    (tmp_path / "run-5").write_text("not a run")  # a file with a run's name is skipped
    assert new_run_dir(tmp_path).name == "run-6"
