"""DeepSpeed ZeRO-Offload's CPU Adam step at its default thread count and tuned, next to ``CPUOffloadAdamW``.

    python -m bench.deepspeed_step --out-dir bench/results     # about 2-4 minutes on 2 cores
    python -m bench.deepspeed_step --quick                     # smoke run

One process (a gloo world of one, ``DS_ACCELERATOR=cpu``), one model (``--layers`` square bf16
``Linear`` layers of ``--width``), two copies of it:

- a ``deepspeed.initialize`` engine, ZeRO stage 2, ``offload_optimizer`` cpu, bf16, gradient
  clipping 1.0, whose ``DeepSpeedCPUAdam`` step runs at 1 thread (what torchrun and ``OMP_NUM_THREADS=1``
  leave a rank), at torch's default count in this process (DeepSpeed's default: it reads torch's
  OpenMP count, see below), and at the count ``offload.tune_deepspeed`` locks in (tuned first,
  real clock, no cache);
- ``CPUOffloadAdamW`` (tuned first the same way) with the same clip, inside its step.

Then ``--rounds`` interleaved rounds, the order rotating each round: each arm trains one step
(forward and backward untimed) and records its Adam step (DeepSpeed: the CPU Adam calls of the
engine's step; ours: the kernel stage, ``StepStats.adam_kernel_s``) and its whole optimizer step
(``engine.step()``: norm, clip, CPU Adam, bf16 copy; ours: ``step()`` with the clip). Reported:
median, IQR and n of each. A model on the CPU has no PCIe stage: these are host-side times.

Which OpenMP count DeepSpeedCPUAdam reads is measured here too: a ``--params``-element
DeepSpeedCPUAdam stepped 5 times at ``torch.set_num_threads(1)`` and at this machine's CPUs, with
the CPU time each task of the process accrued (``/proc/self/task/*/stat``) and the OpenMP
libraries mapped (``/proc/self/maps``).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from typing import Any, Callable, Sequence

import torch

from autotune import AutotuneConfig
from bench._args import OUT_DIR_HELP, HelpFormatter, output_dir
from bench._cli import bench_entry
from bench._stats import iqr, machine_info, median

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "openmp_check"]

ARMS = ("ds_1_thread", "ds_default", "ds_tuned", "cpu_offload_adamw")
_TICK = os.sysconf("SC_CLK_TCK")


def _task_cpu_s() -> dict[str, float]:
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[task] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


def openmp_check(params: int, threads: Sequence[int]) -> dict[str, Any]:
    """Wall time and busy tasks (more than 20 ms of CPU time) of 5 DeepSpeedCPUAdam steps of
    ``params`` elements at each ``torch.set_num_threads`` count; the OpenMP libraries mapped."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    p = torch.nn.Parameter(torch.randn(params))
    p.grad = torch.randn(params)
    opt = DeepSpeedCPUAdam([p], lr=1e-3)
    opt.step()
    previous = torch.get_num_threads()
    rows = []
    try:
        for n in threads:
            torch.set_num_threads(n)
            before, t0 = _task_cpu_s(), time.perf_counter()
            for _ in range(5):
                opt.step()
            wall = (time.perf_counter() - t0) / 5
            after = _task_cpu_s()
            busy = sorted((round(after[k] - before.get(k, 0.0), 3) for k in after
                           if after[k] - before.get(k, 0.0) > 0.02), reverse=True)
            rows.append({"set_num_threads": n, "step_s": wall, "busy_task_cpu_s": busy})
    finally:
        torch.set_num_threads(previous)
    with open("/proc/self/maps") as f:
        libs = sorted({line.split()[-1] for line in f if "omp" in line.rsplit("/", 1)[-1] and "/" in line})
    return {"params": params, "extension": opt.ds_opt_adam.__file__, "openmp_libraries": libs, "rows": rows}


