"""Stock AdamW's CPU step, three ways: the launcher default (1 thread), the static rule
(cores / local ranks, what a rank gets without tuning) and ``offload.tune_step_threads`` (the online tuner's choice).

    python -m bench.stock_threads                      # this machine + simulated 8-rank nodes
    python -m bench.stock_threads --quick              # smoke run (small, few rounds and seeds)

What is stepped: the situation of one FSDP2 ``CPUOffloadPolicy`` rank, i.e. ``torch.optim.AdamW
(fused=True)`` over fp32 CPU tensors (parameters, gradients, two moments), ``--params`` elements
split into tensors of uneven sizes. Gradients are set once; every step does the same work.

This machine: three optimizers over three identical tensor sets. The wrapped one tunes first
(its own probing steps, real clock, no cache), then ``--rounds`` interleaved rounds measure one
step of each variant per round, in a rotating order, each timed around ``step()`` with its thread
count set (the wrapper sets its own). Reported: median, IQR and n of each, and ratios of medians.

Simulated nodes (:mod:`bench.simulate`'s 8-rank nodes and step-time model, :mod:`bench.simulate._stepmodel`):
the same nodes, masks and real ``plan_cpu_threads``, a workload of ``--sim-params`` elements per
rank moving 28 bytes per element (fused AdamW in fp32: read parameter, gradient and both moments,
write three) with no PCIe stage (FSDP2 copies outside the step), and the real ``OnlineTuner`` of
every simulated rank driving the wrapper's search space (``offload._stock.step_threads_space``).
Reported: the model's noise-free node time of each variant; for the tuner, the median and 95th
percentile over ``--seeds`` sessions of its locked choice's time, and its probing steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import sys
import time
from typing import Any, Sequence

import torch

from autotune import AutotuneConfig
from bench._args import OUT_DIR_HELP, HelpFormatter, output_dir
from bench._cli import bench_entry
from bench._stats import iqr, machine_info, median, quantile
from bench.simulate import _main as simulate
from bench.simulate._stepmodel import Workload
from offload import thread_limit, tune_step_threads
from offload._stock import step_threads_space
from offload.threads._rule import static_rule_threads

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "measure_here", "simulate_nodes"]

#: Bytes per element of fused AdamW in fp32 (read p, g, m, v; write p, m, v).
ADAMW_FP32_BYTES = 28.0
#: bench.simulate's 8-rank nodes.
SIM_NODES = ("2s60c-smt2-8r-numa", "2s60c-smt2-8r-shared", "2s60c-smt2-8r-exclusive")
VARIANTS = ("launcher", "static_rule", "tuned")


def _tensors(numel: int, seed: int) -> list[torch.nn.Parameter]:
    """``numel`` fp32 elements in 8 tensors of uneven sizes (vector tails), gradients set."""
    g = torch.Generator().manual_seed(seed)
    sizes = [numel // 8 + 37 * i for i in range(7)]
    sizes.append(max(1, numel - sum(sizes)))
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n, generator=g))
        p.grad = torch.randn(n, generator=g)
        params.append(p)
    return params


def measure_here(*, params: int, rounds: int, seed: int = 0, max_tune_steps: int = 80) -> dict[str, Any]:
    """The interleaved comparison on this machine (see the module doc)."""
    cpus = len(os.sched_getaffinity(0))
    static = static_rule_threads(cpus, os.cpu_count() or cpus, 1)
    opts: dict[str, torch.optim.Optimizer] = {
        name: torch.optim.AdamW(_tensors(params, seed), lr=1e-3, fused=True) for name in VARIANTS
    }
    tuned = tune_step_threads(opts["tuned"], autotune=AutotuneConfig(use_cache=False, seed=seed))
    opts["tuned"] = tuned
    threads = {"launcher": 1, "static_rule": static}
    began = time.perf_counter()
    tune_steps = 0
    while tuned.tuner is not None and tuned.tuner.state != "locked" and tune_steps < max_tune_steps:
        tuned.step()
        tune_steps += 1
    tuning_s = time.perf_counter() - began
    summary = tuned.tuner.summary() if tuned.tuner is not None else {}
    threads["tuned"] = tuned.threads

    def one(name: str) -> float:
        opt = opts[name]
        t0 = time.perf_counter()
        if name == "tuned":
            opt.step()
        else:
            with thread_limit(threads[name]):
                opt.step()
        return time.perf_counter() - t0

    for name in VARIANTS:  # one warm-up step each (first touch of the moments, lazy init)
        one(name)
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(rounds):
        for i in range(len(VARIANTS)):
            name = VARIANTS[(i + r) % len(VARIANTS)]
            samples[name].append(one(name))
    tuned.close()
    stats = {name: {"threads": threads[name], "median_s": median(s), "iqr_s": iqr(s), "n": len(s), "samples_s": s}
             for name, s in samples.items()}
    return {
        "params": params,
        "rounds": rounds,
        "variants": stats,
        "ratios": {
            "launcher_over_tuned": stats["launcher"]["median_s"] / stats["tuned"]["median_s"],
            "static_rule_over_tuned": stats["static_rule"]["median_s"] / stats["tuned"]["median_s"],
        },
        "tuner": {k: summary.get(k) for k in ("state", "winner", "baseline", "probe_steps", "sampler", "reason",
                                              "measurements")},
        "tuning_steps": tune_steps,
        "tuning_s": tuning_s,
    }


def _sim_node(name: str, params: int) -> Any:
    node = simulate.build_node(name)
    workload = Workload(params=params, bytes_per_elem=ADAMW_FP32_BYTES, d2h_bytes_per_elem=0.0,
                        h2d_bytes_per_elem=0.0)
    return dataclasses.replace(node, workload=workload, _cache={})


def simulate_nodes(*, names: Sequence[str], params: int, seeds: int) -> list[dict[str, Any]]:
    """Per simulated node: noise-free node time of each variant and of the tuner's choices."""
    out = []
    for name in names:
        node = _sim_node(name, params)
        plans = simulate.plan_node(node)
        caps = [p.planned_threads or p.threads for p in plans]
        top = max(tuple(plans[0].local_threads) or tuple(caps))
        space = step_threads_space(max_threads=top, baseline_threads=top, fixed_threads=False)
        baseline = {"threads": top}

        def node_s(threads: Sequence[int]) -> float:
            return node.node_time(list(threads), params)

        truth = {c["threads"]: node_s([min(c["threads"], cap) for cap in caps]) for c in space.candidates()}
        runs = []
        for seed in range(seeds):
            res = simulate.run_seed(node, space, baseline, caps, seed, config=AutotuneConfig(use_cache=False))
            runs.append({"winner": res["winner"]["threads"], "probe_steps": res["probe_steps"],
                         "true_s": truth[res["winner"]["threads"]], "probe_true_s": res["probe_true_s"]})
        tuned = [r["true_s"] for r in runs]
        statics = [p.static_rule_threads or 1 for p in plans]
        variants = {
            "launcher": {"threads": [1] * node.ranks, "true_s": node_s([1] * node.ranks)},
            "static_rule": {"threads": statics, "true_s": node_s(statics)},
            "static_plan": {"threads": [min(top, c) for c in caps], "true_s": truth[top]},
        }
        best = min(truth.values())
        out.append({
            "node": name,
            "description": node.description,
            "params_per_rank": params,
            "candidates_s": {str(k): v for k, v in truth.items()},
            "best_s": best,
            "variants": variants,
            "tuned": {"median_true_s": statistics.median(tuned), "p95_true_s": quantile(tuned, 0.95),
                      "median_probe_steps": statistics.median(r["probe_steps"] for r in runs),
                      "winners": {str(w): sum(r["winner"] == w for r in runs) for w in sorted({r["winner"] for r in runs})},
                      "seeds": seeds},
            "ratios": {name: v["true_s"] / statistics.median(tuned) for name, v in variants.items()},
        })
    return out


