"""fp32 against bf16 moments in host memory (``CPUOffloadAdamW(state_dtype=)``, issue 26).

    python -m bench.membus.state_dtype                              # 50M parameters, bf16 and fp32 models, 2 threads
    python -m bench.membus.state_dtype --quick                      # a smoke run, seconds

Per model dtype, two optimizers over two copies of the same parameters (``--numel`` elements in
tensors of ``--tensor-numel``), one keeping fp32 moments and one bf16 moments, stepped in
alternating order round by round (``--rounds``; the first two steps of each are warm-up), and the
read-4/write-3 streaming probe (``bench.membus._stream``'s ``c_4r3w``, 28 B per element) once per round
beside them. Reported: each one's median step, the per-round ratio bf16 / fp32 (median, IQR),
GB/s from the bytes each step moves (bf16 model: 28 B with fp32 moments, 20 with bf16; fp32 model
on the host, its own master: 28 and 20 with the gradient read once), that over the probe's GB/s
of the same round, and the host memory the optimizer added (RSS growth over construction and the
first step, in a fresh process) per parameter. Results go to ``<out-dir>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
from collections.abc import Sequence
from typing import Any

import torch

from bench._cli import bench_entry
from bench._stats import iqr, machine_info, median
from bench.membus._harness import (add_output, command, interleaved, machine_line, new_parser, paired,
                                   require_positive, timed)
from bench.membus._stream import PROBE_BYTES_PER_ELEMENT, ProbeBuffers
from offload import CPUOffloadAdamW, OffloadSettings

__all__ = ["build_parser", "main", "run"]

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: Bytes per parameter per step: gradient read, master/param r+w, both moments r+w (+ bf16 weight write).
STEP_BYTES = {("bf16", "fp32"): 28, ("bf16", "bf16"): 20, ("fp32", "fp32"): 28, ("fp32", "bf16"): 20}


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("state_dtype", __doc__)
    p.add_argument("--numel", type=int, default=50_000_000, help="parameters")
    p.add_argument("--tensor-numel", type=int, default=4_000_000, help="elements per parameter tensor")
    p.add_argument("--models", default="bf16,fp32", help="comma list of the model dtypes: bf16, fp32")
    p.add_argument("--threads", type=int, default=2, help="the optimizer's threads")
    p.add_argument("--rounds", type=int, default=11, help="measured rounds")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2M parameters, 2 rounds")
    add_output(p, "state_dtype")
    return p


def _resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.quick:
        args.numel, args.tensor_numel, args.rounds = 2_000_000, 500_000, 2
    require_positive(parser, args, "numel", "tensor_numel", "threads", "rounds")
    bad = [m for m in args.models.split(",") if m not in _DTYPES]
    if bad:
        parser.error(f"--models {args.models}: expected a comma list of {', '.join(_DTYPES)}")


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _params(numel: int, tensor_numel: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    sizes = [tensor_numel] * (numel // tensor_numel) + ([numel % tensor_numel] if numel % tensor_numel else [])
    out = []
    for n in sizes:
        p = torch.nn.Parameter((torch.randn(n, generator=g) * 0.02).to(dtype))
        p.grad = (torch.randn(n, generator=g) * 1e-3).to(dtype)
        out.append(p)
    return out


def _rss_per_param(model: str, state: str, numel: int, tensor_numel: int, threads: int) -> float:
    """Host memory the optimizer adds (RSS growth over construction and one step) per parameter,
    measured in a fresh process (in this one, memory freed by an earlier case is reused)."""
    settings = OffloadSettings(threads=threads, chunk_numel=4 << 20, kernel="fused-mp")
    warm = torch.nn.Parameter(torch.zeros(1024))  # the extension and thread pools first
    warm.grad = torch.zeros(1024)
    CPUOffloadAdamW([warm], settings=settings).step()
    params = _params(numel, tensor_numel, _DTYPES[model])
    gc.collect()
    before = _rss()
    opt = CPUOffloadAdamW(params, lr=1e-5, state_dtype=_DTYPES[state], settings=settings)
    opt.step()
    grown = (_rss() - before) / numel
    opt.close()
    return grown


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    settings = OffloadSettings(threads=args.threads, chunk_numel=4 << 20, kernel="fused-mp")
    probe = ProbeBuffers(args.numel)
    cases = []
    for model in args.models.split(","):
        opts: dict[str, CPUOffloadAdamW] = {}
        rss: dict[str, float] = {}
        for state in ("fp32", "bf16"):
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                rss[state] = pool.apply(_rss_per_param, (model, state, args.numel, args.tensor_numel, args.threads))
            params = _params(args.numel, args.tensor_numel, _DTYPES[model])
            opts[state] = CPUOffloadAdamW(params, lr=1e-5, state_dtype=_DTYPES[state], settings=settings)
            opts[state].step()
        for opt in opts.values():
            opt.step()  # warm-up
        times = interleaved({state: (lambda opt=opt: timed(opt.step)) for state, opt in opts.items()}, args.rounds,
                            then=("probe", lambda: probe.run("c_4r3w", args.threads).seconds))
        ratio = paired(times["bf16"], times["fp32"])
        probe_gbs = [PROBE_BYTES_PER_ELEMENT["c_4r3w"] * args.numel / s / 1e9 for s in times["probe"]]
        case: dict[str, Any] = {"model": model, "ratio_bf16_over_fp32_median": ratio["median"],
                                "ratio_iqr": ratio["iqr"], "probe_gbs_median": median(probe_gbs)}
        for state in ("fp32", "bf16"):
            gbs = [STEP_BYTES[(model, state)] * args.numel / s / 1e9 for s in times[state]]
            case[state] = {"step_ms_median": median(times[state]) * 1e3, "step_ms_iqr": iqr(times[state]) * 1e3,
                           "gbs_median": median(gbs),
                           "over_probe_median": median([g / p for g, p in zip(gbs, probe_gbs)]),
                           "rss_bytes_per_param": rss[state]}
        cases.append(case)
        for opt in opts.values():
            opt.close()
        del opts
        gc.collect()
    return {"command": command("state_dtype", argv), "machine": machine_info(),
            "numel": args.numel, "threads": args.threads, "rounds": args.rounds, "cases": cases}


def render_markdown(result: dict[str, Any]) -> str:
    lines = ["# fp32 and bf16 moments in host memory", "", f"`{result['command']}`", "",
             f"{result['numel']:,} parameters, {result['threads']} threads, {result['rounds']} alternating rounds "
             "(median; IQR in brackets). GB/s from the bytes each step moves (28 B per parameter with fp32 "
             "moments, 20 with bf16); the probe is the read-4/write-3 streaming loop of the same rounds.", "",
             "| model | moments | step ms | GB/s | / probe | host B/param (RSS) |", "|---|---|---:|---:|---:|---:|"]
    for c in result["cases"]:
        for state in ("fp32", "bf16"):
            s = c[state]
            lines.append(f"| {c['model']} | {state} | {s['step_ms_median']:.1f} ({s['step_ms_iqr']:.1f}) | "
                         f"{s['gbs_median']:.1f} | {s['over_probe_median']:.2f} | {s['rss_bytes_per_param']:.2f} |")
    lines += ["", "| model | step bf16 / fp32 moments (median, IQR) | probe GB/s |", "|---|---:|---:|"]
    for c in result["cases"]:
        lines.append(f"| {c['model']} | {c['ratio_bf16_over_fp32_median']:.3f} ({c['ratio_iqr']:.3f}) | "
                     f"{c['probe_gbs_median']:.1f} |")
    lines += ["", machine_line(result["machine"])]
    return "\n".join(lines) + "\n"


main = bench_entry(build_parser=build_parser, run=run, resolve=_resolve, render_markdown=render_markdown)


if __name__ == "__main__":
    raise SystemExit(main())
