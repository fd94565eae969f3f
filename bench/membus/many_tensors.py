"""Per-tensor cost: an MoE-shaped model of ~20,000 small and medium tensors, offloaded vs torch.

    python -m bench.membus.many_tensors                       # moe preset (~19k tensors), 1 and 2 threads
    python -m bench.membus.many_tensors --quick --out-dir /tmp/mt   # a few hundred tensors (CI smoke)

Mixture-of-experts models (Qwen3-30B-A3B: 48 layers x 128 experts x 3 matrices) hold tens of
thousands of parameter tensors, most of them small. A step whose Python work grows per tensor
falls behind torch's fused AdamW there even when its kernel is as fast. The preset: ``layers``
layers, each with ``experts`` x 3 expert matrices (``expert_dim`` x ``expert_hidden``), a router,
four attention matrices and two norm vectors (all fp32, on the CPU, synthetic gradients, no
forward/backward).

Interleaved rounds, at each thread count: a step of ``CPUOffloadAdamW`` (default settings, one
chunk layout), a step of ``torch.optim.AdamW(fused=True)`` on an identical copy of the parameters
(with ``torch.set_num_threads`` at the same count). Reported: step medians and their ratio, and the
construction time (optimizer construction plus first step, which allocates torch's state lazily)
of each, once per process.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from bench._args import thread_list
from bench._cli import bench_entry
from bench._stats import iqr, machine_info, median
from bench.membus._harness import add_output, alternate, command, new_parser, timed

logger = logging.getLogger("bench.membus.many_tensors")

__all__ = ["MoEShape", "PRESETS", "make_params", "main", "run"]

#: Targets: step within 1.2x of torch fused AdamW (the per-tensor work must not dominate where
#: tensors are small), construction within 5x (it is paid once per run).
STEP_TARGET = 1.2
BUILD_TARGET = 5.0


@dataclass(frozen=True, slots=True)
class MoEShape:
    layers: int
    experts: int
    expert_dim: int
    expert_hidden: int
    model_dim: int

    @property
    def num_tensors(self) -> int:
        return self.layers * (3 * self.experts + 1 + 4 + 2)


PRESETS: dict[str, MoEShape] = {
    # 48 x (3 x 128 + 7) = 18,768 tensors, ~25M parameters.
    "moe": MoEShape(layers=48, experts=128, expert_dim=64, expert_hidden=24, model_dim=192),
    "quick": MoEShape(layers=4, experts=16, expert_dim=32, expert_hidden=16, model_dim=64),
}


def make_params(shape: MoEShape, seed: int = 0) -> list[torch.Tensor]:
    """The preset's parameters (leaf fp32 tensors with gradients), in a fixed order."""
    gen = torch.Generator().manual_seed(seed)
    params: list[torch.Tensor] = []

    def new(*size: int) -> None:
        p = torch.randn(*size, generator=gen).mul_(0.02).requires_grad_(True)
        p.grad = torch.randn(*size, generator=gen).mul_(1e-2)
        params.append(p)

    d, h, m = shape.expert_dim, shape.expert_hidden, shape.model_dim
    for _ in range(shape.layers):
        for _ in range(shape.experts):
            new(h, d)  # gate
            new(h, d)  # up
            new(d, h)  # down
        new(shape.experts, m)  # router
        for _ in range(4):
            new(m, m)  # q, k, v, o
        new(m)
        new(m)  # two norms
    return params