def render_markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        "# Stock AdamW CPU step: launcher default vs static rule vs `tune_step_threads`", "",
        f"Command: `{result['command']}`", "",
        f"Machine: {m['cpu_model']}, {m['affinity_cpus']} CPUs in the affinity mask, torch {m['torch']}, "
        f"load average {m['load_avg_1_5_15']} at the end, {m['date_utc']}.", "",
    ]
    here = result.get("here")
    if here:
        lines += [
            f"## This machine: `torch.optim.AdamW(fused=True)`, {here['params']:,} fp32 elements, "
            f"{here['rounds']} interleaved rounds", "",
            "| variant | threads | median ms | IQR ms | n | median / tuned |", "|---|---:|---:|---:|---:|---:|",
        ]
        tuned = here["variants"]["tuned"]["median_s"]
        for name, v in here["variants"].items():
            lines.append(f"| {name} | {v['threads']} | {v['median_s'] * 1e3:.2f} | {v['iqr_s'] * 1e3:.2f} | {v['n']} | "
                         f"{v['median_s'] / tuned:.3f} |")
        t = here["tuner"]
        lines += ["", f"Tuner: {t['state']} on {t['winner']} after {t['probe_steps']} probing steps "
                      f"({here['tuning_s']:.1f} s); static plan {t['baseline']}. {t['reason']}", ""]
    sims = result.get("simulated") or []
    if sims:
        lines += [
            f"## Simulated 8-rank nodes (step-time model, {sims[0]['params_per_rank']:.0e} fp32 elements per rank, "
            f"28 B/element, {sims[0]['tuned']['seeds']} tuner seeds)", "",
            "Noise-free node time (max over ranks) per step; tuned = median (p95) over seeds of the locked choice.", "",
            "| node | launcher (1 thread) | static rule | static plan | tuned | launcher / tuned | static rule / tuned "
            "| probe steps | winners |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for s in sims:
            v, t = s["variants"], s["tuned"]
            rule = v["static_rule"]["threads"]
            lines.append(
                f"| {s['node']} | {v['launcher']['true_s']:.3f} s | {v['static_rule']['true_s']:.3f} s "
                f"({rule[0]} threads/rank) | {v['static_plan']['true_s']:.3f} s | {t['median_true_s']:.3f} s "
                f"({t['p95_true_s']:.3f}) | {s['ratios']['launcher']:.2f}x | {s['ratios']['static_rule']:.2f}x | "
                f"{t['median_probe_steps']:.0f} | {t['winners']} |")
        lines += [""] + [f"- `{s['node']}`: {s['description'].split(';')[1].strip()}" for s in sims] + [""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.stock_threads", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--params", type=int, default=16_000_000, help="fp32 elements stepped on this machine")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds on this machine")
    p.add_argument("--sim-params", type=int, default=1_000_000_000, help="elements per simulated rank")
    p.add_argument("--seeds", type=int, default=30, help="tuner sessions per simulated node")
    p.add_argument("--skip-here", action="store_true", help="only the simulated nodes")
    p.add_argument("--quick", action="store_true", help="smoke run: 1M elements, 3 rounds, 3 seeds")
    p.add_argument("--out-dir", type=output_dir, default=None, help=OUT_DIR_HELP)
    p.add_argument("--name", default="stock_threads", help="file stem of the results")
    return p


def _resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.quick:
        args.params, args.rounds, args.seeds = 1_000_000, 3, 3
    for flag in ("params", "rounds", "sim_params", "seeds"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected an integer >= 1")


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    torch.set_num_threads(1)  # what torchrun leaves every rank with, outside the measured steps
    result: dict[str, Any] = {"command": " ".join(["python -m bench.stock_threads", *argv])}
    if not args.skip_here:
        result["here"] = measure_here(params=args.params, rounds=args.rounds)
    result["simulated"] = simulate_nodes(names=SIM_NODES, params=args.sim_params, seeds=args.seeds)
    result["machine"] = machine_info()
    return result


main = bench_entry(build_parser=build_parser, run=run, resolve=_resolve,
                   render_markdown=lambda result: render_markdown(result) + "\n", log_level="WARNING")


if __name__ == "__main__":
    sys.exit(main())
