"""Issue 17's first-run rough edges that are not about the CLI or the kernel build."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autotune import AutotuneConfig


def test_config_accepts_path_objects_and_stores_str(tmp_path: Path) -> None:
    config = AutotuneConfig(cache_path=tmp_path / "c.json", trace_dir=tmp_path / "trace")
    assert config.cache_path == str(tmp_path / "c.json") and isinstance(config.cache_path, str)
    assert config.trace_dir == str(tmp_path / "trace") and isinstance(config.trace_dir, str)
    assert config == AutotuneConfig(cache_path=str(tmp_path / "c.json"), trace_dir=str(tmp_path / "trace"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache_path = "other.json"  # type: ignore[misc]
    assert dataclasses.replace(config, trace_dir=Path("t")).trace_dir == "t"


@pytest.mark.parametrize("bad", ["", b"c.json", 3])
def test_config_refuses_other_paths(bad: object) -> None:
    with pytest.raises(ValueError, match="AutotuneConfig.cache_path=.*os.PathLike"):
        AutotuneConfig(cache_path=bad)  # type: ignore[arg-type]


def test_only_one_candidate_logs_no_empty_table_header(caplog) -> None:
    import logging

    from test_tuner_logic import BASELINE, Client, make_space, make_tuner, table

    client = Client(table({}, default=0.01))
    space = make_space(threads=(BASELINE["threads"],), chunks=(BASELINE["chunk_numel"],))
    with caplog.at_level(logging.INFO, logger="autotune"):
        tuner = make_tuner(client, space=space, config=AutotuneConfig(probe_steps=40))
        client.run(tuner, 3)
    locked = [r.getMessage() for r in caplog.records if "locked in" in r.getMessage()]
    assert len(locked) == 1 and "only one candidate" in locked[0], locked
    assert "median ms" not in locked[0] and len(locked[0].splitlines()) == 1, locked[0]


def test_unsupported_option_error_says_what_the_step_runs() -> None:
    import torch

    from offload import CPUOffloadAdamW

    with pytest.raises(ValueError) as info:
        CPUOffloadAdamW([torch.nn.Parameter(torch.zeros(4))], amsgrad=True)
    text = str(info.value)
    assert "amsgrad=True" in text and "always runs torch's" not in text and "fused-mp" in text, text


TINY = ["--model-size", "tiny", "--device", "cpu", "--batch-size", "2", "--seq-len", "16", "--steps", "1"]


@pytest.mark.usefixtures("isolated_trainer")
def test_untuned_stock_run_prints_tuner_off_and_no_chunk_none(tmp_path: Path, capsys) -> None:
    from bench import train

    assert train.main([*TINY, "--trace-dir", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert "tuner: off" in out and "cache_hit None" not in out, out
    assert "chunk None" not in out and "chunk n/a (stock optimizer)" in out, out


def test_local_rank_beyond_local_world_size_names_both(monkeypatch) -> None:
    from autotune import knobs

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert knobs.node_local_rank() == 1
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(knobs.KnobError, match=r"LOCAL_RANK=5 with LOCAL_WORLD_SIZE=2: expected LOCAL_RANK from 0 to 1"):
        knobs.node_local_rank()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert knobs.node_local_rank() == 5  # LOCAL_RANK alone: nothing to check it against


def test_trainer_with_local_rank_beyond_local_world_size_is_one_line(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    repo = Path(__file__).absolute().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OFFLOAD_AUTOTUNE_THREADS")}
    env.update(PYTHONPATH=str(repo), LOCAL_WORLD_SIZE="2", LOCAL_RANK="5")
    for extra in ([], ["--optim-cpu-offload"]):
        proc = subprocess.run([sys.executable, "-m", "bench.train", *TINY, *extra], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert "LOCAL_RANK=5 with LOCAL_WORLD_SIZE=2" in proc.stderr.strip().splitlines()[-1]
