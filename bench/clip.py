"""What gradient clipping costs: our clip folded into the step against torch's clip + fused step.

    python -m bench.clip                                # 50M parameters, fp32 and bf16, 2 threads
    python -m bench.clip --dtypes fp32 --rounds 31
    python -m bench.clip --quick --out-dir /tmp/clip    # tiny parameter set, seconds (CI)

Part 1, the step. One parameter set per dtype (the shapes of a GPT preset, synthetic gradients
whose total norm is far above 1, so the clip is active), ``--threads`` intra-op threads, three
variants visited in rotating order (ABC, BCA, CAB, ...) in one run, because this machine's memory
bandwidth swings 30-90 GB/s from one minute to the next and only neighbours in time compare:

* ``ours_clip``: ``opt.clip_grad_norm_(1.0)`` then ``opt.step()`` (``CPUOffloadAdamW``: the norm in
  one native pass, the coefficient applied inside the AdamW kernel, no pass that rewrites the
  gradients);
* ``ours``: ``opt.step()`` on the same optimizer (same pages) without clipping;
* ``torch_clip``: ``torch.nn.utils.clip_grad_norm_(params, 1.0)`` then
  ``torch.optim.AdamW(fused=True).step()`` on a copy of the parameters. For bf16 this is torch's
  step on the bf16 parameters themselves (bf16 moments, 14 B per parameter against our fp32 master
  and moments, 28 B): the comparison flatters torch.

Each visit: one discarded step, then ``--steps`` timed calls (wall time of clip + step). Reported
per dtype: median, IQR and min-max of each variant and of its clip call alone; the ratios
clipped/unclipped (target <= 1.15) and torch/ours-clipped (target >= 1.5), both as the median of
the per-round ratios (neighbours in time) and as the ratio of the medians.

Part 2, the trainer (``bench.train --optim-cpu-offload --clip-grad-norm X``, with and without
``--overlap-backward``, 1 rank in this process and 2 FSDP2 ranks through torchrun): iteration
time, the exposed ``step()`` (clip + step, ``opt_s``), the last total gradient norm and the
speculation commit rate, and whether the overlapped run's losses equal the plain run's (the
overlap contract). With ``X`` below the gradient norm every step is clipped, so chunks speculated
during backward are redone; a max norm above it shows the commit rate when nothing is clipped.

Results go to ``<out-dir>/<name>.json`` and ``<out-dir>/<name>.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from bench._args import OUT_DIR_HELP, HelpFormatter, output_dir
from bench._cli import bench_entry
from bench._stats import iqr, machine_info, median
from bench.train.model import GPT, PRESETS, preset

logger = logging.getLogger("bench.clip")

__all__ = ["TARGET_CLIP_OVERHEAD", "TARGET_TORCH_OVER_OURS", "build_parser", "main", "run"]

#: Target: ours with clipping at most this multiple of ours without (the norm pass reads the
#: gradients once more: 4 B of the step's 28 B per parameter, plus its reduction).
TARGET_CLIP_OVERHEAD = 1.15
#: Target: torch's clip + fused step at least this multiple of ours with clipping (torch's clip
#: rewrites the gradients, a pass ours folds into the AdamW kernel).
TARGET_TORCH_OVER_OURS = 1.5
VARIANTS = ("ours_clip", "ours", "torch_clip")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_REPO = Path(__file__).absolute().parents[1]


def _norm_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(v > 0 and v != float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated finite max norms > 0")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.clip", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model-size", default=None, choices=sorted(PRESETS),
                   help="parameter shapes of this GPT preset (default 50m; tiny with --quick)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of every variant")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 21; 3 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="timed calls per visit (default 2; 1 with --quick)")
    p.add_argument("--max-norm", type=float, default=1.0, help="clip max norm of part 1")
    p.add_argument("--train-model-size", default=None, choices=sorted(PRESETS),
                   help="trainer model (default small; tiny with --quick)")
    p.add_argument("--train-steps", type=int, default=None, help="trainer steps per run (default 8; 2 with --quick)")
    p.add_argument("--train-clip", type=_norm_list, default=None,
                   help="trainer --clip-grad-norm values (default 1.0,1000; 1.0 with --quick)")
    p.add_argument("--no-torchrun", action="store_true", help="skip the 2-rank FSDP2 trainer runs")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few rounds, 1-rank trainer only: a smoke run")
    p.add_argument("--out-dir", type=output_dir, default=None, help=OUT_DIR_HELP)
    p.add_argument("--name", default=None, help="result file stem (default clip or clip-quick)")
    p.add_argument("--note", default="", help="free text stored with the results")
    return p


def _resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.model_size = args.model_size or ("tiny" if args.quick else "50m")
    args.train_model_size = args.train_model_size or ("tiny" if args.quick else "small")
    args.rounds = args.rounds if args.rounds is not None else (3 if args.quick else 21)
    args.steps = args.steps if args.steps is not None else (1 if args.quick else 2)
    args.train_steps = args.train_steps if args.train_steps is not None else (2 if args.quick else 8)
    args.train_clip = args.train_clip or ([1.0] if args.quick else [1.0, 1000.0])
    args.name = args.name or ("clip-quick" if args.quick else "clip")
    args.dtype_list = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtype_list if d not in _DTYPES]
    if bad or not args.dtype_list:
        p.error(f"--dtypes {args.dtypes!r}: expected a comma-separated list of {sorted(_DTYPES)}")
    for flag, value in (("--threads", args.threads), ("--rounds", args.rounds), ("--steps", args.steps),
                        ("--train-steps", args.train_steps)):
        if value < 1:
            p.error(f"{flag} {value}: expected a positive integer")
    if not (args.max_norm > 0 and args.max_norm != float("inf")):
        p.error(f"--max-norm {args.max_norm}: expected a finite number > 0")
    if args.quick:
        args.no_torchrun = True


def _params(size: str, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Tensors with a GPT preset's parameter shapes and gradients of total norm >> 1."""
    with torch.device("meta"):
        shapes = [p.shape for p in GPT(preset(size)).parameters()]
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = (0.02 * torch.randn(shape, generator=gen)).to(dtype)
        p.grad = (1e-2 * torch.randn(shape, generator=gen)).to(dtype)
        params.append(p)
    return params