def _model(width: int, layers: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _batch(width: int, step: int) -> torch.Tensor:
    return torch.randn(4, width, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)


def measure(*, width: int, layers: int, rounds: int, max_tune_steps: int = 80) -> dict[str, Any]:
    """The interleaved comparison (see the module doc)."""
    import deepspeed

    from offload import CPUOffloadAdamW, tune_deepspeed

    default_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # forward, backward, norm and clip: torchrun's count, the same for every arm
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "steps_per_print": 10 ** 9}
    model = _model(width, layers, 0)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    ours_model = _model(width, layers, 0).to(torch.bfloat16)
    ours = CPUOffloadAdamW(ours_model.parameters(), lr=1e-4, weight_decay=0.01,
                           autotune=AutotuneConfig(use_cache=False))
    step_no = [0]

    def ds_train() -> tuple[float, float]:
        step_no[0] += 1
        engine.backward(engine(_batch(width, step_no[0])).float().pow(2).mean())
        t0 = time.perf_counter()
        engine.step()
        return float(tuning_now[0].last_step_s or 0.0), time.perf_counter() - t0

    def ours_train() -> tuple[float, float]:
        step_no[0] += 1
        ours_model(_batch(width, step_no[0])).float().pow(2).mean().backward()
        t0 = time.perf_counter()
        ours.clip_grad_norm_(1.0)
        ours.step()
        took = time.perf_counter() - t0
        ours.zero_grad(set_to_none=True)
        stats = ours.last_stats
        return float(stats.adam_kernel_s if stats is not None else took), took

    # Tune both first (real clock, no cache), then fix each arm's count.
    tuning_now = [tune_deepspeed(engine, autotune=AutotuneConfig(use_cache=False))]
    began, tune_steps = time.perf_counter(), 0
    while tuning_now[0].session is not None and tuning_now[0].session.state != "locked" and tune_steps < max_tune_steps:
        ds_train()
        tune_steps += 1
    ds_summary, tuned_threads = tuning_now[0].summary(), tuning_now[0].threads
    tuning_now[0].close()
    ds_tuning_s = time.perf_counter() - began
    ours_steps = 0
    while ours.tuner is not None and ours.tuner.state != "locked" and ours_steps < max_tune_steps:
        ours_train()
        ours_steps += 1
    ours_summary = ours.tuner.summary() if ours.tuner is not None else {}
    threads = {"ds_1_thread": 1, "ds_default": default_threads, "ds_tuned": tuned_threads}

    def ds_arm(n: int) -> Callable[[], tuple[float, float]]:
        def arm() -> tuple[float, float]:
            tuning_now[0] = tune_deepspeed(engine, autotune=False, threads=n)
            try:
                return ds_train()
            finally:
                tuning_now[0].close()

        return arm

    arms: dict[str, Callable[[], tuple[float, float]]] = {name: ds_arm(n) for name, n in threads.items()}
    arms["cpu_offload_adamw"] = ours_train
    for name in ARMS:  # one warm-up step each
        arms[name]()
    samples: dict[str, dict[str, list[float]]] = {name: {"adam": [], "step": []} for name in ARMS}
    for r in range(rounds):
        for i in range(len(ARMS)):
            name = ARMS[(i + r) % len(ARMS)]
            adam, step = arms[name]()
            samples[name]["adam"].append(adam)
            samples[name]["step"].append(step)
    ours_settings = ours.settings
    ours.close()
    params = sum(p.numel() for p in model.parameters())

    def stats(s: list[float]) -> dict[str, Any]:
        return {"median_s": median(s), "iqr_s": iqr(s), "n": len(s), "samples_s": s}

    return {
        "params": params, "width": width, "layers": layers, "rounds": rounds, "deepspeed": deepspeed.__version__,
        "arms": {name: {"threads": threads.get(name, ours_settings.threads), "adam": stats(s["adam"]),
                        "step": stats(s["step"])} for name, s in samples.items()},
        "ds_tuner": {k: ds_summary.get(k) for k in ("state", "winner", "baseline", "probe_steps", "reason")},
        "ds_tuning_steps": tune_steps, "ds_tuning_s": ds_tuning_s,
        "ours_tuner": {k: ours_summary.get(k) for k in ("state", "winner", "baseline", "probe_steps")},
        "ours_tuning_steps": ours_steps,
    }


