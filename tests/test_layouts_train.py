"""``bench.train --fsdp --tp N`` / ``--hsdp R`` (bench/train/_parallel.py): the 4-rank torchrun against torch
AdamW on the same layout, the qkv reordering that lets a column shard compute its own heads, and
the argument errors."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from _dist_util import run_ranks
from bench.train import _main as train
from bench.train._parallel import _interleave_qkv, layout_mesh

REPO = Path(__file__).absolute().parents[1]
TINY = ["--model-size", "tiny", "--device", "cpu", "--batch-size", "2", "--seq-len", "16"]


def _torchrun(tmp_path: Path, name: str, *extra: str) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OFFLOAD_AUTOTUNE_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OFFLOAD_AUTOTUNE_CACHE"] = str(tmp_path / "cache.json")
    out = tmp_path / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "bench.train", *TINY, "--fsdp", "--tp", "2", "--steps", "3", "--summary-json", str(out), *extra]
    proc = run_ranks(cmd, cwd=tmp_path, env=env, timeout_s=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_torchrun_four_ranks_tp2_fsdp2_equals_torch_adamw(tmp_path: Path) -> None:
    ref, _ = _torchrun(tmp_path, "torch.json")
    ours, log = _torchrun(tmp_path, "ours.json", "--optim-cpu-offload", "--autotune", "--chunk-numel", "4096")
    assert "layout: DeviceMesh((replicate=1, shard=2, tp=2)" in log, log[-2000:]
    assert ours["world_size"] == 4
    assert ours["losses"] == ref["losses"], (ours["losses"], ref["losses"])
    shas = [r["param_sha256"] for r in ours["ranks"]]
    assert shas == [r["param_sha256"] for r in ref["ranks"]]
    assert len(set(shas)) == 4  # every rank holds a different part of the model


def test_interleaved_qkv_gives_each_tp_rank_its_heads_q_k_v() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 24)
    w = lin.weight.detach().clone()
    _interleave_qkv(lin, 2)
    for r in range(2):
        local = lin.weight[r * 12:(r + 1) * 12]  # ColwiseParallel's Shard(0) of rank r
        for j, part in enumerate(local.chunk(3)):  # the block's chunk(3): q, k, v of rank r's heads
            assert torch.equal(part, w[j * 8 + r * 4:j * 8 + (r + 1) * 4])


def test_layout_arguments_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        train.main([*TINY, "--tp", "2"])
    assert "--tp and --hsdp configure FSDP2: add --fsdp" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--tp 3 --hsdp 1 on 4 ranks: expected tp \\* hsdp to divide"):
        layout_mesh(4, tp=3, hsdp=1, device_type="cpu")


def test_step_refuses_a_partial_gradient() -> None:
    """An unreduced (Partial) gradient of a replicated parameter: step() raises naming it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from offload import CPUOffloadAdamW

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = torch.nn.Parameter(DTensor.from_local(torch.zeros(4), mesh, [Replicate()], run_check=False))
        opt = CPUOffloadAdamW([("w", w)])
        w.grad = DTensor.from_local(torch.ones(4), mesh, [Partial()], run_check=False)
        try:
            with pytest.raises(RuntimeError, match=r"parameter 0 \('w'\) has placements \(Replicate\(\),\).*Partial"):
                opt.step()
            assert torch.equal(w.to_local(), torch.zeros(4))  # nothing was written
        finally:
            opt.close()
    finally:
        dist.destroy_process_group()
