"""The trainer's ``--fsdp --fsdp-cpu-offload --autotune`` path: stock ``torch.optim.AdamW(fused=True)``
on FSDP2 ``CPUOffloadPolicy`` shards, its step's threads tuned by ``offload.tune_step_threads``
(single process: FSDP2 on a world of one; the two-rank wrapper runs in test_stock_dist.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import train_summary

from bench.train import _main as train

TINY = ["--model-size", "tiny", "--device", "cpu", "--batch-size", "4", "--seq-len", "32", "--fsdp",
        "--fsdp-cpu-offload"]


pytestmark = pytest.mark.usefixtures("isolated_trainer")


def _train(tmp_path: Path, *extra: str, name: str) -> dict:
    return train_summary(tmp_path / name, *TINY, *extra)


def test_fsdp_cpu_offload_tunes_then_hits_the_cache_without_changing_the_math(tmp_path: Path) -> None:
    # 44 steps: the 40-step probe budget (an undecided duel may spend it all) and a few locked ones.
    tune = ["--autotune", "--steps", "44", "--cache", str(tmp_path / "cache.json")]
    first = _train(tmp_path, *tune, "--trace-dir", str(tmp_path / "trace"), name="first.json")
    t = first["tuner"]
    assert first["optimizer"] == "torch.optim.AdamW(fused=True) + tune_step_threads" and first["fsdp_cpu_offload"]
    assert t["state"] == "locked" and t["cache_hit"] is False and 0 < t["probe_steps"] <= 40
    assert set(t["winner"]) == {"threads"} and first["ranks"][0]["threads"] == t["winner"]["threads"]
    assert (tmp_path / "trace" / "run-1" / "summary.json").is_file()

    second = _train(tmp_path, *tune, name="second.json")["tuner"]
    assert second["cache_hit"] is True and second["cache_status"] in ("hit", "stale")
    if second["cache_status"] == "hit":  # "stale": a loaded machine re-probed (see test_train.py)
        assert second["probe_steps"] == 0 and second["winner"] == t["winner"]

    # Stock AdamW, untouched: the same bits whatever thread counts the tuner tried.
    plain = _train(tmp_path, "--steps", "44", name="plain.json")
    assert plain["optimizer"] == "torch.optim.AdamW(fused=True)" and plain["tuner"]["state"] == "off"
    assert first["ranks"][0]["param_sha256"] == plain["ranks"][0]["param_sha256"]
    assert first["losses"] == plain["losses"]


@pytest.mark.parametrize("argv,message", [
    (["--fsdp-cpu-offload"], "add --fsdp"),
    (["--fsdp", "--fsdp-cpu-offload", "--optim-cpu-offload"], "drop --optim-cpu-offload"),
    (["--fsdp", "--fsdp-cpu-offload", "--chunk-numel", "4096"], "--chunk-numel configures CPUOffloadAdamW"),
])
def test_fsdp_cpu_offload_flag_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        train.main(["--model-size", "tiny", "--steps", "1", *argv])
    assert message in capsys.readouterr().err
