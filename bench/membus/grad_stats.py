"""The gradient norm/checksum pass and the clipped step kernel, against the memory bus.

    python -m bench.membus.grad_stats                       # 50M fp32, 2 threads, 15 rounds
    python -m bench.membus.grad_stats --numel 1000000 --rounds 3   # smoke run, seconds

Per round, in rotating order, on one fp32 gradient of ``--numel`` elements (and its bf16 copy):

* ``grad_stats``: :func:`offload.kernels._grad_stats.grad_stats_` (norm term + checksum), 4 B read per
  element; ``grad_stats_bf16`` the same on the bf16 copy (2 B);
* ``vector_norm``: ``torch.linalg.vector_norm`` (4 B read);
* ``copy``: ``out.copy_(g)`` into a preallocated buffer (4 B read + 4 B written), and ``clone``:
  ``g.clone()`` (the same plus a fresh allocation's page faults), and ``fill``: ``out.fill_(0.5)``
  (4 B written, nothing read), the memory's yardsticks;
* ``step`` / ``step_coef``: the native fp32 AdamW kernel on master, gradient and moments (28 B),
  without and with ``grad_coef`` (applied inside the kernel); ``clipped_step`` = grad_stats +
  step_coef, the cost of a clipped step against ``step`` (target <= 1.15x).

Reported: median and IQR per variant, GB/s from the bytes above at the median and at the best
round (on a shared machine the best round is the one least disturbed), the read side alone
(bytes read / median time: the step reads 16 B of its 28), and per-round ratios
(clipped_step/step, step_coef/step, vector_norm/grad_stats). Why the read side: on the 2-core VM
the step's reads ran at about the speed of the norm pass, a pure read, while its writes came on
top (reads and writes do not share one ceiling there), so the step is bound by its 16 B of reads
and a pass that reads the 4 B of gradients once more costs about ``4 / 16`` of the step whatever
its code: the report states that floor from the measured read speeds. Results go to ``<out-dir>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench._cli import bench_entry
from bench._stats import iqr, machine_info, median
from bench.membus._harness import add_output, interleaved, new_parser, paired, timed
from offload import thread_limit
from offload.kernels._fused_mp import fused_mp_available
from offload.kernels._grad_stats import grad_stats_
from offload.kernels._adamw import Hyper, native_adamw_f32_

__all__ = ["BYTES_PER_ELEMENT", "BYTES_READ", "build_parser", "main", "read_bound_floor", "run"]

logger = logging.getLogger("bench.membus.grad_stats")

#: Bytes per element each variant moves (see the module docstring).
BYTES_PER_ELEMENT = {"grad_stats": 4, "grad_stats_bf16": 2, "vector_norm": 4, "copy": 8,
                     "clone": 8, "fill": 4, "step": 28, "step_coef": 28, "clipped_step": 32}
#: Of which read (the rest is written).
BYTES_READ = {"grad_stats": 4, "grad_stats_bf16": 2, "vector_norm": 4, "copy": 4, "clone": 4,
              "fill": 0, "step": 16, "step_coef": 16, "clipped_step": 20}


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("grad_stats", __doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=50_000_000, help="gradient elements")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads")
    p.add_argument("--rounds", type=int, default=15, help="measured interleaved rounds")
    p.add_argument("--warmup", type=int, default=2, help="discarded rounds before measuring")
    add_output(p, "grad_stats")
    return p


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    ok, reason = fused_mp_available()
    if not ok:
        raise SystemExit(f"bench.membus.grad_stats needs the native extension: {reason}")
    n = args.numel
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen)
    grad_bf16 = grad.bfloat16()
    out = torch.empty_like(grad)
    master, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    step = torch.tensor(1.0)
    plain = Hyper(lr=1e-6, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8)
    coef = Hyper(lr=1e-6, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8,
                 grad_coef=torch.tensor(0.5))

    def kernel(hyper: Hyper) -> None:
        native_adamw_f32_([master], [grad], [m], [v], [step], steps_to_increment=(), hyper=hyper)

    def clipped() -> None:
        grad_stats_([grad])
        kernel(coef)

    variants: dict[str, Callable[[], object]] = {
        "grad_stats": lambda: grad_stats_([grad]),
        "grad_stats_bf16": lambda: grad_stats_([grad_bf16]),
        "vector_norm": lambda: torch.linalg.vector_norm(grad),
        "copy": lambda: out.copy_(grad),
        "clone": lambda: grad.clone(),
        "fill": lambda: out.fill_(0.5),
        "step": lambda: kernel(plain),
        "step_coef": lambda: kernel(coef),
        "clipped_step": clipped,
    }
    load_before = os.getloadavg()
    with thread_limit(args.threads):
        samples = interleaved({k: functools.partial(timed, fn) for k, fn in variants.items()}, args.rounds,
                              warmup=args.warmup)
    rows = {k: {"median_s": median(s), "iqr_s": iqr(s), "min_s": min(s),
                "gb_s": BYTES_PER_ELEMENT[k] * n / median(s) / 1e9,
                "best_gb_s": BYTES_PER_ELEMENT[k] * n / min(s) / 1e9,
                "read_gb_s": BYTES_READ[k] * n / median(s) / 1e9} for k, s in samples.items()}
    ratios = {
        "clipped_step/step": paired(samples["clipped_step"], samples["step"]),
        "step_coef/step": paired(samples["step_coef"], samples["step"]),
        "vector_norm/grad_stats": paired(samples["vector_norm"], samples["grad_stats"]),
    }
    return {
        "argv": list(argv), "numel": n, "threads": args.threads, "rounds": args.rounds,
        "variants": rows,
        "ratios": ratios,
        "read_bound_floor": read_bound_floor(rows),
        "load_before": load_before, "load_after": os.getloadavg(), "machine": machine_info(),
    }


def read_bound_floor(rows: dict[str, dict[str, float]]) -> float:
    """clipped/unclipped if the step is bound by its reads: 1 + (4 B at the norm pass's read
    speed) / (16 B at the step's read speed), from the rows' median read GB/s."""
    norm, step = rows["grad_stats"]["read_gb_s"], rows["step"]["read_gb_s"]
    return 1.0 + (BYTES_READ["grad_stats"] / norm) / (BYTES_READ["step"] / step)


def render_markdown(result: dict[str, Any]) -> str:
    lines = [f"# grad_stats: {result['numel']:,} elements, {result['threads']} threads, "
             f"{result['rounds']} rounds", "",
             "| variant | median ms | IQR ms | GB/s (median) | GB/s (best) | of which read, GB/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for k, row in result["variants"].items():
        lines.append(f"| {k} | {row['median_s'] * 1e3:.2f} | {row['iqr_s'] * 1e3:.2f} | "
                     f"{row['gb_s']:.1f} | {row['best_gb_s']:.1f} | {row['read_gb_s']:.1f} |")
    lines += ["", "| per-round ratio | median | IQR |", "|---|---:|---:|"]
    for k, row in result["ratios"].items():
        lines.append(f"| {k} | {row['median']:.3f} | {row['iqr']:.3f} |")
    rows = result["variants"]
    lines += ["", f"The step reads 16 B per element at {rows['step']['read_gb_s']:.1f} GB/s and writes 12 B "
              f"beside them; the norm pass reads 4 B at {rows['grad_stats']['read_gb_s']:.1f} GB/s, a "
              f"write alone runs at {rows['fill']['gb_s']:.1f} GB/s. Where the step's reads run as fast "
              "as a pure read, the step is bound by its reads, and any pass that reads the gradients "
              "once more costs its 4 B at that speed: clipped/unclipped is then at least "
              f"{result['read_bound_floor']:.3f} (1 + (4 B / norm read speed) / (16 B / step read speed))."]
    lines += ["", f"load average before {result['load_before']}, after {result['load_after']}"]
    return "\n".join(lines) + "\n"


main = bench_entry(build_parser=build_parser, run=run, render_markdown=render_markdown)


if __name__ == "__main__":
    raise SystemExit(main())
