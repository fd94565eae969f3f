"""The thread plan over a real 2-process gloo group: masks are exchanged (over a gloo group made by
the plan, or through the tuner's ``GlooAgreement``), and both ranks agree."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).absolute().parents[1]
WORLD = 2

CHILD = r"""
import datetime, json, os, sys, time
rank, out = int(sys.argv[1]), sys.argv[2]
own, shared = json.loads(sys.argv[3]), json.loads(sys.argv[4])
os.sched_setaffinity(0, own[rank])

import torch.distributed as dist
from offload import plan_cpu_threads

def record(plan):
    return {"threads": plan.threads, "planned": plan.planned_threads, "rank": plan.local_rank,
            "world": plan.local_world_size, "masks": [sorted(m) for m in plan.local_masks],
            "local_threads": list(plan.local_threads), "from": plan.masks_from, "reason": plan.reason}

dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
plans = {"node": record(plan_cpu_threads(timeout_s=30)),  # node ranks from LOCAL_RANK/LOCAL_WORLD_SIZE
         "group": record(plan_cpu_threads(group=dist.group.WORLD, timeout_s=30))}
from autotune.agree._agree import GlooAgreement  # the agreement an OnlineTuner builds for the local ranks
agreement = GlooAgreement.for_local_ranks(timeout_s=30)
plans["agreement"] = record(plan_cpu_threads(agreement=agreement))
agreement.close()
os.sched_setaffinity(0, shared)
del os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]
plans["host"] = record(plan_cpu_threads(timeout_s=30))  # all ranks, filtered by host name

# Never hang: rank 1 does not join, rank 0's exchange on a 2 s gloo group must raise. The barrier
# first: the 2 s also bound the group's set-up, and the ranks may leave the plans above seconds apart.
dist.barrier()
short = dist.new_group([0, 1], backend="gloo", timeout=datetime.timedelta(seconds=2))
if rank == 0:
    from offload.threads._plan import ThreadPlanError
    start = time.monotonic()
    try:
        plan_cpu_threads(group=short)
        plans["missing_peer"] = "returned"
    except ThreadPlanError as exc:
        plans["missing_peer"] = f"raised after {time.monotonic() - start:.0f} s: {exc}"
with open(out, "w") as f:
    json.dump(plans, f)
dist.barrier()
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                    reason="needs >= 2 CPUs in the affinity mask to give each rank its own CPU")
def test_two_gloo_ranks_exchange_masks_and_agree(tmp_path: Path) -> None:
    mask = sorted(os.sched_getaffinity(0))
    own = [[mask[0]], [mask[1]]]  # disjoint: one CPU each
    shared = mask[:2]  # then both ranks on the same two CPUs
    env = {k: v for k, v in os.environ.items() if k not in ("OFFLOAD_AUTOTUNE_THREADS",)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(WORLD),
               LOCAL_WORLD_SIZE=str(WORLD), PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    procs = []
    for rank in range(WORLD):
        env_r = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen(
            [sys.executable, "-c", CHILD, str(rank), str(tmp_path / f"rank{rank}.json"),
             json.dumps(own), json.dumps(shared)],
            cwd=REPO, env=env_r, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            try:
                logs.append(p.communicate(timeout=120)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                logs.append("TIMED OUT after 120 s\n" + p.communicate()[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{log}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]

    for how, masks, source in [("node", own, "collective"), ("group", own, "collective"),
                               ("agreement", own, "agreement"), ("host", [shared, shared], "collective")]:
        a, b = (res[how] for res in results)
        # The exchange happened: each rank knows the other's real mask, in local-rank order.
        assert a["masks"] == b["masks"] == masks, how
        assert a["from"] == b["from"] == source, how
        assert a["world"] == b["world"] == WORLD, how
        assert (a["rank"], b["rank"]) == (0, 1), how
        # Consistent plans: the same node allocation, each rank taking its own entry.
        assert a["local_threads"] == b["local_threads"], how
        assert [a["planned"], b["planned"]] == a["local_threads"], how
        covered = len(set().union(*map(set, masks)))
        assert sum(a["local_threads"]) <= covered, how
        assert a["threads"] == a["planned"] >= 1, how
    assert "did every rank call plan_cpu_threads" in results[0]["missing_peer"], results[0]["missing_peer"]
    # Two CPUs split between two ranks: one thread each, whether the masks are shared or not.
    assert results[0]["host"]["local_threads"] == [1, 1]
    assert "2 shared with other local ranks" in results[0]["host"]["reason"]


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")
def test_the_trainer_says_starved_cpus_once_per_node_not_once_per_rank(tmp_path: Path) -> None:
    """Two torchrun ranks of ``bench.train`` pinned to one CPU (half a physical core each): the
    CPU-starvation WARNING appears once, from local rank 0, with its figures, though both ranks
    plan their threads twice (the trainer's own plan and the tuned optimizer's); the run finishes."""
    from _dist_util import run_torchrun

    cpu = min(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items()
           if k not in ("OFFLOAD_AUTOTUNE_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "bench.train", "--model-size", "tiny", "--device", "cpu", "--batch-size", "2", "--seq-len", "16",
           "--optim-cpu-offload", "--autotune", "--cache", str(tmp_path / "cache.json"), "--steps", "2"]
    proc = run_torchrun(cmd, cwd=tmp_path, env=env, timeout_s=300,
                        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))  # the workers inherit it
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    lines = [line for line in out.splitlines() if "CPU starvation" in line]
    assert len(lines) == 1, "\n".join(lines) or out[-3000:]
    assert "WARNING" in lines[0]
    for figure in ("2 local rank(s) have 1 CPU(s)", "(1 physical core(s);", "0.5 of a physical core per rank",
                   "srun --cpus-per-task", "numactl"):
        assert figure in lines[0], (figure, lines[0])
