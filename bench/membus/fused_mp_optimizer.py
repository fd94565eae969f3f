"""CPUOffloadAdamW's whole step with kernel="fused-mp" against kernel="torch", and the memory bus.

    python -m bench.membus.fused_mp_optimizer                       # 125M-parameter bf16 GPT, threads 1..cpus
    python -m bench.membus.fused_mp_optimizer --threads 2 --rounds 9
    python -m bench.membus.fused_mp_optimizer --quick --out-dir /tmp/fmo   # smoke run, seconds

One ``CPUOffloadAdamW`` over a bf16 GPT's parameters on the CPU (synthetic bf16 gradients, no
forward or backward); between measurements ``apply_settings`` switches the kernel and thread
count (the state is shared, so both kernels run on the same pages). Per round and thread count,
in rotating order (ABC, BCA, CAB):

* ``torch``: ``kernel="torch"``: per chunk, upcast the bf16 gradient into a chunk-sized fp32 scratch buffer
  (read 2 + write 4 B/param), torch's fused AdamW (28 B), downcast the master into the bf16
  parameter (read 4 + write 2 B): 40 B per parameter;
* ``fused-mp``: ``kernel="fused-mp"``: the single-pass kernel reads the bf16 gradient, updates
  master and moments, writes the bf16 parameter: 28 B per parameter;
* ``probe``: the read-4/write-3 streaming probe ``c_4r3w`` of :mod:`bench.membus._stream` (28 B/element).

Each optimizer visit: one discarded step after the switch, then ``--steps`` measured steps
(``StepStats.step_s``, the wall time of ``step()``). Reported: median and IQR per variant and
thread count, effective GB/s, the speed-up torch/fused-mp at the best thread counts (target
>= 1.3) and fused-mp GB/s over probe GB/s (target >= 0.9), plus the per-round ratios at
fused-mp's best thread count, and the load average (the CPUs may be shared). Results go to
``<out-dir>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import subprocess
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench._args import thread_list
from bench._cli import bench_entry
from bench._stats import machine_info, median
from bench.membus._harness import add_output, alternate, command, interleaved, new_parser, paired, rotation, summary
from bench.membus._stream import ProbeBuffers, c_kernel_status
from bench.membus.fused_mp import BYTES_PER_PARAM, TARGET_PROBE_RATIO, TARGET_SPEEDUP, at_best_threads
from bench.train.model import GPT, PRESETS, preset

logger = logging.getLogger("bench.membus.fused_mp_optimizer")

__all__ = ["build_parser", "main", "run"]

_MIN_PARAMS = 100_000_000
_VARIANTS = ("torch", "fused-mp", "probe")


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("fused_mp_optimizer", __doc__.split("\n\n")[0])
    p.add_argument("--model-size", choices=sorted(PRESETS), default="125m",
                   help="GPT preset whose bf16 parameters are stepped")
    p.add_argument("--threads", type=thread_list, default=None, help="thread counts (default 1..cpus)")
    p.add_argument("--chunk-numel", type=int, default=4 << 20, help="pipeline chunk size")
    p.add_argument("--rounds", type=int, default=9, help="measured interleaved rounds")
    p.add_argument("--warmup", type=int, default=1, help="discarded rounds before measuring")
    p.add_argument("--steps", type=int, default=2, help="measured steps per optimizer visit")
    p.add_argument("--allow-small", action="store_true", help=f"accept models under {_MIN_PARAMS:,} params")
    add_output(p, "fused_mp_optimizer")
    p.add_argument("--note", default="", help="free text stored with the result")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny model (implies --allow-small), 2 rounds, 1 step per visit")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="logging level (stderr)")
    return p


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"uptime unavailable: {exc}"


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    from offload import CPUOffloadAdamW, OffloadSettings
    from offload.kernels._fused_mp import bitwise_matches_torch, fused_mp_available

    started = time.time()
    ok, reason = fused_mp_available()
    if not ok:
        raise SystemExit(f"fused-mp kernel unavailable: {reason}")
    threads = args.threads or list(range(1, (os.cpu_count() or 1) + 1))
    torch.manual_seed(0)
    model = GPT(preset(args.model_size)).to(torch.bfloat16)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    if numel < _MIN_PARAMS and not args.allow_small:
        raise SystemExit(f"--model-size {args.model_size} has {numel:,} parameters: "
                         f"expected >= {_MIN_PARAMS:,} (or pass --allow-small)")
    gen = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = (1e-3 * torch.randn(p.shape, generator=gen)).to(p.dtype)
    uptime_before = _uptime()
    logger.info("%s: %s bf16 parameters, threads %s; %s", args.model_size, f"{numel:,}", threads, uptime_before)
    opt = CPUOffloadAdamW(params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                          settings=OffloadSettings(threads=threads[0], chunk_numel=args.chunk_numel))
    opt.step()  # allocates and first-touches the host state; not measured
    probe = ProbeBuffers(numel)
    probe.run("c_4r3w", threads[-1])  # first touch of the probe buffers

    kernels_seen: dict[str, set[str]] = {"torch": set(), "fused-mp": set()}
    # Per step: the share of step() spent inside the kernel stage (the rest is the optimizer's
    # own work: job building, hand-off, Python between kernel calls, the drain); recorded in every
    # round, the warm-up rounds' first ``warmup * steps`` shares dropped below.
    kernel_share: dict[tuple[str, int], list[float]] = {(v, t): [] for v in ("torch", "fused-mp") for t in threads}

    def visit(variant: str, t: int) -> list[float]:
        if variant == "probe":
            return [probe.run("c_4r3w", t).seconds]
        opt.apply_settings(OffloadSettings(threads=t, chunk_numel=args.chunk_numel,
                                           kernel=variant))  # type: ignore[arg-type]
        opt.step()  # discarded: first step after a switch
        got = []
        for _ in range(args.steps):
            opt.step()
            stats = opt.last_stats
            got.append(stats.step_s)
            kernels_seen[variant].add(stats.kernel)
            kernel_share[(variant, t)].append(stats.adam_kernel_s / stats.step_s)
        return got

    samples = interleaved({(v, t): functools.partial(visit, v, t) for v in _VARIANTS for t in threads},
                          args.rounds, warmup=args.warmup, progress=logger,
                          order=lambda r: [(v, t) for t in alternate(threads, r) for v in rotation(_VARIANTS, r)])
    uptime_after = _uptime()
    opt.close()
    for variant, seen in kernels_seen.items():
        if seen != {variant}:
            raise SystemExit(f"asked for kernel={variant}, the steps ran {sorted(seen)}")

    per_threads: dict[str, dict[str, Any]] = {}
    for t in threads:
        row: dict[str, Any] = {v: summary(samples[(v, t)], BYTES_PER_PARAM[v] * numel) for v in _VARIANTS}
        # Per-round ratios: the variants of a round run back to back at one thread count.
        k = args.steps
        torch_r = [median(samples[("torch", t)][i:i + k]) for i in range(0, len(samples[("torch", t)]), k)]
        fused_r = [median(samples[("fused-mp", t)][i:i + k]) for i in range(0, len(samples[("fused-mp", t)]), k)]
        probe_r = samples[("probe", t)]
        row["paired"] = {
            "torch_over_fused": paired(torch_r, fused_r),
            "fused_over_probe_gbps": paired(probe_r, fused_r, BYTES_PER_PARAM["fused-mp"] / BYTES_PER_PARAM["probe"]),
        }
        row["fused-mp"]["kernel_stage_share"] = median(kernel_share[("fused-mp", t)][args.warmup * k:])
        per_threads[str(t)] = row
    head = at_best_threads(per_threads, threads)
    speedup, probe_ratio = head["speedup_torch_over_fused"], head["fused_over_probe_gbps"]
    return {
        "benchmark": "bench.membus.fused_mp_optimizer",
        "command": command("fused_mp_optimizer", argv),
        "model_size": args.model_size, "params": numel, "dtype": "bf16", "device": "cpu",
        "chunk_numel": args.chunk_numel, "threads": threads, "rounds": args.rounds,
        "warmup": args.warmup, "steps_per_visit": args.steps,
        "bytes_per_param": BYTES_PER_PARAM,
        "probe": {"name": "c_4r3w", "build": c_kernel_status()},
        "kernel": {"available": reason, "bitwise_matches_torch": bitwise_matches_torch()},
        "per_threads": per_threads, **head,
        "targets": {"speedup": TARGET_SPEEDUP, "probe_ratio": TARGET_PROBE_RATIO,
                    "speedup_met": speedup >= TARGET_SPEEDUP,
                    "probe_ratio_met": probe_ratio >= TARGET_PROBE_RATIO},
        "uptime_before": uptime_before, "uptime_after": uptime_after,
        "note": args.note, "machine": machine_info(), "duration_s": round(time.time() - started, 1),
    }


def render_markdown(r: dict[str, Any]) -> str:
    m = r["machine"]
    met = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    lines = [
        "# CPUOffloadAdamW step: kernel=fused-mp vs kernel=torch (bf16 model)",
        "",
        f"`{r['command']}`",
        "",
        f"- Machine: {m.get('cpu_model')}, {m.get('logical_cpus', '?')} logical CPUs, torch {m.get('torch')}",
        f"- `uptime` before: `{r['uptime_before']}`",
        f"- `uptime` after: `{r['uptime_after']}` (the CPUs are shared with other engineers' work)",
        f"- Model: `{r['model_size']}` GPT, {r['params']:,} bf16 parameters on the CPU, chunk "
        f"{r['chunk_numel']:,} elements; synthetic gradients, no forward/backward",
        f"- {r['rounds']} interleaved rounds (+{r['warmup']} warm-up), {r['steps_per_visit']} measured "
        "`step()` per optimizer visit after one discarded step; median / IQR of `StepStats.step_s`",
        f"- Bytes per parameter: torch {r['bytes_per_param']['torch']}, fused-mp "
        f"{r['bytes_per_param']['fused-mp']}, probe `c_4r3w` {r['bytes_per_param']['probe']}",
        f"- fused-mp bitwise identical to the torch path on this build: {r['kernel']['bitwise_matches_torch']}",
        "",
        "Kernel stage = the share of a fused-mp `step()` spent inside its `adam_kernel` stage "
        "(`StepStats.adam_kernel_s / step_s`, median); the rest is the optimizer's own work.",
        "",
        "| threads | torch ms (IQR) | fused-mp ms (IQR) | probe ms (IQR) | torch/fused | fused GB/s | "
        "probe GB/s | fused/probe | paired torch/fused (IQR) | paired fused/probe (IQR) | kernel stage |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t, row in r["per_threads"].items():
        ms = lambda v: f"{row[v]['median_s'] * 1e3:.1f} ({row[v]['iqr_s'] * 1e3:.1f})"  # noqa: E731
        pr = row["paired"]
        lines.append(
            f"| {t} | {ms('torch')} | {ms('fused-mp')} | {ms('probe')} | "
            f"{row['torch']['median_s'] / row['fused-mp']['median_s']:.2f}x | {row['fused-mp']['gbps']:.1f} | "
            f"{row['probe']['gbps']:.1f} | {row['fused-mp']['gbps'] / row['probe']['gbps']:.2f} | "
            f"{pr['torch_over_fused']['median']:.2f}x ({pr['torch_over_fused']['iqr']:.2f}) | "
            f"{pr['fused_over_probe_gbps']['median']:.2f} ({pr['fused_over_probe_gbps']['iqr']:.2f}) | "
            f"{row['fused-mp'].get('kernel_stage_share', float('nan')):.1%} |"
        )
    b, tg, pa = r["best_threads"], r["targets"], r["paired_at_fused_best_threads"]
    lines += [
        "",
        f"At each variant's best thread count (torch {b['torch']}, fused-mp {b['fused-mp']}, probe {b['probe']}):",
        "",
        f"- speed-up torch / fused-mp: **{r['speedup_torch_over_fused']:.2f}x** "
        f"(target >= {tg['speedup']}: {met(tg['speedup_met'])})",
        f"- fused-mp GB/s / probe GB/s: **{r['fused_over_probe_gbps']:.2f}** "
        f"(target >= {tg['probe_ratio']}: {met(tg['probe_ratio_met'])})",
        f"- per-round, at fused-mp's best thread count: torch/fused-mp {pa['torch_over_fused']['median']:.2f}x "
        f"(IQR {pa['torch_over_fused']['iqr']:.2f}), fused/probe {pa['fused_over_probe_gbps']['median']:.2f} "
        f"(IQR {pa['fused_over_probe_gbps']['iqr']:.2f})",
    ]
    if r["note"]:
        lines += ["", f"Note: {r['note']}"]
    return "\n".join(lines) + "\n"


def _resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.quick:
        args.model_size, args.allow_small, args.rounds, args.steps = "tiny", True, 2, 1
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        p.error(f"--rounds {args.rounds} / --steps {args.steps} / --warmup {args.warmup}: "
                "expected >= 1 / >= 1 / >= 0")


main = bench_entry(build_parser=build_parser, run=run, resolve=_resolve, render_markdown=render_markdown)


if __name__ == "__main__":
    raise SystemExit(main())