def render_markdown(result: dict[str, Any]) -> str:
    m, h = result["machine"], result["here"]
    lines = [
        "# DeepSpeed ZeRO-Offload's CPU Adam step: default threads vs `tune_deepspeed`, next to `CPUOffloadAdamW`", "",
        f"Command: `{result['command']}`", "",
        f"Machine: {m['cpu_model']}, {m['affinity_cpus']} CPUs in the affinity mask, torch {m['torch']}, "
        f"DeepSpeed {h['deepspeed']}, load average {m['load_avg_1_5_15']} at the end, {m['date_utc']}.", "",
        f"## One bf16 model, {h['params']:,} parameters ({h['layers']} x Linear({h['width']}, {h['width']})), "
        f"{h['rounds']} interleaved rounds", "",
        "Adam step: DeepSpeed's CPU Adam calls of `engine.step()` / our kernel stage. Optimizer step: "
        "`engine.step()` (norm, clip, CPU Adam, bf16 copy) / our `clip_grad_norm_` + `step()`. "
        "Model on the CPU: no PCIe stage. Our kernel stage also does what DeepSpeed does outside its Adam call "
        "(gradient upcast, clip coefficient, bf16 write-back), so the Adam columns are not like for like: "
        "compare DeepSpeed's arms with each other there, and ours with DeepSpeed's in the optimizer-step column.", "",
        "| arm | threads | Adam median ms | IQR ms | optimizer step median ms | IQR ms | n | Adam / ds_tuned |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    tuned = h["arms"]["ds_tuned"]["adam"]["median_s"]
    for name, a in h["arms"].items():
        lines.append(f"| {name} | {a['threads']} | {a['adam']['median_s'] * 1e3:.2f} | {a['adam']['iqr_s'] * 1e3:.2f} | "
                     f"{a['step']['median_s'] * 1e3:.2f} | {a['step']['iqr_s'] * 1e3:.2f} | {a['adam']['n']} | "
                     f"{a['adam']['median_s'] / tuned:.3f} |")
    t, o = h["ds_tuner"], h["ours_tuner"]
    lines += ["", f"tune_deepspeed: {t['state']} on {t['winner']} after {t['probe_steps']} probing steps "
                  f"({h['ds_tuning_s']:.1f} s); static plan {t['baseline']}. {t['reason'] or ''}",
              f"CPUOffloadAdamW's tuner: {o['state']} on {o['winner']} after {o['probe_steps']} probing steps.", ""]
    omp = result.get("openmp")
    if omp:
        lines += [f"## Which thread count DeepSpeedCPUAdam follows ({omp['params']:,} elements, 5 steps each)", "",
                  f"OpenMP libraries mapped: {', '.join(f'`{x}`' for x in omp['openmp_libraries'])}.", "",
                  "| torch.set_num_threads | step ms | CPU s of each busy task |", "|---:|---:|---|"]
        for row in omp["rows"]:
            lines.append(f"| {row['set_num_threads']} | {row['step_s'] * 1e3:.1f} | {row['busy_task_cpu_s']} |")
        lines.append("")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.deepspeed_step", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--width", type=int, default=2048, help="width of each square Linear layer")
    p.add_argument("--layers", type=int, default=4, help="Linear layers (parameters: layers x width x (width+1))")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    p.add_argument("--omp-params", type=int, default=1 << 25, help="elements of the OpenMP check's step")
    p.add_argument("--quick", action="store_true", help="smoke run: width 256, 2 layers, 3 rounds")
    p.add_argument("--out-dir", type=output_dir, default=None, help=OUT_DIR_HELP)
    p.add_argument("--name", default="deepspeed_step", help="file stem of the results")
    return p


def _resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.quick:
        args.width, args.layers, args.rounds, args.omp_params = 256, 2, 3, 1 << 16
    for flag in ("width", "layers", "rounds", "omp_params"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected an integer >= 1")


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    import torch.distributed as dist

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port)}.items():
            os.environ.setdefault(name, value)
        dist.init_process_group("gloo")
    result: dict[str, Any] = {"command": " ".join(["python -m bench.deepspeed_step", *argv])}
    cpus = len(os.sched_getaffinity(0))
    result["openmp"] = openmp_check(args.omp_params, sorted({1, cpus}))
    result["here"] = measure(width=args.width, layers=args.layers, rounds=args.rounds)
    result["machine"] = machine_info()
    return result


main = bench_entry(build_parser=build_parser, run=run, resolve=_resolve,
                   render_markdown=lambda result: render_markdown(result) + "\n", log_level="WARNING")


if __name__ == "__main__":
    sys.exit(main())
