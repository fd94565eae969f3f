"""``bench.simulate``'s cross-check over real gloo: the same tuning sessions with one process per
local rank and the tuner's own ``GlooAgreement``, every decision compared with the in-process
simulation."""

from __future__ import annotations

import datetime as _dt
import json
import time
from pathlib import Path
from typing import Any, Sequence

from autotune import AutotuneConfig
from bench.simulate._nodes import build_node
from bench.simulate._session import (noise_table, plan_node, rank_session, result_row, run_seed, step_loads,
                                     tuning_inputs)
from bench.simulate._stepmodel import NoiseModel

__all__ = ["gloo_check"]


def _gloo_worker(rank: int, world: int, port: int, name: str, seeds: list[int], out_path: str) -> None:
    """One process of the gloo cross-check: the same sessions, ``GlooAgreement`` built by the tuner."""
    import os

    import torch.distributed as dist

    os.environ.update({"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=_dt.timedelta(seconds=120))
    try:
        node = build_node(name)
        plans = plan_node(node)
        space, baseline, caps = tuning_inputs(node, plans)
        config = AutotuneConfig(use_cache=False)
        noise = NoiseModel()
        rows = []
        for seed in seeds:
            table = noise_table(node, seed, config.probe_steps + 1, noise)
            history: list[float] = []
            began = time.perf_counter()
            summary = rank_session(rank, None, node, space, baseline, caps, config, table, noise,
                                    history if rank == 0 else None, loads=step_loads(node, seed, len(table)))
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, summary)
            if rank == 0:
                row = result_row(node, seed, gathered, history, None)
                row["wall_s"] = time.perf_counter() - began
                rows.append(row)
        if rank == 0:
            Path(out_path).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def gloo_check(name: str, seeds: Sequence[int]) -> dict[str, Any]:
    """Run ``seeds`` of node ``name`` with one real process per local rank over gloo (the tuner's
    own ``GlooAgreement``) and compare every decision with the in-process simulation."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    node = build_node(name)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = str(Path(tmp) / "gloo.json")
        began = time.perf_counter()
        mp.spawn(_gloo_worker, args=(node.ranks, port, name, list(seeds), out_path), nprocs=node.ranks, join=True)
        wall = time.perf_counter() - began
        gloo_rows = json.loads(Path(out_path).read_text())
    plans = plan_node(node)
    space, baseline, caps = tuning_inputs(node, plans)
    began = time.perf_counter()
    local_rows = [run_seed(node, space, baseline, caps, s) for s in seeds]
    local_wall = time.perf_counter() - began
    keys = ("winner", "probe_steps", "reason", "measured")
    same = [all(g[k] == l[k] for k in keys) for g, l in zip(gloo_rows, local_rows)]
    return {
        "node": name,
        "processes": node.ranks,
        "seeds": list(seeds),
        "identical_decisions": sum(same),
        "all_identical": all(same) and len(same) == len(seeds),
        "gloo_wall_s": wall,
        "gloo_session_s": [r["wall_s"] for r in gloo_rows],
        "in_process_wall_s": local_wall,
    }
