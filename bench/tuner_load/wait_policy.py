"""``OMP_WAIT_POLICY`` of the training process beside a background load: the optimizer step at 1
and at 2 threads with OpenMP's default wait policy against ``PASSIVE``.

    python -m bench.tuner_load.wait_policy --load threads --out-dir bench/results

Why: under a load of other thread teams (``bench.tuner_load --load threads``), stock AdamW at 2
threads ran many times slower than at 1 (issue 36), and the tuner rightly kept 1 thread. With the
default policy an OpenMP thread that finishes its part spins for a while before it sleeps, and on
cores other processes need that spinning takes their time (and a 2-thread step's idle team spins
on into the next 1-thread step). ``PASSIVE`` makes it sleep at once. OpenMP reads the variable when
it starts, so it must be set before the process imports torch (a launcher's environment).

How: the load (:mod:`bench.tuner_load._load`, its workers with the default policy) runs for the
whole benchmark. ``--blocks`` blocks, each one process per policy in alternating order (the
environment differs only in ``OMP_WAIT_POLICY``); a process makes the model of
:mod:`bench.tuner_load` (6,297,600 fp32 parameters, fixed gradients) and, per kind, steps it
``--rounds`` rounds, each one step at 1 thread and one at 2 (A B, then B A), after one step each
to warm up: ``stock`` is ``torch.optim.AdamW(fused=True)`` under ``torch.set_num_threads``,
``offload`` two ``CPUOffloadAdamW`` (``threads=1`` and ``threads=2``) over copies of the model.
Reported per policy, kind and thread count: the mean and median step time over all blocks (a run
pays the mean), and the ratio of the 2-thread to the 1-thread mean per process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Sequence

from bench._args import OUT_DIR_HELP, HelpFormatter, output_dir
from bench._cli import bench_entry
from bench._stats import machine_info, median
from bench.tuner_load._load import BackgroundLoad, LoadSpec, add_load_arguments

POLICIES = ("default", "PASSIVE")
KINDS = ("stock", "offload")
QUICK_WIDTH = 128


def measure(rounds: int, width: int) -> dict[str, dict[str, list[float]]]:
    """In the measured process: step seconds by kind and thread count (see the module doc)."""
    import torch

    from bench.tuner_load._main import LR, make_params
    from offload import CPUOffloadAdamW, OffloadSettings

    stock = torch.optim.AdamW(make_params(width, 0), lr=LR, fused=True)

    def stock_step(threads: int) -> None:
        torch.set_num_threads(threads)
        stock.step()

    ours = {t: CPUOffloadAdamW(make_params(width, 0), lr=LR, settings=OffloadSettings(threads=t)) for t in (1, 2)}
    steps = {"stock": stock_step, "offload": lambda threads: ours[threads].step()}
    times: dict[str, dict[str, list[float]]] = {kind: {"1": [], "2": []} for kind in KINDS}
    for kind, step in steps.items():
        step(1)
        step(2)
        for r in range(rounds):
            for threads in ((1, 2) if r % 2 == 0 else (2, 1)):
                started = time.perf_counter()
                step(threads)
                times[kind][str(threads)].append(time.perf_counter() - started)
    for opt in ours.values():
        opt.close()
    return times


def measure_process(policy: str, rounds: int, width: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    cmd = [sys.executable, "-m", "bench.tuner_load.wait_policy", "--measure", str(rounds), "--width", str(width)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"measuring process ({policy}) failed:\n{done.stderr[-3000:]}")
    return {"policy": policy, "times": json.loads(done.stdout.strip().splitlines()[-1])}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def summarize(processes: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for policy in POLICIES:
        mine = [p["times"] for p in processes if p["policy"] == policy]
        for kind in KINDS:
            row: dict[str, Any] = {}
            for threads in ("1", "2"):
                pooled = [x for t in mine for x in t[kind][threads]]
                row[f"mean_ms_{threads}"] = 1e3 * _mean(pooled)
                row[f"median_ms_{threads}"] = 1e3 * median(pooled)
            ratios = sorted(_mean(t[kind]["2"]) / _mean(t[kind]["1"]) for t in mine)
            row["ratio_2_to_1"] = {"median": median(ratios), "min": ratios[0], "max": ratios[-1]}
            out[f"{policy}/{kind}"] = row
    return out


def render_markdown(result: dict[str, Any]) -> str:
    lines = [f"# OMP_WAIT_POLICY beside a `{result['load']}` load", "",
             f"`{result['command']}`: {result['blocks']} blocks of one process per policy, {result['rounds']} "
             f"rounds of 1 and 2 threads each, {result['seconds']:.0f} s.", "",
             "| policy | kind | 1 thread mean (median) ms | 2 threads mean (median) ms | 2 / 1 threads, per process: median (min-max) |",
             "|---|---|---:|---:|---:|"]
    for key, row in result["summary"].items():
        policy, kind = key.split("/")
        r = row["ratio_2_to_1"]
        lines.append(f"| {policy} | {kind} | {row['mean_ms_1']:.2f} ({row['median_ms_1']:.2f}) | "
                     f"{row['mean_ms_2']:.2f} ({row['median_ms_2']:.2f}) | {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}) |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.tuner_load.wait_policy", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    add_load_arguments(p, default="threads")
    p.add_argument("--blocks", type=int, default=6, help="blocks of one measuring process per policy")
    p.add_argument("--rounds", type=int, default=20, help="rounds of one 1-thread and one 2-thread step per process")
    p.add_argument("--quick", action="store_true", help=f"smoke run: width {QUICK_WIDTH}, 1 block, 2 rounds")
    p.add_argument("--out-dir", type=output_dir, default=None, help=OUT_DIR_HELP)
    p.add_argument("--name", default=None, help="result file stem (default wait_policy-<load>)")
    p.add_argument("--measure", type=int, default=None, help=argparse.SUPPRESS)  # in the measured process
    p.add_argument("--width", type=int, default=1024, help=argparse.SUPPRESS)
    return p


def _resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.quick:
        args.blocks, args.rounds, args.width = 1, 2, QUICK_WIDTH
    args.name = args.name or f"wait_policy-{args.load}" + ("-quick" if args.quick else "")
    for flag, value in (("--blocks", args.blocks), ("--rounds", args.rounds), ("--load-procs", args.load_procs),
                        ("--load-threads", args.load_threads)):
        if value < 1:
            p.error(f"{flag} {value}: expected an integer >= 1")


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    started = time.perf_counter()
    processes = []
    with BackgroundLoad(LoadSpec(kind=args.load, procs=args.load_procs, threads=args.load_threads, seed=0)):
        for block in range(args.blocks):
            for policy in (POLICIES if block % 2 == 0 else POLICIES[::-1]):
                processes.append(measure_process(policy, args.rounds, args.width))
    return {"command": " ".join(["python -m bench.tuner_load.wait_policy", *argv]), "load": args.load,
            "blocks": args.blocks, "rounds": args.rounds, "width": args.width,
            "seconds": time.perf_counter() - started, "summary": summarize(processes), "processes": processes,
            "machine": machine_info()}


_main = bench_entry(build_parser=build_parser, run=run, resolve=_resolve, render_markdown=render_markdown)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.measure is not None:  # the measured process: one JSON line on stdout
        print(json.dumps(measure(args.measure, args.width)))
        return 0
    return _main(argv)


if __name__ == "__main__":
    sys.exit(main())
