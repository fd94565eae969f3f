"""Loss with fp32 moments, bf16 moments rounded to nearest, and bf16 rounded stochastically (issue 26).

    python -m bench.state_dtype_loss --out-dir bench/results          # 3 modes x 3 seeds x 400 steps
    python -m bench.state_dtype_loss --quick                           # a smoke run

Per mode and seed, one run of the reference trainer (``python -m bench.train --optim-cpu-offload
--optim-state-dtype ... --optim-state-rounding ... --seed S``, the ``--model-size`` GPT on its
synthetic task, fp32 parameters, so the moments are the only difference between the modes) in a
subprocess; the runs of a seed share the model's initial weights and the data. Reported per mode:
the final loss (mean of the last tenth of the steps) as mean and spread (min..max) over seeds,
the largest per-step gap to the fp32 curve, and a plot of the three mean loss curves. What this
can show: whether bf16 moments move a small model's loss on this task within these steps; not
what they do to a large model over a long pre-training run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench._args import OUT_DIR_HELP, HelpFormatter, output_dir
from bench._cli import bench_entry
from bench._stats import machine_info

__all__ = ["MODES", "build_parser", "main", "run"]

#: mode -> the trainer flags that select it.
MODES = {
    "fp32": ["--optim-state-dtype", "fp32"],
    "bf16-nearest": ["--optim-state-dtype", "bf16", "--optim-state-rounding", "nearest"],
    "bf16-stochastic": ["--optim-state-dtype", "bf16", "--optim-state-rounding", "stochastic"],
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.state_dtype_loss", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--steps", type=int, default=400, help="training steps per run")
    p.add_argument("--seeds", type=int, default=3, help="seeds per mode (0..N-1)")
    p.add_argument("--model-size", default="small", help="bench.train's --model-size")
    p.add_argument("--batch-size", type=int, default=4, help="bench.train's --batch-size")
    p.add_argument("--seq-len", type=int, default=32, help="bench.train's --seq-len")
    p.add_argument("--lr", type=float, default=1e-3, help="bench.train's --lr")
    p.add_argument("--quick", action="store_true", help="a smoke run: 6 steps, 1 seed")
    p.add_argument("--out-dir", type=output_dir, default=None, help=OUT_DIR_HELP)
    p.add_argument("--name", default="state_dtype_loss", help="result file stem")
    return p


def _run_one(args: argparse.Namespace, mode: str, seed: int, workdir: Path) -> list[float]:
    summary = workdir / f"{mode}-{seed}.json"
    cmd = [sys.executable, "-m", "bench.train", "--optim-cpu-offload", *MODES[mode], "--seed", str(seed),
           "--model-size", args.model_size, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--steps", str(args.steps), "--lr", str(args.lr), "--threads", "2", "--summary-json", str(summary),
           "--log-level", "WARNING"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    return [float(x) for x in json.loads(summary.read_text())["losses"]]


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    curves: dict[str, list[list[float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for mode in MODES:
                curves[mode].append(_run_one(args, mode, seed, Path(tmp)))
    tail = max(1, args.steps // 10)
    modes = {}
    for mode, runs in curves.items():
        finals = [sum(c[-tail:]) / tail for c in runs]
        gap = max(abs(a - b) for c, f in zip(runs, curves["fp32"]) for a, b in zip(c, f))
        modes[mode] = {"final_mean": sum(finals) / len(finals), "final_min": min(finals), "final_max": max(finals),
                       "max_step_gap_to_fp32": gap,
                       "mean_curve": [sum(v) / len(v) for v in zip(*runs)]}
    result = {"command": "python -m bench.state_dtype_loss " + shlex.join(list(argv)), "machine": machine_info(),
              "steps": args.steps, "seeds": args.seeds, "model_size": args.model_size, "batch_size": args.batch_size,
              "seq_len": args.seq_len, "lr": args.lr, "final_steps_averaged": tail, "modes": modes,
              "curves": curves}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    _plot(result, args.out_dir / f"{args.name}.png")  # (bench_main writes the .json and .md)
    return result


def render_markdown(result: dict[str, Any]) -> str:
    lines = ["# Loss with fp32 and bf16 optimizer moments", "", f"`{result['command']}`", "",
             f"`{result['model_size']}` GPT of `bench.train` on its synthetic task, fp32 parameters, batch "
             f"{result['batch_size']} x {result['seq_len']} tokens, lr {result['lr']}, {result['steps']} steps, "
             f"seeds 0..{result['seeds'] - 1} (the modes of a seed share weights and data). Final loss: the mean "
             f"of the last {result['final_steps_averaged']} steps.", "",
             "| moments | final loss, mean | min .. max over seeds | final minus fp32's, per seed | "
             "largest per-step gap to fp32 |",
             "|---|---:|---:|---|---:|"]
    tail = result["final_steps_averaged"]
    ref = [sum(c[-tail:]) / tail for c in result["curves"]["fp32"]]
    for mode, m in result["modes"].items():
        paired = [sum(c[-tail:]) / tail - r for c, r in zip(result["curves"][mode], ref)]
        lines.append(f"| {mode} | {m['final_mean']:.4f} | {m['final_min']:.4f} .. {m['final_max']:.4f} | "
                     f"{', '.join(f'{d:+.4f}' for d in paired)} | {m['max_step_gap_to_fp32']:.4f} |")
    lines += ["", f"A small model on a synthetic task for {result['steps']} steps: it shows whether bf16 moments "
              "move this loss at all, not what they do over a long pre-training run of a large model "
              "(where small EMA updates rounding away is the known risk). The per-step gap compares single "
              "steps' losses, which differ once the runs' weights differ in the last bits.", ""]
    if result.get("note"):
        lines += [result["note"], ""]
    m = result["machine"]
    lines.append(f"Machine: {m.get('cpu_model', '?')}, {m.get('logical_cpus', '?')} logical CPUs.")
    return "\n".join(lines) + "\n"


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, m in result["modes"].items():
        ax.plot(range(1, len(m["mean_curve"]) + 1), m["mean_curve"], label=mode, linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (mean of {result['seeds']} seeds)")
    ax.set_title("fp32 vs bf16 optimizer moments")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.quick:
        args.steps, args.seeds = 6, 1
    for name in ("steps", "seeds", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected an integer >= 1")


main = bench_entry(build_parser=build_parser, run=run, resolve=_resolve, render_markdown=render_markdown)


if __name__ == "__main__":
    raise SystemExit(main())