def _copy(params: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for p in params:
        q = p.detach().clone().requires_grad_(True)
        q.grad = p.grad.clone()  # type: ignore[union-attr]
        out.append(q)
    return out


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    from offload import CPUOffloadAdamW, OffloadSettings

    shape = PRESETS[args.preset]
    ours_p = make_params(shape)
    ref_p = _copy(ours_p)
    numel = sum(p.numel() for p in ours_p)
    logger.info("%s: %d tensors, %s parameters", args.preset, len(ours_p), f"{numel:,}")
    main_threads = torch.get_num_threads()

    # Construction (+ first step: both optimizers allocate state then), each once.
    torch.set_num_threads(args.threads[-1])
    ours: list[Any] = []
    ours_build = timed(lambda: (ours.append(CPUOffloadAdamW(
        ours_p, lr=1e-4, settings=OffloadSettings(threads=args.threads[-1]))), ours[0].step()))
    opt = ours[0]
    refs: list[Any] = []
    ref_build = timed(lambda: (refs.append(torch.optim.AdamW(ref_p, lr=1e-4, fused=True)), refs[0].step()))
    ref = refs[0]

    samples: dict[int, dict[str, list[float]]] = {t: {"ours": [], "torch": [], "kernel": []} for t in args.threads}
    for rnd in range(args.repeats):
        for threads in alternate(args.threads, rnd):
            opt.apply_settings(OffloadSettings(threads=threads))
            opt.step()  # discarded: first step after a change
            torch.set_num_threads(threads)
            ref.step()
            for _ in range(args.steps):
                samples[threads]["ours"].append(timed(opt.step))
                samples[threads]["kernel"].append(opt.last_stats.adam_kernel_s)
                samples[threads]["torch"].append(timed(ref.step))
        logger.info("round %d/%d done", rnd + 1, args.repeats)
    torch.set_num_threads(main_threads)
    kernel = opt.settings.kernel
    opt.close()

    rows = []
    for threads, s in samples.items():
        ours_s, torch_s = median(s["ours"]), median(s["torch"])
        rows.append({
            "threads": threads, "ours_step_s": ours_s, "ours_iqr_s": iqr(s["ours"]),
            "ours_kernel_s": median(s["kernel"]), "torch_step_s": torch_s, "torch_iqr_s": iqr(s["torch"]),
            "ratio": ours_s / torch_s, "meets_target": ours_s / torch_s <= STEP_TARGET,
            "samples": s,
        })
    result = {
        "benchmark": "bench.membus.many_tensors",
        "command": command("many_tensors", argv),
        "machine": machine_info(),
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "note": args.note,
        "preset": args.preset, "shape": shape.__dict__ if hasattr(shape, "__dict__") else {
            f: getattr(shape, f) for f in MoEShape.__dataclass_fields__},
        "tensors": len(ours_p), "params": numel, "kernel": kernel,
        "build_s": {"ours": ours_build, "torch": ref_build, "ratio": ours_build / ref_build,
                    "meets_target": ours_build / ref_build <= BUILD_TARGET},
        "rows": rows, "step_target": STEP_TARGET, "build_target": BUILD_TARGET,
    }
    return result


def render_markdown(result: dict[str, Any]) -> str:
    m, b = result["machine"], result["build_s"]
    out = [
        f"# Many tensors: {result['tensors']:,} tensors, {result['params']:,} fp32 parameters ({result['preset']})",
        "",
        f"- command: `{result['command']}`",
        f"- date (UTC): {m['date_utc']}; CPU: {m['cpu_model']}, {m['affinity_cpus']} CPUs in the affinity "
        f"mask; torch {m['torch']}; load average before {m['load_avg_1_5_15']}, after {result['load_avg_after']}",
        f"- CPUOffloadAdamW kernel: {result['kernel']}",
    ]
    if result["note"]:
        out.append(f"- note: {result['note']}")
    out += [
        f"- construction + first step: CPUOffloadAdamW {b['ours'] * 1e3:.0f} ms, torch AdamW(fused=True) "
        f"{b['torch'] * 1e3:.0f} ms, ratio {b['ratio']:.2f} (target <= {result['build_target']}: "
        f"{'met' if b['meets_target'] else 'not met'})",
        "",
        "Interleaved steps (medians, IQR in parentheses):",
        "",
        "| threads | CPUOffloadAdamW step ms | its kernel ms | torch fused AdamW step ms | ratio | target |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        out.append(f"| {r['threads']} | {r['ours_step_s'] * 1e3:.1f} ({r['ours_iqr_s'] * 1e3:.1f}) | "
                   f"{r['ours_kernel_s'] * 1e3:.1f} | {r['torch_step_s'] * 1e3:.1f} ({r['torch_iqr_s'] * 1e3:.1f}) | "
                   f"{r['ratio']:.2f} | <= {result['step_target']}: {'met' if r['meets_target'] else 'not met'} |")
    return "\n".join(out) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("many_tensors", __doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="tensor shapes (default moe; quick with --quick)")
    p.add_argument("--threads", type=thread_list, default=None,
                   help="comma-separated thread counts (default 1..cpus)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 5; 2 with --quick)")
    p.add_argument("--steps", type=int, default=2, help="measured steps per optimizer, thread count and round")
    p.add_argument("--quick", action="store_true", help="the quick preset, 2 rounds")
    add_output(p, None, "result file stem (default many_tensors[-quick])")
    p.add_argument("--note", default="", help="free text stored with the result (e.g. machine load)")
    return p


def _resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    args.threads = args.threads or list(range(1, cpus + 1))
    if args.steps < 1:
        p.error(f"--steps {args.steps}: expected an integer >= 1")
    args.preset = args.preset or ("quick" if args.quick else "moe")
    args.repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: expected an integer >= 1")
    args.name = args.name or ("many_tensors-quick" if args.quick else "many_tensors")


main = bench_entry(build_parser=build_parser, run=run, resolve=_resolve, render_markdown=render_markdown)


if __name__ == "__main__":
    sys.exit(main())
