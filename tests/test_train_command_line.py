"""The trainer's command line and what it prints (``python -m bench.train``): an honest --help,
bad arguments and environments as one line and a non-zero exit, and one line each for the thread
plan, the tuner being off and a missing matplotlib."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _forked import run_python

from bench.train import _main as train

REPO = Path(__file__).absolute().parents[1]
TINY = ["--model-size", "tiny", "--device", "cpu", "--batch-size", "2", "--seq-len", "16"]


pytestmark = pytest.mark.usefixtures("isolated_trainer")


def _trainer(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items()
            if k not in ("OFFLOAD_AUTOTUNE_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    full["PYTHONPATH"] = str(REPO) + os.pathsep + full.get("PYTHONPATH", "")
    full.update(env or {})
    return run_python(["-m", "bench.train", *TINY, *args], cwd=tmp_path, env=full, timeout=300)


def test_help_shows_each_default_once_and_documents_every_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        train.build_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: False)" not in text
    assert text.count("(default: the rank's thread plan)") == 2  # --threads, --compute-threads
    assert "$OFFLOAD_AUTOTUNE_CACHE" in text
    kernel = text.split("--kernel {auto,torch,fused-mp} ")[1].split(" --numa-bind ")[0]
    assert "(default auto:" in kernel and "default torch" not in text and "default: torch" not in text, kernel
    for action in train.build_parser()._actions:
        assert action.help, action.option_strings


@pytest.mark.parametrize("case", ["trace-dir-is-a-file", "bad-env"])
def test_bad_trace_dir_or_environment_is_one_line_and_nonzero(tmp_path: Path, case: str) -> None:
    if case == "trace-dir-is-a-file":
        (tmp_path / "f").write_text("x")
        proc = _trainer(tmp_path, "--optim-cpu-offload", "--steps", "1", "--trace-dir", "f")
        expected = "f exists and is not a directory"
    else:
        proc = _trainer(tmp_path, "--optim-cpu-offload", "--steps", "1", env={"OFFLOAD_AUTOTUNE_THREADS": "abc"})
        expected = "OFFLOAD_AUTOTUNE_THREADS='abc'"
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and expected in errors[0], proc.stderr
    assert (tmp_path / "f").is_file() or case == "bad-env"


def test_local_rank_beyond_local_world_size_is_one_line(tmp_path: Path) -> None:
    for extra in ([], ["--optim-cpu-offload"]):
        proc = _trainer(tmp_path, "--steps", "1", *extra, env={"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "5"})
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert "LOCAL_RANK=5 with LOCAL_WORLD_SIZE=2" in proc.stderr.strip().splitlines()[-1]


def test_thread_plan_is_logged_once_per_run(tmp_path: Path) -> None:
    proc = _trainer(tmp_path, "--optim-cpu-offload", "--steps", "1", "--autotune", "--cache", "c.json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("thread plan") == 1, proc.stderr


def test_untuned_stock_run_prints_tuner_off_and_no_chunk_none(tmp_path: Path, capsys) -> None:
    assert train.main([*TINY, "--steps", "1", "--trace-dir", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert "tuner: off" in out and "cache_hit None" not in out, out
    assert "chunk None" not in out and "chunk n/a (stock optimizer)" in out, out


def test_no_matplotlib_is_said_in_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert train.main([*TINY, "--optim-cpu-offload", "--autotune", "--steps", "1",
                       "--cache", str(tmp_path / "c.json"), "--trace-dir", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert "tuning.png: matplotlib is not installed" in out and "[plot]" in out


def test_dist_timeout_also_bounds_the_optimizers_waits_on_device_events() -> None:
    """Issue 40: a dead peer fails a collective after --dist-timeout; the offloaded optimizer's host
    waits on device events (the CUDA path's copies, behind a peer's NCCL work) take the same bound,
    ``CPUOffloadAdamW(device_timeout_s=)``, instead of its 300 s default."""
    import torch

    args = train.build_parser().parse_args([*TINY, "--optim-cpu-offload", "--threads", "1", "--dist-timeout", "7"])
    opt = train._make_optimizer(args, torch.nn.Linear(4, 4), {})
    try:
        assert opt._engine.device_timeout_s == 7.0
    finally:
        opt.close()
