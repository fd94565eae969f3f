"""The fused-mp AdamW kernel against the torch path on a bf16 model, and against the memory bus.

    python -m bench.membus.fused_mp                        # 125M-parameter GPT shapes, threads 1..cpus
    python -m bench.membus.fused_mp --threads 2 --rounds 21
    python -m bench.membus.fused_mp --model-size tiny --allow-small --rounds 3   # smoke run, seconds

No forward or backward: the model's parameter shapes are laid out as flat host slabs (fp32 master,
exp_avg, exp_avg_sq; bf16 parameter and gradient; the torch path's fp32 gradient buffer) split
into per-parameter views, and whole parameters are grouped into chunks of about
``--chunk-numel`` elements, as the offload pipeline hands them to its kernel. Per round and
thread count, in rotating order (ABC, BCA, CAB), one full optimizer step of:

* ``torch``: per chunk, upcast the bf16 gradient into the fp32 buffer (read 2 + write 4 B/param),
  ``torch._fused_adamw_`` on the fp32 master and moments (28 B), copy the master into the bf16
  parameter (read 4 + write 2 B): 40 B per parameter;
* ``fused-mp``: per chunk, :func:`offload.kernels._fused_mp.fused_mp_adamw_steps_` (one step tensor
  shared by every parameter, set before the step): read the bf16 gradient (2 B),
  read and write master, exp_avg, exp_avg_sq (24 B), write the bf16 parameter (2 B): 28 B;
* ``probe``: the read-4/write-3 streaming probe ``c_4r3w`` of :mod:`bench.membus._stream` over four
  fp32 buffers as long as the model: per element, load p, g, m, v and store p, m, v in place,
  16 B read + 12 B written = 28 B, no AdamW arithmetic.

Reported: median and IQR of each step time, effective GB/s from the bytes above (write-allocate
reads of the bf16 parameter and of the fp32 buffer are not counted), the best thread count of each
backend, the speed-up torch/fused-mp at the best thread counts (target >= 1.3) and fused-mp GB/s
over probe GB/s (target >= 0.9); and, at fused-mp's best thread count, the median and IQR of the
same two ratios taken per round (the three variants of a round run back to back, so load that
drifts over the run cancels out of them). The load average before and after is recorded: other
processes share the CPUs. Results go to ``<out-dir>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from bench._args import thread_list
from bench._cli import bench_entry
from bench._stats import machine_info
from bench.membus._harness import add_output, command, interleaved, new_parser, paired, rotation, summary, timed
from bench.membus._stream import PROBE_BYTES_PER_ELEMENT, ProbeBuffers, c_kernel_status
from bench.train.model import GPT, PRESETS, preset
from offload import thread_limit
from offload.kernels._fused_mp import bitwise_matches_torch, fused_mp_adamw_steps_, fused_mp_available
from offload.kernels._mp_reference import torch_mp_adamw_

logger = logging.getLogger("bench.membus.fused_mp")

__all__ = ["BYTES_PER_PARAM", "at_best_threads", "build_parser", "main", "run"]

#: Bytes per parameter each variant moves (see the module docstring).
BYTES_PER_PARAM = {"torch": 40, "fused-mp": 28, "probe": PROBE_BYTES_PER_ELEMENT["c_4r3w"]}
TARGET_SPEEDUP = 1.3
TARGET_PROBE_RATIO = 0.9
_MIN_PARAMS = 100_000_000
_HYPER = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
_VARIANTS = ("torch", "fused-mp", "probe")


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("fused_mp", __doc__.split("\n\n")[0])
    p.add_argument("--model-size", choices=sorted(PRESETS), default="125m",
                   help="GPT preset whose parameter shapes are used")
    p.add_argument("--threads", type=thread_list, default=None,
                   help="thread counts (default 1..cpus)")
    p.add_argument("--chunk-numel", type=int, default=4 << 20,
                   help="elements per kernel call (whole parameters grouped up to this size)")
    p.add_argument("--rounds", type=int, default=15, help="measured interleaved rounds")
    p.add_argument("--warmup", type=int, default=2, help="discarded rounds before measuring")
    p.add_argument("--allow-small", action="store_true",
                   help=f"accept models under {_MIN_PARAMS:,} parameters")
    add_output(p, "fused_mp")
    p.add_argument("--note", default="", help="free text stored with the result")
    return p


class _Slabs:
    """Flat host slabs for a list of parameter sizes, viewed per parameter and grouped in chunks."""

    def __init__(self, sizes: Sequence[int], chunk_numel: int, seed: int = 0) -> None:
        total = sum(sizes)
        gen = torch.Generator().manual_seed(seed)
        self.numel = total
        self.master = 0.02 * torch.randn(total, generator=gen)
        self.exp_avg = torch.zeros(total)
        self.exp_avg_sq = torch.zeros(total)
        self.param = self.master.to(torch.bfloat16)
        self.grad = (1e-3 * torch.randn(total, generator=gen)).to(torch.bfloat16)
        self.grad32 = torch.empty(total)  # the torch path's upcast buffer
        self.step = torch.zeros(())  # the fused kernel's step tensor (every parameter's)
        self.chunks: list[dict[str, list[torch.Tensor]]] = []
        offset, current = 0, self._empty_chunk()
        for n in sizes:
            for key, slab in (("params_lowp", self.param), ("grads_lowp", self.grad),
                              ("masters", self.master), ("exp_avgs", self.exp_avg),
                              ("exp_avg_sqs", self.exp_avg_sq), ("grad_buffers", self.grad32)):
                current[key].append(slab[offset:offset + n])
            current["state_steps"].append(self.step)
            offset += n
            if sum(t.numel() for t in current["masters"]) >= chunk_numel:
                self.chunks.append(current)
                current = self._empty_chunk()
        if current["masters"]:
            self.chunks.append(current)

    @staticmethod
    def _empty_chunk() -> dict[str, list[torch.Tensor]]:
        keys = ("params_lowp", "grads_lowp", "masters", "exp_avgs", "exp_avg_sqs", "grad_buffers",
                "state_steps")
        return {key: [] for key in keys}


def _model_sizes(size: str) -> list[int]:
    with torch.device("meta"):
        model = GPT(preset(size))
    return [p.numel() for p in model.parameters()]


def at_best_threads(per_threads: dict[str, dict[str, Any]], threads: Sequence[int]) -> dict[str, Any]:
    """Each variant's best thread count, torch / fused-mp and fused-mp GB/s / probe GB/s at those
    counts, and the per-round ratios at fused-mp's best count (paired at one thread count, where
    the fused kernel is compared with both); shared with :mod:`bench.membus.fused_mp_optimizer`."""
    best = {v: min(threads, key=lambda t: per_threads[str(t)][v]["median_s"]) for v in _VARIANTS}
    best_of = {v: per_threads[str(best[v])][v] for v in _VARIANTS}
    return {"best_threads": best,
            "speedup_torch_over_fused": best_of["torch"]["median_s"] / best_of["fused-mp"]["median_s"],
            "fused_over_probe_gbps": best_of["fused-mp"]["gbps"] / best_of["probe"]["gbps"],
            "paired_at_fused_best_threads": per_threads[str(best["fused-mp"])]["paired"]}


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    ok, reason = fused_mp_available()
    if not ok:
        raise SystemExit(f"fused-mp kernel unavailable: {reason}")
    sizes = _model_sizes(args.model_size)
    numel = sum(sizes)
    if numel < _MIN_PARAMS and not args.allow_small:
        raise SystemExit(f"--model-size {args.model_size} has {numel:,} parameters: "
                         f"expected >= {_MIN_PARAMS:,} (or pass --allow-small)")
    threads = args.threads or list(range(1, (os.cpu_count() or 1) + 1))
    load_before = [round(x, 2) for x in os.getloadavg()]
    logger.info("%s: %d parameters in %d tensors, threads %s, load %s", args.model_size, numel,
                len(sizes), threads, load_before)
    slabs = _Slabs(sizes, args.chunk_numel)
    probe = ProbeBuffers(numel)
    step = 0

    def torch_step() -> None:
        for chunk in slabs.chunks:
            torch_mp_adamw_(chunk["params_lowp"], chunk["grads_lowp"], chunk["masters"],
                            chunk["exp_avgs"], chunk["exp_avg_sqs"], step=step,
                            grad_buffers=chunk["grad_buffers"], **_HYPER)

    def fused_step() -> None:
        for chunk in slabs.chunks:
            fused_mp_adamw_steps_(chunk["params_lowp"], chunk["grads_lowp"], chunk["masters"],
                                  chunk["exp_avgs"], chunk["exp_avg_sqs"], chunk["state_steps"], **_HYPER)

    def visit(variant: str, t: int) -> float:
        nonlocal step
        step += 1
        slabs.step.fill_(step)
        if variant == "probe":
            return probe.run("c_4r3w", t).seconds
        with thread_limit(t):
            return timed(torch_step if variant == "torch" else fused_step)

    samples = interleaved({(v, t): functools.partial(visit, v, t) for v in _VARIANTS for t in threads},
                          args.rounds, warmup=args.warmup, progress=logger,
                          order=lambda r: [(v, t) for t in threads for v in rotation(_VARIANTS, r)])
    load_after = [round(x, 2) for x in os.getloadavg()]

    per_threads: dict[str, dict[str, Any]] = {}
    for t in threads:
        row: dict[str, Any] = {
            v: summary(samples[(v, t)], BYTES_PER_PARAM[v] * numel) for v in _VARIANTS
        }
        # Per-round ratios: the three variants of a round run back to back, so load that drifts
        # over the run (other processes on shared CPUs) cancels out of each ratio.
        fused = samples[("fused-mp", t)]
        row["paired"] = {
            "torch_over_fused": paired(samples[("torch", t)], fused),
            "fused_over_probe_gbps": paired(samples[("probe", t)], fused,
                                            BYTES_PER_PARAM["fused-mp"] / BYTES_PER_PARAM["probe"]),
        }
        per_threads[str(t)] = row
    head = at_best_threads(per_threads, threads)
    speedup, probe_ratio = head["speedup_torch_over_fused"], head["fused_over_probe_gbps"]
    at_best = head["paired_at_fused_best_threads"]
    return {
        "command": command("fused_mp", argv),
        "model_size": args.model_size,
        "params": numel,
        "tensors": len(sizes),
        "chunks": len(slabs.chunks),
        "chunk_numel": args.chunk_numel,
        "threads": threads,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "bytes_per_param": BYTES_PER_PARAM,
        "probe": {"name": "c_4r3w", "build": c_kernel_status()},
        "kernel": {"available": reason, "bitwise_matches_torch": bitwise_matches_torch()},
        "per_threads": per_threads,
        **head,
        "targets": {"speedup": TARGET_SPEEDUP, "probe_ratio": TARGET_PROBE_RATIO,
                    "speedup_met": speedup >= TARGET_SPEEDUP,
                    "probe_ratio_met": probe_ratio >= TARGET_PROBE_RATIO,
                    "paired_speedup_met": at_best["torch_over_fused"]["median"] >= TARGET_SPEEDUP,
                    "paired_probe_ratio_met":
                        at_best["fused_over_probe_gbps"]["median"] >= TARGET_PROBE_RATIO},
        "load_avg_before": load_before,
        "load_avg_after": load_after,
        "note": args.note,
        "machine": machine_info(),
    }


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def render_markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        "# fused-mp AdamW vs the torch path (bf16 model)",
        "",
        f"`{result['command']}`",
        "",
        f"- Machine: {m['cpu_model']}, {m['logical_cpus']} logical CPUs, {m['memory_gib']} GiB, "
        f"torch {m['torch']} ({m['torch_cpu_capability']}, {m['torch_parallel_backend']}), "
        f"{m['date_utc']}",
        f"- Load average (1/5/15 min) before {result['load_avg_before']}, after "
        f"{result['load_avg_after']} (the CPUs are shared with other processes)",
        f"- Model: `{result['model_size']}` GPT shapes, {result['params']:,} bf16 parameters in "
        f"{result['tensors']} tensors, {result['chunks']} kernel calls of "
        f"~{result['chunk_numel']:,} elements",
        f"- {result['rounds']} interleaved rounds (+{result['warmup']} warm-up) per thread count; "
        "median / IQR of one full optimizer step",
        f"- Bytes per parameter: torch path {BYTES_PER_PARAM['torch']} "
        "(upcast 6 + AdamW 28 + downcast 6), "
        f"fused-mp {BYTES_PER_PARAM['fused-mp']}, probe `c_4r3w` {BYTES_PER_PARAM['probe']} "
        "(read p, g, m, v; write p, m, v; fp32, in place)",
        f"- Kernel bitwise identical to the torch path on this build: "
        f"{result['kernel']['bitwise_matches_torch']}",
        "",
        "| threads | torch ms (IQR) | fused-mp ms (IQR) | probe ms (IQR) | torch/fused "
        "| fused GB/s | probe GB/s | fused/probe | paired torch/fused (IQR) "
        "| paired fused/probe (IQR) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t, row in result["per_threads"].items():
        tr, fu, pr = row["torch"], row["fused-mp"], row["probe"]
        ps, pp = row["paired"]["torch_over_fused"], row["paired"]["fused_over_probe_gbps"]
        lines.append(
            f"| {t} | {_ms(tr['median_s'])} ({_ms(tr['iqr_s'])}) | {_ms(fu['median_s'])} "
            f"({_ms(fu['iqr_s'])}) | {_ms(pr['median_s'])} ({_ms(pr['iqr_s'])}) | "
            f"{tr['median_s'] / fu['median_s']:.2f}x | {fu['gbps']:.1f} | {pr['gbps']:.1f} | "
            f"{fu['gbps'] / pr['gbps']:.2f} | {ps['median']:.2f}x ({ps['iqr']:.2f}) | "
            f"{pp['median']:.2f} ({pp['iqr']:.2f}) |"
        )
    tg = result["targets"]
    best = result["best_threads"]
    paired = result["paired_at_fused_best_threads"]
    lines += [
        "",
        f"At each variant's best thread count (torch {best['torch']}, fused-mp {best['fused-mp']}, "
        f"probe {best['probe']}):",
        "",
        f"- speed-up torch / fused-mp: **{result['speedup_torch_over_fused']:.2f}x** "
        f"(target >= {tg['speedup']}: {'met' if tg['speedup_met'] else 'NOT met'})",
        f"- fused-mp GB/s / probe GB/s: **{result['fused_over_probe_gbps']:.2f}** "
        f"(target >= {tg['probe_ratio']}: {'met' if tg['probe_ratio_met'] else 'NOT met'})",
        "",
        f"Median of per-round ratios at fused-mp's best thread count ({best['fused-mp']}); each "
        "round runs the three variants back to back, so load that drifts during the run cancels:",
        "",
        f"- torch / fused-mp: **{paired['torch_over_fused']['median']:.2f}x** "
        f"(IQR {paired['torch_over_fused']['iqr']:.2f}; "
        f"{'met' if tg['paired_speedup_met'] else 'NOT met'})",
        f"- fused-mp GB/s / probe GB/s: **{paired['fused_over_probe_gbps']['median']:.2f}** "
        f"(IQR {paired['fused_over_probe_gbps']['iqr']:.2f}; "
        f"{'met' if tg['paired_probe_ratio_met'] else 'NOT met'})",
    ]
    if result["note"]:
        lines += ["", f"Note: {result['note']}"]
    return "\n".join(lines) + "\n"


main = bench_entry(build_parser=build_parser, run=run, render_markdown=render_markdown)


if __name__ == "__main__":
    raise SystemExit(main())
