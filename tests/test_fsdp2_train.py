"""``python -m bench.train --fsdp``: one process (a 1-rank group) and two torchrun ranks, the
offloaded optimizer with overlap and accumulation against torch's AdamW on the same sharded model."""

from __future__ import annotations

import json
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


pytestmark = pytest.mark.usefixtures("isolated_trainer")


def _train(tmp_path: Path, *extra: str, name: str) -> dict:
    return train_summary(tmp_path / name, *TINY, *extra)


def test_fsdp_single_process_overlap_and_accumulation_equal_torch(tmp_path: Path) -> None:
    common = ["--steps", "3", "--grad-accum", "2", "--fsdp"]
    ref = _train(tmp_path, *common, name="torch.json")
    ours = _train(tmp_path, *common, "--optim-cpu-offload", "--overlap-backward", "--threads", "1",
                  "--chunk-numel", "4096", name="ours.json")
    assert ours["fsdp"] is True and ours["overlap_backward"] is True and ours["world_size"] == 1
    assert ours["losses"] == ref["losses"]
    assert ours["ranks"][0]["param_sha256"] == ref["ranks"][0]["param_sha256"]
    mp = _train(tmp_path, "--steps", "2", "--fsdp", "--fsdp-param-dtype", "bf16", "--optim-cpu-offload",
                name="mp.json")
    assert mp["fsdp_param_dtype"] == "bf16" and all(x == x for x in mp["losses"])


def test_fsdp_param_dtype_needs_fsdp(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        train.main([*TINY, "--fsdp-param-dtype", "bf16"])
    assert "add --fsdp" in capsys.readouterr().err


def _torchrun(tmp_path: Path, name: str, *extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OFFLOAD_AUTOTUNE_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "bench.train", *TINY, "--fsdp", "--steps", "3", "--grad-accum", "2",
           "--summary-json", str(out), *extra]
    proc = run_ranks(cmd, cwd=tmp_path, env=env, timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Every rank's line names its chunk (n/a for torch's AdamW), never "chunk None" (issue 17).
    assert "rank 1: threads" in proc.stdout and "chunk None" not in proc.stdout, proc.stdout[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_torchrun_two_ranks_fsdp_overlap_equals_torch_adamw(tmp_path: Path) -> None:
    """Overlap with several ranks is allowed under --fsdp, and changes no bit of any shard."""
    ref = _torchrun(tmp_path, "torch.json")
    ours = _torchrun(tmp_path, "ours.json", "--optim-cpu-offload", "--overlap-backward", "--chunk-numel", "4096")
    assert ours["world_size"] == 2 and ours["overlap_backward"] is True
    assert ours["losses"] == ref["losses"]
    shas = [r["param_sha256"] for r in ours["ranks"]]
    assert shas == [r["param_sha256"] for r in ref["ranks"]]
    assert shas[0] != shas[1]  # each rank checksums its own shard


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_fsdp_memory_bench_reports_shard_sized_slabs(tmp_path: Path) -> None:
    from bench import fsdp_memory

    assert fsdp_memory.main(["--model-size", "tiny", "--world-sizes", "2", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "fsdp_memory.json").read_text())
    ranks = result["worlds"][0]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert sum(r["local_params"] for r in ranks) == result["global_params"] == 136_960
    # The two fp32 moment slabs of this rank's half of the model (plus alignment padding; an fp32
    # parameter on the CPU is its own master): ~4 B per parameter of the whole model.
    assert all(4.0 <= r["slab_bytes_per_global_param"] < 4.5 for r in ranks), ranks
    assert all(r["optimizer_rss_bytes"] > 0 for r in ranks), ranks
    assert "| 2 | 1 |" in (tmp_path / "fsdp_memory.md").read_text()


def test_shard_model_cpu_offload_policy_with_overlap_equals_torch() -> None:
    """FSDP's own CPUOffloadPolicy (sharded params and grads on the host; unpinned without CUDA)
    under CPUOffloadAdamW with overlap: bitwise torch's fused AdamW on the same sharded model."""
    import torch.distributed as dist

    from bench.train._fsdp import shard_model
    from bench.train.model import GPT, preset
    from offload import CPUOffloadAdamW

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = shard_model(GPT(preset("tiny")), cpu_offload=True)
        torch.manual_seed(0)
        ref = shard_model(GPT(preset("tiny")))
        opt = CPUOffloadAdamW(model.parameters(), overlap_backward=True)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=1e-2, fused=True)
        for step in range(3):
            x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
            for m, o in ((model, opt), (ref, ref_opt)):
                m(x, x).backward()
                o.step()
                o.zero_grad()
        assert opt.last_stats.speculated_chunks > 0
        assert all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), ref.parameters()))
        opt.close()
    finally:
        dist.destroy_process_group()
