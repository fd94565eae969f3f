"""Four ranks on this machine play two nodes of two, with the environment that two torchrun
agents (``--nnodes 2 --nproc-per-node 2``) give their workers (``_dist_util.start_ranks``): the
FSDP trainer with ``--autotune`` tunes, locks in and caches once per node (the tuner's agreement
group is the node's ``LOCAL_WORLD_SIZE`` consecutive ranks), and the run ends with the same losses
and shards as the same two nodes without tuning.

Each node gets its own cache and trace folder, as two real nodes would have. The model is the
tiny GPT in bf16: its slabs are too small for the chunk knob and one CPU per rank leaves one
thread count, so the kernel knob (torch / fused-mp, bitwise equal on this build) is what is tuned.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from _dist_util import free_port, start_ranks

REPO = Path(__file__).absolute().parents[1]
STEPS = 44  # the default probe budget (40) and a few locked steps: a decision may take all of it

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo"),
]


def _two_nodes(tmp: Path, *extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OFFLOAD_AUTOTUNE_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "WORLD_SIZE",
                        "GROUP_RANK")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    port = free_port()
    procs = []
    for node in range(2):
        node_dir = tmp / f"node{node}"
        node_dir.mkdir(parents=True, exist_ok=True)
        tune = [a.replace("{node}", str(node_dir)) for a in extra]
        argv = ["-m", "bench.train", "--model-size", "tiny", "--dtype", "bf16", "--device", "cpu",
                "--batch-size", "2", "--seq-len", "16", "--steps", str(STEPS), "--fsdp", "--optim-cpu-offload",
                "--summary-json", str(tmp / "summary.json"), *tune]
        procs += start_ranks(argv, nproc=2, nnodes=2, node_rank=node, env=env, cwd=node_dir, out_dir=node_dir,
                             port=port)
    try:
        for rank, proc in enumerate(procs):
            rc = proc.wait(timeout=600)
            out = tmp / f"node{rank // 2}" / f"stderr.{rank}"
            assert rc == 0, out.read_text(errors="replace")[-4000:]
    finally:  # every rank leads its own session
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return json.loads((tmp / "summary.json").read_text())


def test_two_nodes_tune_and_cache_each_on_their_own(tmp_path: Path) -> None:
    tuned = _two_nodes(tmp_path / "tuned", "--autotune", "--cache", "{node}/cache.json", "--trace-dir",
                       "{node}/trace")
    plain = _two_nodes(tmp_path / "plain")
    assert tuned["world_size"] == plain["world_size"] == 4
    for node in range(2):
        node_dir = tmp_path / "tuned" / f"node{node}"
        # The node's local rank 0 (global rank 2 on the second node) wrote its own cache entry and trace.
        entries = json.loads((node_dir / "cache.json").read_text())["entries"]
        assert len(entries) == 1, entries
        run = node_dir / "trace" / "run-1"  # --trace-dir DIR writes DIR/run-N (autotune/report/_runs.py)
        (summary_file,) = run.glob("summary*.json")  # summary.rank2.json on node 1
        summary = json.loads(summary_file.read_text())
        assert summary["state"] == "locked" and summary["winner"] is not None, summary
        assert summary["probe_steps"] > 0 and summary["cache_hit"] is False, summary
        rows = _trace_rows(run)
        assert {"torch", "fused-mp"} == {r["candidate"]["kernel"] for r in rows}, node
        # The node's agreement group is its own two local ranks; its local rank 0 (global rank
        # 0 or 2) traced it.
        assert all(set(r["ranks"]) == {"0", "1"} for r in rows), rows[0]
        assert summary_file.name == ("summary.json" if node == 0 else "summary.rank2.json")
        assert list(entries.values())[0]["winner"] == summary["winner"]
    # Tuning (kernel switches mid-run) changed no bit: same losses, same shard on every rank.
    assert tuned["losses"] == plain["losses"]
    assert [r["param_sha256"] for r in tuned["ranks"]] == [r["param_sha256"] for r in plain["ranks"]]
    assert len({r["param_sha256"] for r in tuned["ranks"]}) == 4  # four different shards


def _trace_rows(trace: Path) -> list[dict]:
    (path,) = trace.glob("trace*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if isinstance(r.get("candidate"), dict) and "ranks" in r]
