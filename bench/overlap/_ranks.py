"""Several ranks of :mod:`bench.overlap` on one host: the launch, and what each rank shares.

``python -m bench.overlap --ranks 2`` runs the benchmark in ``--ranks`` processes started by
torchrun (gloo), as a node with several GPUs runs one trainer per GPU on one host: each rank has
its own model replica and optimizer and the same cases, and all ranks share the host's cores and
memory bus. What they exchange is what a GPU node's ranks exchange on the host: nothing per
gradient (the gradient reduction of a GPU node runs on the GPUs, so none is emulated here) and a
barrier before every iteration, so that the ranks' iterations run side by side as the
collectives of a real step keep them (the barrier is not timed). Each rank is given its share of
the CPUs (``cpus[rank::ranks]`` of the launcher's mask, where there are enough), as a launcher
that gives each rank its cores does; one optimizer thread per rank, as with one rank.

The node's iteration is as fast as its slowest rank: per round, mode and iteration the record
kept is that of the rank whose iteration took longest (:func:`slowest`), and the report is
computed from those records as for one rank. Parameters must equal overlap off on every rank.

:func:`launch` is the parent's side (it runs torchrun and reads rank 0's result file);
:class:`Ranks` is a rank's side.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = ["RESULT_FLAG", "Ranks", "launch", "slowest"]

#: The hidden flag a rank gets: where rank 0 writes the result (JSON) for the parent.
RESULT_FLAG = "--rank-result"
#: How long the ranks may run (the whole benchmark at 2 ranks takes minutes).
TIMEOUT_S = 3600.0


def launch(argv: Sequence[str], ranks: int, *, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """Run ``python -m bench.overlap argv`` in ``ranks`` torchrun processes; rank 0's result."""
    from bench.train._dist import run_torchrun

    with tempfile.TemporaryDirectory(prefix="overlap-ranks-") as tmp:
        path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "bench.overlap", *argv, RESULT_FLAG, str(path)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = run_torchrun(cmd, timeout_s=timeout_s, env=env)
        if proc.returncode != 0 or not path.exists():
            tail = "\n".join((proc.stderr or "").strip().splitlines()[-20:])
            raise RuntimeError(f"bench.overlap --ranks {ranks}: torchrun exited with {proc.returncode}:\n{tail}")
        return json.loads(path.read_text())


@dataclass(slots=True)
class Ranks:
    """This rank in a torchrun group (gloo): its number, the group's size, its CPUs."""

    rank: int
    world: int
    cpus: list[int]

    @classmethod
    def join(cls) -> Ranks:
        """Join the group torchrun set up and take this rank's share of the CPUs."""
        import torch

        from bench.train._dist import DEFAULT_TIMEOUT_S, setup

        info = setup(torch.device("cpu"), timeout_s=DEFAULT_TIMEOUT_S)
        mask = sorted(os.sched_getaffinity(0))
        mine = mask[info.rank::info.world_size] if len(mask) >= info.world_size else mask
        os.sched_setaffinity(0, mine)
        return cls(rank=info.rank, world=info.world_size, cpus=mine)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def mean(self, value: float) -> float:
        """The ranks' mean of ``value`` (every rank uses the same modelled GPU time)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item()) / self.world

    def gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def slowest(per_rank: Sequence[list[dict[str, list[dict[str, Any]]]]]) -> list[dict[str, list[dict[str, Any]]]]:
    """The node's rounds from every rank's (same shape): per round, mode and iteration, the
    record of the rank whose iteration took longest, with ``rank`` added."""
    out = []
    for rounds in zip(*per_rank):
        merged: dict[str, list[dict[str, Any]]] = {}
        for mode in rounds[0]:
            merged[mode] = []
            for i in range(len(rounds[0][mode])):
                k = max(range(len(rounds)), key=lambda k: rounds[k][mode][i]["iter_s"])
                merged[mode].append({**rounds[k][mode][i], "rank": k})
        out.append(merged)
    return out