def _spread(xs: Sequence[float]) -> dict[str, Any]:
    return {"median_s": median(xs), "iqr_s": iqr(xs), "min_s": min(xs), "max_s": max(xs), "n": len(xs)}


def _ratio(xs: Sequence[float]) -> dict[str, Any]:
    return {"median": median(xs), "iqr": iqr(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _step_bench(args: argparse.Namespace, dtype_name: str) -> dict[str, Any]:
    from offload import CPUOffloadAdamW, OffloadSettings

    dtype = _DTYPES[dtype_name]
    ours_params = _params(args.model_size, dtype, seed=1)
    torch_params = [p.detach().clone() for p in ours_params]
    for p, q in zip(torch_params, ours_params):
        p.grad = q.grad.clone()
    numel = sum(p.numel() for p in ours_params)
    hyper = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    ours = CPUOffloadAdamW(ours_params, **hyper, settings=OffloadSettings(threads=args.threads))
    ref = torch.optim.AdamW(torch_params, **hyper, fused=True)
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    norms: dict[str, float] = {}
    clip_parts: dict[str, list[float]] = {"ours_clip": [], "torch_clip": []}  # the clip call alone

    def call(variant: str, record: bool = True) -> float:
        t0 = time.perf_counter()
        norm = None
        if variant == "ours_clip":
            norm = ours.clip_grad_norm_(args.max_norm)
        elif variant == "torch_clip":
            norm = torch.nn.utils.clip_grad_norm_(torch_params, args.max_norm)
        t_clip = time.perf_counter()
        (ref if variant == "torch_clip" else ours).step()
        seconds = time.perf_counter() - t0
        if norm is not None:
            norms[variant] = float(norm)
            if record:
                clip_parts[variant].append(t_clip - t0)
        return seconds

    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rounds: list[dict[str, float]] = []
    kernels: set[str] = set()
    try:
        for v in VARIANTS:  # first touch of every state page, lazy kernels: not measured
            call(v, record=False)
        for r in range(args.rounds):
            this: dict[str, float] = {}
            for v in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                call(v, record=False)  # discarded: the first call after another variant
                got = [call(v) for _ in range(args.steps)]
                samples[v].extend(got)
                this[v] = median(got)
                if v != "torch_clip":
                    kernels.add(ours.last_stats.kernel)
            rounds.append(this)
    finally:
        torch.set_num_threads(previous)
        ours.close()
    clip_over = [r["ours_clip"] / r["ours"] for r in rounds]
    torch_over = [r["torch_clip"] / r["ours_clip"] for r in rounds]
    med = {v: median(samples[v]) for v in VARIANTS}
    return {
        "dtype": dtype_name, "params": numel, "kernels": sorted(kernels),
        "variants": {v: _spread(samples[v]) for v in VARIANTS},
        "clipped_over_unclipped": {"per_round": _ratio(clip_over), "of_medians": med["ours_clip"] / med["ours"]},
        "torch_over_ours_clipped": {"per_round": _ratio(torch_over), "of_medians": med["torch_clip"] / med["ours_clip"]},
        "grad_norm": norms,
        "clip_call": {v: _spread(x) for v, x in clip_parts.items()},
        "targets": {
            "clip_overhead_met": median(clip_over) <= TARGET_CLIP_OVERHEAD,
            "torch_over_ours_met": median(torch_over) >= TARGET_TORCH_OVER_OURS,
        },
        "rounds": rounds,
    }


def _train_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OFFLOAD_AUTOTUNE_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(_REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _train_run(args: argparse.Namespace, ranks: int, clip: float, overlap: bool, tmp: Path) -> dict[str, Any]:
    """One trainer run; the figures of its summary."""
    from bench.train import _main as train

    out = tmp / f"train-{ranks}-{clip:g}-{int(overlap)}.json"
    flags = ["--model-size", args.train_model_size, "--device", "cpu", "--steps", str(args.train_steps),
             "--batch-size", "4", "--seq-len", "64", "--optim-cpu-offload", "--clip-grad-norm", f"{clip:g}",
             "--log-level", "WARNING", "--summary-json", str(out), *(["--overlap-backward"] if overlap else [])]
    if ranks == 1:
        previous = torch.get_num_threads()
        try:
            code = train.main(flags)
        finally:
            torch.set_num_threads(previous)
        if code != 0:
            raise SystemExit(f"bench.train {shlex.join(flags)} exited with {code}")
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "bench.train", *flags, "--fsdp"]
        proc = subprocess.run(cmd, cwd=tmp, env=_train_env(), capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"{shlex.join(cmd)} exited with {proc.returncode}: {proc.stderr[-2000:]}")
    s = json.loads(out.read_text())
    return {"ranks": ranks, "fsdp": ranks > 1, "clip": clip, "overlap": overlap,
            "step_s_median": s["step_s_median"], "step_s_iqr": s["step_s_iqr"],
            "opt_s_median": s["opt_s_median"], "opt_s_iqr": s.get("opt_s_iqr"),
            "grad_norm_last": s["grad_norm_last"], "commit_rate": s["commit_rate"],
            "speculated_chunks": s["speculated_chunks"], "committed_chunks": s["committed_chunks"],
            "losses": s["losses"], "param_sha256": [r["param_sha256"] for r in s["ranks"]]}


def _trainer_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-clip-") as tmp:
        for ranks in (1,) if args.no_torchrun else (1, 2):
            for clip in args.train_clip:
                plain = _train_run(args, ranks, clip, False, Path(tmp))
                over = _train_run(args, ranks, clip, True, Path(tmp))
                same = plain["losses"] == over["losses"] and plain["param_sha256"] == over["param_sha256"]
                for row in (plain, over):
                    row["bitwise_equal_to_plain"] = same
                    rows.append(row)
                logger.info("trainer: %d rank(s), clip %g done", ranks, clip)
    return rows


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    steps = []
    for dtype in args.dtype_list:
        logger.info("step benchmark: %s %s, %d rounds", args.model_size, dtype, args.rounds)
        steps.append(_step_bench(args, dtype))
    trainer = _trainer_bench(args)
    return {
        "benchmark": "bench.clip",
        "command": "python -m bench.clip " + shlex.join(argv),
        "model_size": args.model_size, "threads": args.threads, "rounds": args.rounds,
        "steps_per_visit": args.steps, "max_norm": args.max_norm, "quick": args.quick,
        "train_model_size": args.train_model_size, "train_steps": args.train_steps,
        "targets": {"clipped_over_unclipped_max": TARGET_CLIP_OVERHEAD,
                    "torch_over_ours_clipped_min": TARGET_TORCH_OVER_OURS},
        "step": steps, "trainer": trainer, "note": args.note, "machine": machine_info(),
    }


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.1f}"


def render_markdown(r: dict[str, Any]) -> str:
    met = lambda ok: "met" if ok else "**NOT met**"  # noqa: E731
    m = r["machine"]
    lines = [
        "# Gradient clipping: ours folded into the step vs torch's clip + fused AdamW", "",
        f"`{r['command']}` ({m['date_utc']}, {m['cpu_model']}, {m['affinity_cpus']} CPUs, load "
        f"{m['load_avg_1_5_15']}, torch {m['torch']}). {r['threads']} threads, {r['rounds']} interleaved "
        f"rounds x {r['steps_per_visit']} timed calls per variant, max_norm {r['max_norm']:g}.", "",
        "## Step (clip + step wall time, ms)", "",
        "| dtype | params | variant | median | IQR | min-max |", "|---|---|---|---|---|---|",
    ]
    for s in r["step"]:
        for v in VARIANTS:
            x = s["variants"][v]
            lines.append(f"| {s['dtype']} | {s['params']:,} | {v} | {_ms(x['median_s'])} | {_ms(x['iqr_s'])} "
                         f"| {_ms(x['min_s'])}-{_ms(x['max_s'])} |")
    lines += ["", "Of which the clip call alone (`opt.clip_grad_norm_` / `torch.nn.utils.clip_grad_norm_`), "
              "median (IQR) ms:", ""]
    for s in r["step"]:
        parts = s["clip_call"]
        lines.append(f"- {s['dtype']}: ours {_ms(parts['ours_clip']['median_s'])} ({_ms(parts['ours_clip']['iqr_s'])}), "
                     f"torch {_ms(parts['torch_clip']['median_s'])} ({_ms(parts['torch_clip']['iqr_s'])})")
    lines += ["", "| dtype | ratio | per-round median (IQR, min-max) | of medians | target |", "|---|---|---|---|---|"]
    for s in r["step"]:
        for key, label, target, ok in (
            ("clipped_over_unclipped", "ours clipped / ours", f"<= {TARGET_CLIP_OVERHEAD}", "clip_overhead_met"),
            ("torch_over_ours_clipped", "torch clip+fused / ours clipped", f">= {TARGET_TORCH_OVER_OURS}",
             "torch_over_ours_met"),
        ):
            x = s[key]["per_round"]
            lines.append(f"| {s['dtype']} | {label} | {x['median']:.3f} ({x['iqr']:.3f}, {x['min']:.3f}-"
                         f"{x['max']:.3f}) | {s[key]['of_medians']:.3f} | {target}: {met(s['targets'][ok])} |")
    lines += ["", f"## Trainer (`bench.train --optim-cpu-offload --clip-grad-norm X`, {r['train_model_size']}, "
              f"{r['train_steps']} steps; medians without the first step)", "",
              "| ranks | X | overlap | iteration ms (IQR) | exposed step() ms (IQR) | last grad norm | "
              "commit rate | bitwise = plain |", "|---|---|---|---|---|---|---|---|"]
    for t in r["trainer"]:
        rate = "n/a" if t["commit_rate"] is None else (f"{t['commit_rate'] * 100:.1f}% "
                                                        f"({t['committed_chunks']}/{t['speculated_chunks']})")
        norm = "n/a" if t["grad_norm_last"] is None else f"{t['grad_norm_last']:.4g}"
        lines.append(f"| {t['ranks']}{' FSDP2' if t['fsdp'] else ''} | {t['clip']:g} | {t['overlap']} | "
                     f"{_ms(t['step_s_median'])} ({_ms(t['step_s_iqr'])}) | {_ms(t['opt_s_median'])} "
                     f"({_ms(t['opt_s_iqr'])}) | {norm} | {rate} | {t['bitwise_equal_to_plain']} |")
    if r["note"]:
        lines += ["", r["note"]]
    return "\n".join(lines) + "\n"


main = bench_entry(build_parser=build_parser, run=run, resolve=_resolve, render_markdown=render_markdown)


if __name__ == "__main__":
    sys.exit(main())
