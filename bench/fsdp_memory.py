"""Host memory of CPUOffloadAdamW per rank under FSDP2, at several world sizes, on one model.

    python -m bench.fsdp_memory                              # small GPT, world sizes 1, 2, 4
    python -m bench.fsdp_memory --model-size tiny --world-sizes 1,2 --out-dir /tmp/mem

For each world size it launches that many gloo ranks (``torch.distributed.run --standalone``) on
this machine. Each rank builds the same GPT in fp32, shards it (``bench.train._fsdp.shard_model``), runs
one forward/backward so that FSDP's buffers, gradients and the allocator's pools exist, and reads
its RSS (after constructing, stepping and closing a 4096-parameter optimizer, so one-off
per-process costs are not counted); then it constructs ``CPUOffloadAdamW`` and runs two steps (every slab page written) and
reads its RSS again. The optimizer's host bytes are the difference, divided by the parameter
count of the *whole* model: with the state sharded it should fall as 1/world size (8 B per
local parameter: exp_avg and exp_avg_sq; an fp32 parameter on the CPU is its own master). The optimizer's
own count of its slab bytes is reported next to it as a cross-check. RSS also moves with the
allocator's reuse of freed memory: the ranks run with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc
maps every tensor of 64 KiB or more on its own and unmaps it when freed), without which the
slabs partly land in memory freed by the model's construction and sharding and the delta
undercounts them. A delta is accurate to a few MiB, not bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

from bench._args import OUT_DIR_HELP, HelpFormatter, int_list, output_dir
from bench._cli import bench_main
from bench._stats import machine_info
from bench.train.model import PRESETS

__all__ = ["main", "measure_rank"]

_MIB = 2**20


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def measure_rank(model_size: str, steps: int = 2) -> dict[str, Any]:
    """This rank's measurement (needs the default process group; see the module doc)."""
    import torch.distributed as dist

    from bench.train._fsdp import shard_model
    from bench.train.model import GPT, SyntheticTokens, count_params, preset
    from offload import CPUOffloadAdamW
    from offload.state._dtensor import local

    cfg = preset(model_size)
    torch.manual_seed(0)
    model = GPT(cfg)
    n_global = count_params(model)
    shard_model(model)
    data = SyntheticTokens(vocab_size=cfg.vocab_size, batch_size=2, seq_len=16, seed=0, stream=dist.get_rank())

    def fwd_bwd() -> None:
        model(*data.next_batch()).backward()

    for _ in range(3):  # steady state: FSDP's buffers, gradients, the allocator's pools
        fwd_bwd()
    # One-off costs of any optimizer in this process (thread plan exchange over gloo, worker
    # thread and its malloc arena, lazy imports) are not per parameter: pay them first.
    probe = torch.nn.Parameter(torch.zeros(4096))
    probe.grad = torch.zeros(4096)
    warm = CPUOffloadAdamW([probe], lr=1e-3)
    warm.step()
    warm.close()
    del warm, probe
    gc.collect()
    before = _rss()
    opt = CPUOffloadAdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):  # no forward/backward in between: its buffers would blur the delta
        opt.step()
    gc.collect()
    after = _rss()
    slab_bytes = opt._layout.slabs.nbytes
    opt.close()
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "global_params": n_global,
        "local_params": sum(local(p).numel() for p in model.parameters()),
        "rss_before_optimizer": before,
        "rss_after_steps": after,
        "optimizer_rss_bytes": after - before,
        "optimizer_slab_bytes": slab_bytes,
        "rss_bytes_per_global_param": (after - before) / n_global,
        "slab_bytes_per_global_param": slab_bytes / n_global,
    }


def _worker(args: argparse.Namespace) -> int:
    from bench.train import _dist

    torch.set_num_threads(1)
    info = _dist.setup(torch.device("cpu"), group=True)
    try:
        row = measure_rank(args.model_size)
    finally:
        _dist.teardown(info)
    Path(args.worker_out, f"rank{row['rank']}.json").write_text(json.dumps(row))
    return 0


def _run_world(world_size: int, model_size: str) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="fsdp-mem-") as tmp:
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE")}
        repo = str(Path(__file__).absolute().parents[1])
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        # glibc: every allocation >= 64 KiB is its own mapping, returned to the OS when freed
        # (no dynamic threshold), so RSS counts live tensors, not freed ones kept for reuse.
        env["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(world_size), "-m", "bench.fsdp_memory", "--model-size", model_size, "--worker-out", tmp]
        subprocess.run(cmd, env=env, check=True, timeout=1800)
        return sorted((json.loads(p.read_text()) for p in Path(tmp).glob("rank*.json")), key=lambda r: r["rank"])


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Host memory of CPUOffloadAdamW per rank under FSDP2",
        "",
        f"`{result['command']}`, {result['model_size']} GPT ({result['global_params']:,} parameters, fp32), "
        f"torch {result['torch']}, {result['machine'].get('cpu_model', 'unknown CPU')}.",
        "",
        "Optimizer RSS = RSS after constructing the optimizer and 2 steps minus RSS before (after 3 "
        "forward/backward passes of the sharded model and a 4096-parameter warm-up optimizer), "
        "ranks run with `MALLOC_MMAP_THRESHOLD_=65536` so freed memory is not reused unseen. Bytes "
        "are per parameter of the whole model; slab B/param is the optimizer's own count.",
        "",
        "| world size | rank | local params | optimizer RSS (MiB) | RSS B/param | slab B/param |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for world in result["worlds"]:
        for r in world["ranks"]:
            lines.append(f"| {r['world_size']} | {r['rank']} | {r['local_params']:,} | "
                         f"{r['optimizer_rss_bytes'] / _MIB:.1f} | {r['rss_bytes_per_global_param']:.2f} | "
                         f"{r['slab_bytes_per_global_param']:.2f} |")
    lines += ["", "| world size | max RSS B/param over ranks | x world size |", "|---:|---:|---:|"]
    for world in result["worlds"]:
        worst = max(r["rss_bytes_per_global_param"] for r in world["ranks"])
        lines.append(f"| {world['world_size']} | {worst:.2f} | {worst * world['world_size']:.2f} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.fsdp_memory", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model-size", choices=sorted(PRESETS), default="small", help="GPT preset")
    p.add_argument("--world-sizes", type=int_list, default=[1, 2, 4], help="comma-separated rank counts")
    p.add_argument("--out-dir", type=output_dir, default=None, help=OUT_DIR_HELP)
    p.add_argument("--name", default="fsdp_memory", help="result file stem")
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    return p


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    worlds = []
    for w in args.world_sizes:
        ranks = _run_world(w, args.model_size)
        if len(ranks) != w:
            raise SystemExit(f"world size {w}: {len(ranks)} rank results, expected {w}")
        worlds.append({"world_size": w, "ranks": ranks})
        worst = max(r["rss_bytes_per_global_param"] for r in ranks)
        print(f"world size {w}: optimizer RSS per global parameter, max over ranks {worst:.2f} B", flush=True)
    return {
        "command": " ".join(["python -m bench.fsdp_memory", *argv]),
        "model_size": args.model_size,
        "global_params": worlds[0]["ranks"][0]["global_params"],
        "torch": torch.__version__,
        "machine": machine_info(),
        "worlds": worlds,
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a.startswith("--worker-out") for a in argv):  # one rank of _run_world's launch
        return _worker(build_parser().parse_args(argv))
    bench_main(argv, build_parser=build_parser, run=run, render_markdown=_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
