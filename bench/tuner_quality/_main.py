"""Tuner quality on the reference trainer's model: the online tuner's choice vs. an exhaustive sweep.

    python -m bench.tuner_quality                             # 50m fp32, ~4 min on 2 cores
    python -m bench.tuner_quality --grads backward --rounds 12 --name tuner_quality-backward
    python -m bench.tuner_quality --quick --out-dir /tmp/tq   # small model, few rounds (tests)

Gradients: by default fixed synthetic gradients, no forward/backward. The tuner's objective is
the wall time of ``step()`` alone (``offload.tuning._glue``), which forward/backward does not
enter (on this machine the step times with and without them agree within noise: compare
``tuner_quality-backward``); leaving them out makes an iteration about 4x cheaper, so the sweep
gets 4x the samples in the same time on a noisy shared machine. ``--grads backward`` runs the
trainer's forward+backward (batch 1, short sequences) before every step instead.

Everything runs in ONE process on ONE model (the reference trainer's GPT from :mod:`bench.train.model`,
its two parameter groups and AdamW hyper-parameters), so every number below is measured on the
same memory, the same slabs and the same (shared, noisy) machine:

1. **Tuner** (repetition 0): ``CPUOffloadAdamW(..., autotune=AutotuneConfig(cache_path=<temp>,
   seed=S))`` trains until its tuner locks in; then ``--locked-steps`` more steps give the locked
   step time. Recorded: probe steps, winner, every probe step's wall time, the tuner's overhead.
   The optimizer is then closed (one optimizer alive at a time).
2. **Cache hit** (the "second run"): a new optimizer with the same cache file (same fingerprint)
   must find the choice (``cache_hit``), spend 0 probe steps and only re-check the cached winner.
3. **Exhaustive sweep**: on the second run's optimizer (tuner locked, so it stays out of the way),
   every candidate of ``opt.tuner.space.candidates()`` (the static plan and every winner included)
   is applied with ``opt.apply_settings``; ``--rounds`` rounds, each visiting every candidate once
   in a fresh seeded random order; a visit is one discarded warm-up step after the switch and
   ``--per-visit`` measured steps. The objective is the tuner's own: ``StepStats.step_s`` (wall
   time of ``step()``).
4. **More repetitions** of phase 1 with seeds S+1, S+2, ... (fresh cache files), each judged
   against the same sweep: the regret distribution.

Definitions (also written into the JSON under ``definitions``):

* regret = (median_sweep(winner) - median_sweep(best)) / median_sweep(best), best = the candidate
  with the smallest sweep median. Target <= 3 %.
* paired ratio a/b: per sweep round, median of a's samples / median of b's samples; reported as
  the median over rounds with a 95 % bootstrap interval over rounds (machine drift cancels).
* slower than the static plan beyond noise: median(winner) - median(static) > max(IQR(winner),
  IQR(static)) in the sweep (the tuner's own noise rule, applied the other way round).
* probing cost = start-up overhead of the tuner (read right after construction) + sum of the
  wall times of ``step()`` over the probe steps but the run's first (state initialisation, paid
  with or without a tuner) + the wall time of the first locked step (it runs right after the
  switch to the winner) - probe steps x locked step time (one step out, one in), where the locked step time is
  the median wall time of ``step()`` over locked steps 2..L of the same run (``startup_cost_s``)
  or the winner's median in the sweep (``startup_cost_sweep_ref_s``, the headline). Its share
  of a 1000-step run = probing cost / (1000 x locked step time); the share of 1000 training
  iterations divides by 1000 x (locked step time + median forward+backward time) instead.
* break-even steps = probing cost / (median_sweep(static) - median_sweep(winner)) when the winner
  is faster than the static plan, else none.

Results go to ``<out-dir>/<name>.json`` (raw samples), ``<name>.md`` and, unless ``--quick`` or
``--no-plot``, ``<name>.png``. This module measures; the statistics and the analysis of the raw
samples are :mod:`bench.tuner_quality._analysis`, the rendering :mod:`bench.tuner_quality._report`.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shlex
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from bench._args import OUT_DIR_HELP, PATH_RULE, HelpFormatter, output_dir
from bench._cli import bench_entry
from bench._stats import atomic_write_json, atomic_write_text, machine_info, median
from bench.train import _main as train
from bench.train.model import GPT, PRESETS, SyntheticTokens, preset
from bench.tuner_quality._analysis import (
    DEFINITIONS,
    REFERENCE_RUN_STEPS,
    TARGET_REGRET,
    analyse,
    bootstrap_ci,
    cache_view,
    headline,
    label,
    paired_ratio,
    regret,
    run_cost,
    slower_beyond_noise,
    startup_cost,
)
from bench.tuner_quality._report import plot, render_markdown, render_text

logger = logging.getLogger("bench.tuner_quality")

__all__ = [
    "build_parser",
    "main",
    "run",
    "regret",
    "paired_ratio",
    "bootstrap_ci",
    "slower_beyond_noise",
    "startup_cost",
    "TARGET_REGRET",
]

#: The reference trainer's AdamW hyper-parameters (bench.train); lr is lower so that hundreds
#: of steps at batch 1 never diverge (the value does not change the step's speed).
LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.95), 1e-8, 0.1
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ------------------------------------------------------------------------------------ workload
@dataclass(frozen=True, slots=True)
class StepRecord:
    """One training iteration as the benchmark saw it."""

    wall_s: float
    """Wall time of ``opt.step()`` measured outside (includes the tuner's per-step work)."""
    step_s: float
    """``StepStats.step_s``: what the tuner minimises."""
    threads: int
    chunk_numel: int
    fwd_bwd_s: float
    """Forward + backward before the step (0 with synthetic gradients)."""

    def to_dict(self) -> dict[str, Any]:
        return {"wall_s": self.wall_s, "step_s": self.step_s, "threads": self.threads,
                "chunk_numel": self.chunk_numel, "fwd_bwd_s": self.fwd_bwd_s}


class Workload:
    """The reference trainer's model, parameter groups and data; makes optimizers and runs iterations."""

    def __init__(self, args: argparse.Namespace) -> None:
        cfg = preset(args.model_size)
        torch.manual_seed(args.seed)
        self.model = GPT(cfg).to(dtype=_DTYPES[args.dtype])
        self.params = [p for p in self.model.parameters()]
        self.numel = sum(p.numel() for p in self.params)
        self.backward = args.grads == "backward"
        self.seq_len = min(args.seq_len, cfg.max_seq_len)
        self.data: SyntheticTokens | None = None
        if self.backward:
            self.data = SyntheticTokens(vocab_size=cfg.vocab_size, batch_size=args.batch_size,
                                        seq_len=self.seq_len, seed=args.seed)
        else:
            gen = torch.Generator().manual_seed(args.seed + 1)
            for p in self.params:
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
        self.last_loss: float | None = None

    def optimizer(self, autotune: Any = False) -> tuple[Any, float]:
        """A ``CPUOffloadAdamW`` shaped like the trainer's (its two parameter groups) and its construction time."""
        from offload import CPUOffloadAdamW

        t0 = time.perf_counter()
        opt = CPUOffloadAdamW(train._param_groups(self.model, WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS,
                              weight_decay=WEIGHT_DECAY, autotune=autotune)
        return opt, time.perf_counter() - t0

    def iterate(self, opt: Any) -> StepRecord:
        """One training iteration: (forward + backward) then ``opt.step()``; only the step is what is tuned."""
        fwd_bwd = 0.0
        if self.data is not None:
            x, y = self.data.next_batch()  # made before the clock starts, as in the trainer
            t0 = time.perf_counter()
            loss = self.model(x, y)
            loss.backward()
            fwd_bwd = time.perf_counter() - t0
            self.last_loss = float(loss.detach())
        t1 = time.perf_counter()
        opt.step()
        wall = time.perf_counter() - t1
        if self.data is not None:
            opt.zero_grad(set_to_none=True)
        st = opt.last_stats
        return StepRecord(wall, float(st.step_s), int(st.threads), int(st.chunk_numel), fwd_bwd)



def _code_state() -> dict[str, Any]:
    """The commit and the files changed since it (a result belongs to the code that made it)."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "autotune", "offload", "bench"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=False).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "changed": []}
    return {"commit": head or None, "changed": [line.strip() for line in dirty]}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _cpu_snapshot() -> tuple[float, float, float]:
    """(monotonic time, CPU seconds busy on the whole machine, CPU seconds of this process)."""
    import psutil

    total = psutil.cpu_times()
    busy = sum(total) - total.idle - getattr(total, "iowait", 0.0)
    own = psutil.Process().cpu_times()
    return time.monotonic(), busy, own.user + own.system


def _cpu_use(before: tuple[float, float, float]) -> dict[str, float]:
    """Shares of the machine's CPU capacity used by this process and by everything else since ``before``."""
    after = _cpu_snapshot()
    capacity = max(after[0] - before[0], 1e-9) * (os.cpu_count() or 1)
    own = after[2] - before[2]
    return {"own_share": own / capacity, "others_share": max(0.0, (after[1] - before[1]) - own) / capacity}


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


# ------------------------------------------------------------------------------------ phases
def tune_run(work: Workload, *, seed: int, cache_path: Path, locked_steps: int,
             trace_dir: Path | None = None, keep: bool = False,
             recheck_rounds: int | None = None) -> tuple[dict[str, Any], Any]:
    """Phase 1 (or the cache-hit run): train until the tuner locks, then ``locked_steps`` more.

    ``recheck_rounds``: ``AutotuneConfig.recheck_rounds`` (None: its default). Returns the
    record and the optimizer (None unless ``keep``; else it is closed). A kept optimizer serves
    the sweep, which sets every candidate itself: its tuner runs without the watch, whose rounds
    would switch settings under the sweep (the watch is not part of the cache key: the run still
    hits the cache of the first).
    """
    config = _autotune_config(seed, recheck_rounds, cache_path=str(cache_path),
                              trace_dir=str(trace_dir) if trace_dir is not None else None,
                              **({"watch": False} if keep else {}))
    load_before = _load()
    cpu = _cpu_snapshot()
    opt, construct_s = work.optimizer(config)
    try:
        tuner = opt.tuner
        start = tuner.summary()
        active: list[StepRecord] = []
        limit = 2 * config.probe_steps + config.warmup_steps + config.measure_steps + 1  # re-check + stale re-tune
        t0 = time.perf_counter()
        while tuner.state != "locked":
            if len(active) >= limit:
                raise RuntimeError(f"the tuner is still {tuner.state!r} after {len(active)} steps: expected it "
                                   f"to lock within {limit} (probe budget {config.probe_steps})")
            active.append(work.iterate(opt))
        active_span_s = time.perf_counter() - t0
        locked = [work.iterate(opt) for _ in range(locked_steps)]
        summary = tuner.summary()
    finally:
        if not keep:
            opt.close()
    locked_step_s = median([r.wall_s for r in locked[1:]])
    fwd_bwd = [r.fwd_bwd_s for r in active + locked]
    cost = run_cost(start["overhead_s"], active, locked, locked_step_s)
    iteration_s = locked_step_s + median(fwd_bwd)
    record = {
        "seed": seed,
        "construct_s": construct_s,
        "start_overhead_s": start["overhead_s"],
        "cache_status_at_start": start["cache_status"],
        "summary": summary,
        "first_step_s": (active + locked)[0].wall_s,
        "active_steps": [r.to_dict() for r in active],
        "active_wall_sum_s": sum(r.wall_s for r in active),
        "active_span_s": active_span_s,
        "locked_steps": [r.to_dict() for r in locked],
        "locked_step_s": locked_step_s,
        "fwd_bwd_median_s": median(fwd_bwd),
        "startup_cost_s": cost,
        "share_of_1000_steps": cost / (REFERENCE_RUN_STEPS * locked_step_s),
        "share_of_1000_iterations": cost / (REFERENCE_RUN_STEPS * iteration_s),
        "load_before": load_before,
        "load_after": _load(),
        "cpu_use": _cpu_use(cpu),
    }
    return record, (opt if keep else None)


def sweep(work: Workload, opt: Any, candidates: list[dict[str, Any]], *, rounds: int, per_visit: int,
          seed: int) -> dict[str, Any]:
    """Every candidate, interleaved: ``rounds`` rounds in fresh random orders; per visit one
    discarded warm-up step after the switch, then ``per_visit`` measured steps."""
    rng = random.Random(seed)
    step_s = [[[] for _ in range(rounds)] for _ in candidates]
    wall_s = [[[] for _ in range(rounds)] for _ in candidates]
    orders = []
    load_before = _load()
    cpu = _cpu_snapshot()
    t0 = time.perf_counter()
    for r in range(rounds):
        order = list(range(len(candidates)))
        rng.shuffle(order)
        orders.append(order)
        for i in order:
            want = candidates[i]
            opt.apply_settings(replace(opt.settings, **want))  # every knob of the space is an OffloadSettings field
            work.iterate(opt)  # warm-up after the switch, discarded
            for _ in range(per_visit):
                rec = work.iterate(opt)
                if (rec.threads, rec.chunk_numel) != (want["threads"], want["chunk_numel"]):
                    raise RuntimeError(f"asked for {label(want)}, the step ran threads={rec.threads} "
                                       f"chunk={rec.chunk_numel}")
                step_s[i][r].append(rec.step_s)
                wall_s[i][r].append(rec.wall_s)
        logger.info("sweep: round %d/%d done (%.0f s)", r + 1, rounds, time.perf_counter() - t0)
    return {"rounds": rounds, "per_visit": per_visit, "orders": orders, "step_s_by_round": step_s,
            "wall_s_by_round": wall_s, "duration_s": time.perf_counter() - t0, "load_before": load_before,
            "load_after": _load(), "cpu_use": _cpu_use(cpu)}


# ------------------------------------------------------------------------------------ driver
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.tuner_quality", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model-size", choices=sorted(PRESETS), default=None, help="default 50m (small with --quick)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="model parameter dtype")
    p.add_argument("--grads", choices=("backward", "synthetic"), default=None,
                   help="synthetic: fixed random gradients, no forward/backward (default); backward: the "
                        "trainer's forward+backward before each step")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step (--grads backward)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (--grads backward)")
    p.add_argument("--reps", type=int, default=None,
                   help="tuner repetitions, seeds seed..seed+reps-1 (default 5; 2 quick)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved sweep rounds (default 40; 2 quick)")
    p.add_argument("--per-visit", type=int, default=None,
                   help="measured steps per sweep visit, after one discarded (default 2; 1 quick)")
    p.add_argument("--locked-steps", type=int, default=None,
                   help="steps after lock-in that give the locked step time (default 10; 3 quick)")
    p.add_argument("--seed", type=int, default=0, help="model, data, sweep order and first tuner seed")
    p.add_argument("--recheck-rounds", type=int, default=None,
                   help="AutotuneConfig.recheck_rounds of every run (default: its default); 1 makes the "
                        "cache-hit run's re-check keep the cached choice whatever the machine's load (tests)")
    p.add_argument("--trace-dir", type=output_dir, default=None, help=f"tuner trace of repetition 0 ({PATH_RULE})")
    p.add_argument("--quick", action="store_true", help="small model, synthetic gradients, few rounds: a smoke run")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--out-dir", type=output_dir, default=None, help=OUT_DIR_HELP)
    p.add_argument("--name", default=None, help="result file stem (default tuner_quality or tuner_quality-quick)")
    p.add_argument("--note", default="", help="free text stored with the result (e.g. machine load)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="logging level (stderr)")
    return p


def _resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    q = args.quick
    args.model_size = args.model_size or ("small" if q else "50m")
    args.grads = args.grads or "synthetic"
    args.reps = args.reps if args.reps is not None else (2 if q else 5)
    args.rounds = args.rounds if args.rounds is not None else (2 if q else 40)
    args.per_visit = args.per_visit if args.per_visit is not None else (1 if q else 2)
    args.locked_steps = args.locked_steps if args.locked_steps is not None else (3 if q else 10)
    args.name = args.name or ("tuner_quality-quick" if q else "tuner_quality")
    for flag, value, lo in (("--reps", args.reps, 1), ("--rounds", args.rounds, 2), ("--per-visit", args.per_visit, 1),
                            ("--locked-steps", args.locked_steps, 2), ("--batch-size", args.batch_size, 1),
                            ("--seq-len", args.seq_len, 1), ("--seed", args.seed, 0)):
        if value < lo:
            p.error(f"{flag} {value}: expected an integer >= {lo}")
    if args.recheck_rounds is not None and args.recheck_rounds < 1:
        p.error(f"--recheck-rounds {args.recheck_rounds}: expected an integer >= 1")
    return args


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    from offload import plan_cpu_threads

    info = machine_info()
    code = _code_state()
    uptime_before = _uptime()
    started = time.time()
    threads_before = torch.get_num_threads()
    plan = plan_cpu_threads()
    torch.set_num_threads(plan.threads)  # forward/backward threads, as the trainer sets them
    # torch's Optimizer base class imports torch._dynamo on its first use in a process (seconds):
    # pay that once here, so construction times compare the tuner's work, not torch's import.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    try:
        work = Workload(args)
        logger.info("model %s %s: %s parameters, gradients: %s", args.model_size, args.dtype, f"{work.numel:,}",
                    args.grads)
        with tempfile.TemporaryDirectory(prefix="tuner_quality-") as tmp:
            tmpdir = Path(tmp)
            tol = args.recheck_rounds
            rep0, _ = tune_run(work, seed=args.seed, cache_path=tmpdir / "cache-0.json",
                               locked_steps=args.locked_steps, trace_dir=args.trace_dir, recheck_rounds=tol)
            logger.info("tuner: %s after %d probe steps", label(rep0["summary"]["winner"]),
                        rep0["summary"]["probe_steps"])
            # The second run: same cache file, same fingerprint; only the re-check should run. Its
            # optimizer (tuner locked) then serves the sweep: one optimizer alive at a time.
            second, opt = tune_run(work, seed=args.seed, cache_path=tmpdir / "cache-0.json",
                                   locked_steps=args.locked_steps, keep=True, recheck_rounds=tol)
            logger.info("cache-hit run: %s, %d probe steps, %d re-check steps",
                        second["summary"]["cache_status"], second["summary"]["probe_steps"],
                        second["summary"]["check_steps"])
            try:
                candidates = [dict(c) for c in opt.tuner.space.candidates()]
                static = dict(opt.tuner.baseline)
                raw = sweep(work, opt, candidates, rounds=args.rounds, per_visit=args.per_visit, seed=args.seed)
            finally:
                opt.close()
            reps = [rep0]
            for k in range(1, args.reps):
                rec, _ = tune_run(work, seed=args.seed + k, cache_path=tmpdir / f"cache-{k}.json",
                                  locked_steps=args.locked_steps, recheck_rounds=tol)
                logger.info("repetition %d: %s after %d probe steps", k, label(rec["summary"]["winner"]),
                            rec["summary"]["probe_steps"])
                reps.append(rec)
    finally:
        torch.set_num_threads(threads_before)
    analysis = analyse(candidates, static, raw, reps, seed=args.seed)
    result = {
        "benchmark": "bench.tuner_quality",
        "command": "python -m bench.tuner_quality " + " ".join(shlex.quote(a) for a in argv),
        "machine": info,
        "code": code,
        "uptime_before": uptime_before,
        "uptime_after": _uptime(),
        "duration_s": round(time.time() - started, 1),
        "note": args.note,
        "config": {"model_size": args.model_size, "dtype": args.dtype, "grads": args.grads,
                   "batch_size": args.batch_size, "seq_len": work.seq_len, "reps": args.reps,
                   "rounds": args.rounds, "per_visit": args.per_visit, "locked_steps": args.locked_steps,
                   "seed": args.seed, "quick": args.quick, "lr": LR, "betas": list(BETAS),
                   "weight_decay": WEIGHT_DECAY, "forward_backward_threads": plan.threads},
        "workload": {"params": work.numel, "param_groups": 2, "last_loss": work.last_loss},
        "autotune_config": _config_dict(reps[0], args.recheck_rounds),
        "space": {"candidates": candidates, "static_plan": static, "n": len(candidates)},
        "target_regret": TARGET_REGRET,
        "headline": headline(analysis, reps, second),
        "analysis": analysis,
        "cache_hit_run": cache_view(rep0, second),
        "sweep_raw": raw,
        "tuner_runs": reps,
        "second_run": second,
        "definitions": DEFINITIONS,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = atomic_write_json(args.out_dir / f"{args.name}.json", result)
    md_path = atomic_write_text(args.out_dir / f"{args.name}.md", render_markdown(result))
    written = [json_path, md_path]
    if not (args.quick or args.no_plot):
        png = plot(result, args.out_dir / f"{args.name}.png")
        if png is not None:
            written.append(png)
    print(render_text(result), flush=True)
    print("wrote " + ", ".join(map(str, written)), flush=True)
    return result


def _autotune_config(seed: int, recheck_rounds: int | None, **fields: Any) -> Any:
    """The tuner's config of every run: defaults but the seed (and ``--recheck-rounds``; the
    paths; no watch for the optimizer the sweep keeps)."""
    from autotune import AutotuneConfig

    extra = {} if recheck_rounds is None else {"recheck_rounds": recheck_rounds}
    return AutotuneConfig(seed=seed, **extra, **fields)


def _config_dict(rep: dict[str, Any], recheck_rounds: int | None) -> dict[str, Any]:
    from dataclasses import asdict

    cfg = asdict(_autotune_config(rep["seed"], recheck_rounds))
    cfg.pop("cache_path")
    cfg.pop("trace_dir")
    return cfg


main = bench_entry(build_parser=build_parser, run=run, resolve=_resolve)
