"""What following weight edits by content costs the mixed-precision step (issue 25, item 1).

    python -m bench.membus.follow_edits                          # 50M elements, bf16 and fp16, 1 and 2 threads
    python -m bench.membus.follow_edits --numel 2000000 --rounds 3 --allow-small   # smoke run, seconds

A weight edited through ``.data`` (``p.data.clamp_()``) bumps no version counter the optimizer
can see, so for a bf16/fp16 parameter on the host the kernel compares every master, rounded,
with the live weight in its pass (``seen=``/``follow=True`` of
:func:`offload.kernels._adamw.mixed_precision_adamw_`) and takes the weight where they differ.
That reads the weight (2 B per element) besides the step's 28 B. Per round, thread count and
dtype, in alternating order: one step of ``--numel`` elements in ``--chunk-numel`` calls
without the comparison (``plain``), and the same with it (``follow``), on the same buffers
(nothing is edited: the common case, whose cost this is). Reported: each one's median time and
GB/s (28 B per element for both, so ``follow``'s figure shows the time lost), and the median and
IQR of the per-round ratio follow / plain. Results go to ``<out-dir>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench._args import thread_list
from bench._cli import bench_entry
from bench._stats import machine_info, median
from bench.membus._harness import (add_output, command, interleaved, machine_line, new_parser, paired,
                                   require_positive)
from offload import thread_limit
from offload.kernels._adamw import Hyper, mixed_precision_adamw_

__all__ = ["build_parser", "main", "run"]

_MIN_NUMEL = 20_000_000  # past the caches of the machines we run on
_HYPER = Hyper(lr=1e-5, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("follow_edits", __doc__)
    p.add_argument("--numel", type=int, default=50_000_000, help="elements of the step")
    p.add_argument("--chunk-numel", type=int, default=4 << 20, help="elements per kernel call")
    p.add_argument("--threads", type=thread_list, default=None, help="thread counts (default 1..cpus)")
    p.add_argument("--dtypes", default="bf16,fp16", help="comma list of bf16, fp16")
    p.add_argument("--rounds", type=int, default=15, help="measured interleaved rounds")
    p.add_argument("--allow-small", action="store_true", help=f"allow --numel below {_MIN_NUMEL} (caches)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2M elements, 3 rounds")
    add_output(p, "follow_edits")
    return p


def _resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.quick:
        args.numel, args.rounds, args.allow_small = 2_000_000, 3, True
    require_positive(parser, args, "numel", "chunk_numel", "rounds")
    if args.numel < _MIN_NUMEL and not args.allow_small:
        parser.error(f"--numel {args.numel}: expected >= {_MIN_NUMEL} (a step that fits in the caches "
                     "measures no memory traffic), or --allow-small")
    bad = [d for d in args.dtypes.split(",") if d not in _DTYPES]
    if bad:
        parser.error(f"--dtypes {args.dtypes}: expected a comma list of {', '.join(_DTYPES)}")
    if args.threads is None:
        args.threads = list(range(1, (torch.get_num_threads() or 1) + 1))


class _Step:
    """Flat buffers of one step, called in chunks as the pipeline calls the kernel."""

    def __init__(self, numel: int, chunk: int, dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(0)
        self.master = torch.randn(numel, generator=g) * 0.02
        self.weight = self.master.to(dtype)
        self.grad = (torch.randn(numel, generator=g) * 1e-3).to(dtype)
        self.exp_avg, self.exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
        self.step = torch.zeros((), dtype=torch.float32)
        self.spans = [(a, min(numel, a + chunk)) for a in range(0, numel, chunk)]

    def __call__(self, follow: bool) -> float:
        t0 = time.perf_counter()
        for a, b in self.spans:
            mixed_precision_adamw_([self.weight[a:b]], [self.grad[a:b]], [self.master[a:b]], [self.exp_avg[a:b]],
                                   [self.exp_avg_sq[a:b]], [self.step], steps_to_increment=[], hyper=_HYPER,
                                   follow=follow)
        return time.perf_counter() - t0


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    cases = []
    for name in args.dtypes.split(","):
        step = _Step(args.numel, args.chunk_numel, _DTYPES[name])
        step.step.fill_(1.0)
        for count in args.threads:
            with thread_limit(count):
                step(False), step(True)  # warm-up
                times = interleaved({"plain": lambda: step(False), "follow": lambda: step(True)}, args.rounds)
            ratio = paired(times["follow"], times["plain"])
            gbs = {k: 28 * args.numel / median(v) / 1e9 for k, v in times.items()}
            cases.append({"dtype": name, "threads": count,
                          "plain_ms": median(times["plain"]) * 1e3, "follow_ms": median(times["follow"]) * 1e3,
                          "plain_gbs": gbs["plain"], "follow_gbs": gbs["follow"],
                          "ratio_median": ratio["median"], "ratio_iqr": ratio["iqr"], "rounds": args.rounds})
    return {"command": command("follow_edits", argv), "machine": machine_info(),
            "numel": args.numel, "chunk_numel": args.chunk_numel, "cases": cases}


def render_markdown(result: dict[str, Any]) -> str:
    lines = ["# Following weight edits by content: cost in the mixed-precision step", "",
             f"`{result['command']}`", "",
             f"{result['numel']:,} elements in calls of {result['chunk_numel']:,}; nothing edited. "
             "GB/s counts 28 B per element for both (the comparison reads 2 B more).", "",
             "| dtype | threads | plain ms | follow ms | plain GB/s | follow GB/s | follow / plain (median, IQR) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for c in result["cases"]:
        lines.append(f"| {c['dtype']} | {c['threads']} | {c['plain_ms']:.1f} | {c['follow_ms']:.1f} | "
                     f"{c['plain_gbs']:.1f} | {c['follow_gbs']:.1f} | {c['ratio_median']:.3f} ({c['ratio_iqr']:.3f}) |")
    lines += ["", machine_line(result["machine"])]
    return "\n".join(lines) + "\n"


main = bench_entry(build_parser=build_parser, run=run, resolve=_resolve, render_markdown=render_markdown)


if __name__ == "__main__":
    raise SystemExit(main())
