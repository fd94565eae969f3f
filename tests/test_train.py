"""The reference trainer (``python -m bench.train``): summaries, numerics against torch's AdamW,
and two gloo ranks with torchrun's environment (``_dist_util.run_ranks``) that must end with
bitwise identical parameters."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import train_summary

from _dist_util import run_ranks
from bench.train import _main as train

REPO = Path(__file__).absolute().parents[1]
TINY = ["--model-size", "tiny", "--device", "cpu", "--batch-size", "4", "--seq-len", "32"]
TUNER_KEYS = {"state", "cache_hit", "probe_steps", "baseline", "winner"}


pytestmark = pytest.mark.usefixtures("isolated_trainer")


def _train(tmp_path: Path, *extra: str, name: str = "summary.json") -> dict:
    return train_summary(tmp_path / name, *TINY, *extra)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_offload_run_writes_summary(tmp_path: Path, dtype: str, capsys: pytest.CaptureFixture[str]) -> None:
    s = _train(tmp_path, "--optim-cpu-offload", "--dtype", dtype, "--steps", "3")
    printed = capsys.readouterr().out
    assert "136,960 parameters" in printed and printed.count("step ") >= 3
    assert s["params"] == 136_960 == train.preset("tiny").num_params
    assert s["dtype"] == dtype and s["world_size"] == 1 and s["optimizer"] == "CPUOffloadAdamW"
    assert [r["rank"] for r in s["ranks"]] == [0]
    rank = s["ranks"][0]
    assert isinstance(rank["threads"], int) and rank["threads"] >= 1
    assert isinstance(rank["chunk_numel"], int) and rank["chunk_numel"] >= 1
    assert len(rank["param_sha256"]) == 64
    assert TUNER_KEYS <= set(s["tuner"]) and s["tuner"]["state"] == "off"
    assert len(s["losses"]) == 3 and all(math.isfinite(x) for x in s["losses"])
    assert s["loss_first"] == s["losses"][0] and s["loss_last"] == s["losses"][-1]
    assert s["step_s_median"] > 0 and s["step_s_iqr"] >= 0 and s["steps_measured"] == 2
    med = s["opt_stats_median"]
    assert set(med) == {"step_s", "d2h_s", "adam_kernel_s", "materialize_s", "drain_s"}
    assert all(v >= 0 for v in med.values()) and med["step_s"] > 0


def test_offload_matches_torch_fused_adamw_bitwise(tmp_path: Path) -> None:
    """fp32: same seed, same data, same schedule -> the offloaded optimizer must leave the very
    same parameters as torch.optim.AdamW(fused=True) (the project's bitwise-equality claim)."""
    common = ("--dtype", "fp32", "--steps", "4", "--compute-threads", "1")
    ref = _train(tmp_path, *common, name="ref.json")
    off = _train(tmp_path, *common, "--optim-cpu-offload", "--threads", "1", "--chunk-numel", "4096",
                 name="off.json")
    assert ref["optimizer"].startswith("torch.optim.AdamW")
    assert off["losses"] == ref["losses"]
    assert off["ranks"][0]["param_sha256"] == ref["ranks"][0]["param_sha256"]


def test_loss_goes_down(tmp_path: Path) -> None:
    s = _train(tmp_path, "--optim-cpu-offload", "--steps", "25", "--lr", "3e-3")
    assert s["loss_last"] < s["loss_first"] - 0.3, s["losses"]


def test_overlap_backward_with_grad_accum_matches_plain_step(tmp_path: Path) -> None:
    common = ("--optim-cpu-offload", "--steps", "3", "--grad-accum", "2", "--compute-threads", "1",
              "--threads", "1")
    plain = _train(tmp_path, *common, name="plain.json")
    overlap = _train(tmp_path, *common, "--overlap-backward", name="overlap.json")
    assert overlap["overlap_backward"] is True
    assert overlap["losses"] == plain["losses"]
    assert overlap["ranks"][0]["param_sha256"] == plain["ranks"][0]["param_sha256"]


@pytest.mark.parametrize("flag", [["--autotune"], ["--threads", "2"], ["--overlap-backward"]])
def test_offload_flags_need_offload(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        train.main([*TINY, "--steps", "1", *flag])
    assert exc.value.code == 2
    assert "--optim-cpu-offload" in capsys.readouterr().err


def test_autotune_locks_in_then_hits_the_cache_without_changing_the_math(tmp_path: Path) -> None:
    cache, trace = tmp_path / "cache.json", tmp_path / "trace"
    # 44 steps: the 40-step probe budget (an undecided duel may spend it all) and a few locked ones.
    tune = ["--optim-cpu-offload", "--autotune", "--steps", "44", "--cache", str(cache)]
    first = _train(tmp_path, *tune, "--trace-dir", str(trace), name="first.json")
    t = first["tuner"]
    assert t["state"] == "locked" and t["cache_hit"] is False and 0 < t["probe_steps"] <= 40
    assert t["winner"] is not None and set(t["winner"]) == {"threads", "chunk_numel"}
    # The rank reports the knobs of its last step. The tuner's current setting is the one for the
    # step after: it differs where the last step ended a probe or a watch round (on a loaded
    # machine lock-in can come early enough for the watch to start one before step 44), and then
    # the trace's row of that step names what ran.
    run = trace / "run-1"  # one directory per run (tests/test_run_dirs.py)
    rows = [json.loads(line) for line in (run / "trace.jsonl").read_text().splitlines() if line.strip()]
    last = [r["candidate"] for r in rows if r.get("step") == t["steps"]]
    assert [first["ranks"][0][k] for k in ("threads", "chunk_numel")] == [
        (last or [t["current"]])[0][k] for k in ("threads", "chunk_numel")]
    assert t["current"] == t["winner"] or t["watch_steps"] > 0, t
    for name in ("trace.jsonl", "trace.csv", "trace.chrome.json", "summary.json", "train_steps.jsonl",
                 "run.json"):
        assert (run / name).is_file(), name
    assert json.loads((run / "summary.json").read_text())["winner"] == t["winner"]
    assert json.loads(cache.read_text())["entries"]

    second = _train(tmp_path, *tune, name="second.json")
    t2 = second["tuner"]
    assert t2["cache_hit"] is True
    # A hit re-checks the cached choice on its first steps; on a loaded machine it may be found
    # slower than recorded ("stale") and probed again. Otherwise nothing is probed.
    assert t2["cache_status"] in ("hit", "stale")
    if t2["cache_status"] == "hit":
        assert t2["probe_steps"] == 0 and t2["winner"] == t["winner"]

    # Tuning switched threads and chunk sizes mid-run; the parameters must not notice.
    plain = _train(tmp_path, "--optim-cpu-offload", "--steps", "44", name="plain.json")
    assert first["ranks"][0]["param_sha256"] == plain["ranks"][0]["param_sha256"]
    assert first["losses"] == plain["losses"]


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_torchrun_two_ranks_stay_identical(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("OFFLOAD_AUTOTUNE_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "bench.train", *TINY, "--optim-cpu-offload", "--steps", "4", "--chunk-numel", "8192",
           "--summary-json", str(out)]
    proc = run_ranks(cmd, cwd=tmp_path, env=env, timeout_s=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["world_size"] == 2 and s["backend"] == "gloo"
    ranks = s["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["threads"] >= 1 and r["chunk_numel"] == 8192 for r in ranks)
    # Same init, different data, averaged gradients: identical parameters after every step.
    assert ranks[0]["param_sha256"] == ranks[1]["param_sha256"]
    # ...and the ranks really saw different data.
    assert ranks[0]["loss_last_local"] != ranks[1]["loss_last_local"]
    assert all(math.isfinite(x) for x in s["losses"])
    assert proc.stdout.count("step ") >= 4  # only rank 0 prints per-step lines


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_torchrun_two_ranks_autotune_agree_and_share_the_cache(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OFFLOAD_AUTOTUNE_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    summaries = []
    for run in ("first", "second"):
        out = tmp_path / f"{run}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               # 2 ranks on a 2-CPU machine get 1 thread each: the model must be large enough
               # (> 1Mi elements per slab) for the chunk knob to give the tuner a choice.
               "-m", "bench.train", "--model-size", "small", "--device", "cpu", "--batch-size", "2",
               "--seq-len", "16", "--optim-cpu-offload", "--autotune", "--steps", "44",
               "--cache", str(tmp_path / "cache.json"), "--summary-json", str(out)]
        proc = run_ranks(cmd, cwd=tmp_path, env=env, timeout_s=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        summaries.append(json.loads(out.read_text()))
    first, second = summaries
    assert first["tuner"]["state"] == "locked" and first["tuner"]["cache_hit"] is False
    assert second["tuner"]["cache_hit"] is True and second["tuner"]["cache_status"] in ("hit", "stale")
    if second["tuner"]["cache_status"] == "hit":  # see the single-process test: "stale" re-probes
        assert second["tuner"]["probe_steps"] == 0
        assert second["tuner"]["winner"] == first["tuner"]["winner"]
    for s in summaries:
        ranks = s["ranks"]
        # Both ranks run the agreed setting (threads capped by each rank's own plan).
        assert ranks[0]["chunk_numel"] == ranks[1]["chunk_numel"]
        if s["tuner"]["state"] == "locked":  # the winner, or a watch round's challenger (see above)
            assert s["tuner"]["current"] == s["tuner"]["winner"] or s["tuner"]["watch_steps"] > 0, s["tuner"]
            # The ranks report the knobs of their last step. When the tuner locked in after the
            # run's last step (it observed every one of the 44: a decision may take the whole
            # 40-step budget, or a stale cache entry its 13 check steps and then probing), that
            # step still ran a probe candidate.
            if s["tuner"]["steps"] < 44:
                assert ranks[0]["chunk_numel"] == s["tuner"]["current"]["chunk_numel"]
        assert ranks[0]["threads"] == ranks[1]["threads"]
        assert ranks[0]["param_sha256"] == ranks[1]["param_sha256"]
