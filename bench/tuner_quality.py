"""Tuner quality on the reference trainer's model: the online tuner's choice vs. an exhaustive sweep.

    python -m bench.tuner_quality                             # 50m fp32, ~4 min on 2 cores
    python -m bench.tuner_quality --grads backward --rounds 12 --name tuner_quality-backward
    python -m bench.tuner_quality --quick --out-dir /tmp/tq   # small model, few rounds (tests)

Gradients: by default fixed synthetic gradients, no forward/backward. The tuner's objective is
the wall time of ``step()`` alone (``offload/_autotune.py``), which forward/backward does not
enter (on this machine the step times with and without them agree within noise: compare
``tuner_quality-backward``); leaving them out makes an iteration about 4x cheaper, so the sweep
gets 4x the samples in the same time on a noisy shared machine. ``--grads backward`` runs the
trainer's forward+backward (batch 1, short sequences) before every step instead.

Everything runs in ONE process on ONE model (the reference trainer's GPT from ``bench/model.py``,
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
``--no-plot``, ``<name>.png``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from bench import train
from bench._stats import atomic_write_json, atomic_write_text, iqr, machine_info, median, quantile
from bench.model import GPT, PRESETS, SyntheticTokens, preset

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

#: Target of the issue: the tuner's choice within 3 % of the best swept setting.
TARGET_REGRET = 0.03
#: Confidence of the bootstrap intervals and resamples drawn for them.
CI_LEVEL = 0.95
BOOTSTRAP_RESAMPLES = 2000
#: A run of this many training steps is the reference for the probing cost.
REFERENCE_RUN_STEPS = 1000
#: The reference trainer's AdamW hyper-parameters (bench/train.py); lr is lower so that hundreds
#: of steps at batch 1 never diverge (the value does not change the step's speed).
LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.95), 1e-8, 0.1
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_MS = 1e3


# ------------------------------------------------------------------------------------ statistics
def regret(winner_median: float, best_median: float) -> float:
    """Relative excess of the winner's median over the best one's (0 when the winner is the best)."""
    if not best_median > 0:
        raise ValueError(f"best_median={best_median!r}: expected a positive number of seconds")
    return (winner_median - best_median) / best_median


def paired_ratio(a_by_round: Sequence[Sequence[float]], b_by_round: Sequence[Sequence[float]]) -> list[float]:
    """Per round, median(a) / median(b): both measured in the same round, so slow drift cancels."""
    if len(a_by_round) != len(b_by_round):
        raise ValueError(f"{len(a_by_round)} rounds of a vs {len(b_by_round)} of b: expected the same rounds")
    return [median(a) / median(b) for a, b in zip(a_by_round, b_by_round) if a and b]


def bootstrap_ci(values: Sequence[float], *, level: float = CI_LEVEL, resamples: int = BOOTSTRAP_RESAMPLES,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of ``values`` (seeded: the same data give the same interval)."""
    if not values:
        raise ValueError("bootstrap_ci: expected at least one value, got none")
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(median([values[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    tail = (1.0 - level) / 2.0
    return quantile(medians, tail), quantile(medians, 1.0 - tail)


def slower_beyond_noise(candidate: Sequence[float], reference: Sequence[float]) -> bool:
    """True if ``candidate``'s median exceeds ``reference``'s by more than the larger IQR of the two."""
    return median(candidate) - median(reference) > max(iqr(candidate), iqr(reference))


def startup_cost(*, start_overhead_s: float, active_walls: Sequence[float], first_locked_wall: float,
                 locked_step_s: float) -> float:
    """Seconds a tuning (or re-check) phase costs over running the locked setting from the start.

    ``active_walls``: wall times of ``step()`` while probing or re-checking; the first locked step
    is charged too because it follows the switch to the winner.
    """
    return start_overhead_s + sum(active_walls) + first_locked_wall - (len(active_walls) + 1) * locked_step_s


def _dist(samples: Sequence[float]) -> dict[str, Any]:
    return {"median": median(samples), "iqr": iqr(samples), "q25": quantile(samples, 0.25),
            "q75": quantile(samples, 0.75), "n": len(samples)}


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


def _label(setting: dict[str, Any]) -> str:
    text = f"threads={setting['threads']} chunk={_chunk_text(setting['chunk_numel'])}"
    extra = [f"{k}={v}" for k, v in setting.items() if k not in ("threads", "chunk_numel")]
    return " ".join([text, *extra])


def _chunk_text(numel: int) -> str:
    if numel % (1 << 20) == 0:
        return f"{numel >> 20}Mi"
    if numel % (1 << 10) == 0:
        return f"{numel >> 10}Ki"
    return str(numel)


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
             recheck_tolerance: float | None = None) -> tuple[dict[str, Any], Any]:
    """Phase 1 (or the cache-hit run): train until the tuner locks, then ``locked_steps`` more.

    ``recheck_tolerance``: ``AutotuneConfig.recheck_tolerance`` (None: its default). Returns the
    record and the optimizer (None unless ``keep``; else it is closed).
    """
    config = _autotune_config(seed, recheck_tolerance, cache_path=str(cache_path),
                              trace_dir=str(trace_dir) if trace_dir is not None else None)
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
    cost = _run_cost(start["overhead_s"], active, locked, locked_step_s)
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


def _run_cost(start_overhead_s: float, active: Sequence[Any], locked: Sequence[Any], locked_step_s: float) -> float:
    """:func:`startup_cost` of one run. The run's first step is left out: it initialises the
    optimizer state (first touch of the host slabs), which every run pays, tuned or not."""
    if not active:
        return start_overhead_s  # locked at start (one candidate): nothing probed, no switch
    walls = [r["wall_s"] if isinstance(r, dict) else r.wall_s for r in active]
    first_locked = locked[0]["wall_s"] if isinstance(locked[0], dict) else locked[0].wall_s
    return startup_cost(start_overhead_s=start_overhead_s, active_walls=walls[1:], first_locked_wall=first_locked,
                        locked_step_s=locked_step_s)


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
                    raise RuntimeError(f"asked for {_label(want)}, the step ran threads={rec.threads} "
                                       f"chunk={rec.chunk_numel}")
                step_s[i][r].append(rec.step_s)
                wall_s[i][r].append(rec.wall_s)
        logger.info("sweep: round %d/%d done (%.0f s)", r + 1, rounds, time.perf_counter() - t0)
    return {"rounds": rounds, "per_visit": per_visit, "orders": orders, "step_s_by_round": step_s,
            "wall_s_by_round": wall_s, "duration_s": time.perf_counter() - t0, "load_before": load_before,
            "load_after": _load(), "cpu_use": _cpu_use(cpu)}


# ------------------------------------------------------------------------------------ analysis
def analyse(candidates: list[dict[str, Any]], static: dict[str, Any], raw: dict[str, Any],
            reps: list[dict[str, Any]], *, seed: int) -> dict[str, Any]:
    """Per-candidate statistics of the sweep and each repetition's regret and check against the static plan."""
    by_round = raw["step_s_by_round"]
    flat = [[x for rnd in rows for x in rnd] for rows in by_round]
    medians = [median(s) for s in flat]
    wall_medians = [median([x for rnd in rows for x in rnd]) for rows in raw["wall_s_by_round"]]
    best = min(range(len(candidates)), key=lambda i: medians[i])
    static_i = candidates.index(static)
    rows = []
    for i, cand in enumerate(candidates):
        vs_best = paired_ratio(by_round[i], by_round[best])
        vs_static = paired_ratio(by_round[i], by_round[static_i])
        rows.append({
            "candidate": cand, "label": _label(cand), "samples_s": flat[i], **_dist(flat[i]),
            "wall_median": wall_medians[i],
            "ratio_to_best": medians[i] / medians[best],
            "paired_ratio_to_best": {"median": median(vs_best), "ci": list(bootstrap_ci(vs_best, seed=seed))},
            "paired_ratio_to_static": {"median": median(vs_static), "ci": list(bootstrap_ci(vs_static, seed=seed))},
            "is_best": i == best, "is_static": i == static_i,
            "winner_of_reps": [k for k, rep in enumerate(reps) if rep["summary"]["winner"] == cand],
        })
    judged = []
    for k, rep in enumerate(reps):
        s = rep["summary"]
        w = candidates.index(s["winner"])
        explored = [m["candidate"] for m in s["measurements"]]
        r = regret(medians[w], medians[best])
        wb, ws = rows[w]["paired_ratio_to_best"], rows[w]["paired_ratio_to_static"]
        # The per-round (paired) view of the same regret: slow drifts of the machine cancel.
        r_paired = wb["median"] - 1.0
        saving = medians[static_i] - medians[w]
        # The same cost with the locked step time taken from the sweep (many interleaved samples of
        # the winner) instead of the run's own few locked steps.
        cost_sweep = _run_cost(rep["start_overhead_s"], rep["active_steps"], rep["locked_steps"], wall_medians[w])
        judged.append({
            "startup_cost_sweep_ref_s": cost_sweep,
            "share_of_1000_steps_sweep_ref": cost_sweep / (REFERENCE_RUN_STEPS * wall_medians[w]),
            "claimed_speedup": s["speedup"],
            "rep": k, "seed": rep["seed"], "winner": s["winner"], "winner_label": _label(s["winner"]),
            "kept_static_plan": bool(s["kept_baseline"]), "sampler": s["sampler"],
            "probe_steps": s["probe_steps"], "explored": len(explored), "n_candidates": len(candidates),
            "best_was_explored": candidates[best] in explored, "reason": s["reason"],
            "regret": r, "meets_target": r <= TARGET_REGRET, "regret_paired": r_paired,
            # Noise view of the regret: the winner's and the best's IQRs overlap, or the paired
            # interval of winner/best reaches down to 1.
            "iqr_overlaps_best": rows[w]["q25"] <= rows[best]["q75"],
            "paired_ci_includes_1": wb["ci"][0] <= 1.0,
            "paired_ratio_to_best": wb, "paired_ratio_to_static": ws,
            "slower_than_static_beyond_noise": slower_beyond_noise(flat[w], flat[static_i]),
            "saving_per_step_s": saving,
            "break_even_steps": rep["startup_cost_s"] / saving if saving > 0 else None,
            "startup_cost_s": rep["startup_cost_s"], "share_of_1000_steps": rep["share_of_1000_steps"],
            "share_of_1000_iterations": rep["share_of_1000_iterations"],
            "probe_wall_s": rep["active_wall_sum_s"], "locked_step_s": rep["locked_step_s"],
        })
    regrets = [j["regret"] for j in judged]
    paired = [j["regret_paired"] for j in judged]
    return {
        "regret_paired_median": median(paired), "regret_paired_max": max(paired),
        "candidates": rows, "best": candidates[best], "best_label": _label(candidates[best]),
        "static": static, "static_label": _label(static), "reps": judged,
        "regret_median": median(regrets), "regret_max": max(regrets),
        "reps_meeting_target": sum(j["meets_target"] for j in judged),
        "never_slower_than_static": not any(j["slower_than_static_beyond_noise"] for j in judged),
    }


def cache_view(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """The second run's start-up (cache hit: re-check only) next to the first run's (probing)."""
    s2 = second["summary"]
    k = len(second["active_steps"])
    return {
        "cache_hit": s2["cache_hit"], "cache_status": s2["cache_status"], "probe_steps": s2["probe_steps"],
        "check_steps": s2["check_steps"], "winner": s2["winner"], "winner_label": _label(s2["winner"]),
        "same_winner_as_first_run": s2["winner"] == first["summary"]["winner"],
        "first_run": {"construct_s": first["construct_s"], "start_overhead_s": first["start_overhead_s"],
                      "first_step_s": first["first_step_s"],
                      "steps_to_lock": len(first["active_steps"]),
                      "wall_to_lock_s": first["active_wall_sum_s"],
                      "first_k_wall_s": sum(r["wall_s"] for r in first["active_steps"][:k]),
                      "startup_cost_s": first["startup_cost_s"], "locked_step_s": first["locked_step_s"]},
        "second_run": {"construct_s": second["construct_s"], "start_overhead_s": second["start_overhead_s"],
                       "first_step_s": second["first_step_s"],
                       "steps_to_lock": k, "wall_to_lock_s": second["active_wall_sum_s"],
                       "first_k_wall_s": second["active_wall_sum_s"],
                       "startup_cost_s": second["startup_cost_s"], "locked_step_s": second["locked_step_s"]},
        "k": k,
    }


# ------------------------------------------------------------------------------------ driver
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.tuner_quality", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    p.add_argument("--recheck-tolerance", type=float, default=None,
                   help="AutotuneConfig.recheck_tolerance of every run (default: its default); a large value "
                        "makes the cache-hit run's re-check confirm whatever the machine's load (tests)")
    p.add_argument("--trace-dir", type=Path, default=None, help="tuner trace of repetition 0")
    p.add_argument("--quick", action="store_true", help="small model, synthetic gradients, few rounds: a smoke run")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--name", default=None, help="result file stem (default tuner_quality or tuner_quality-quick)")
    p.add_argument("--note", default="", help="free text stored with the result (e.g. machine load)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
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
    tol = args.recheck_tolerance
    if tol is not None and not (math.isfinite(tol) and tol >= 0):
        p.error(f"--recheck-tolerance {tol}: expected a finite number >= 0")
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
            tol = args.recheck_tolerance
            rep0, _ = tune_run(work, seed=args.seed, cache_path=tmpdir / "cache-0.json",
                               locked_steps=args.locked_steps, trace_dir=args.trace_dir, recheck_tolerance=tol)
            logger.info("tuner: %s after %d probe steps", _label(rep0["summary"]["winner"]),
                        rep0["summary"]["probe_steps"])
            # The second run: same cache file, same fingerprint; only the re-check should run. Its
            # optimizer (tuner locked) then serves the sweep: one optimizer alive at a time.
            second, opt = tune_run(work, seed=args.seed, cache_path=tmpdir / "cache-0.json",
                                   locked_steps=args.locked_steps, keep=True, recheck_tolerance=tol)
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
                                  locked_steps=args.locked_steps, recheck_tolerance=tol)
                logger.info("repetition %d: %s after %d probe steps", k, _label(rec["summary"]["winner"]),
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
        "autotune_config": _config_dict(reps[0], args.recheck_tolerance),
        "space": {"candidates": candidates, "static_plan": static, "n": len(candidates)},
        "target_regret": TARGET_REGRET,
        "headline": _headline(analysis, reps, second),
        "analysis": analysis,
        "cache_hit_run": cache_view(rep0, second),
        "sweep_raw": raw,
        "tuner_runs": reps,
        "second_run": second,
        "definitions": _DEFINITIONS,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = atomic_write_json(args.out_dir / f"{args.name}.json", result)
    md_path = atomic_write_text(args.out_dir / f"{args.name}.md", render_markdown(result))
    written = [json_path, md_path]
    if not (args.quick or args.no_plot):
        png = _plot(result, args.out_dir / f"{args.name}.png")
        if png is not None:
            written.append(png)
    print(render_text(result), flush=True)
    print("wrote " + ", ".join(map(str, written)), flush=True)
    return result


def _autotune_config(seed: int, recheck_tolerance: float | None, **paths: Any) -> Any:
    """The tuner's config of every run: defaults but the seed (and ``--recheck-tolerance``)."""
    from autotune import AutotuneConfig

    extra = {} if recheck_tolerance is None else {"recheck_tolerance": recheck_tolerance}
    return AutotuneConfig(seed=seed, **extra, **paths)


def _config_dict(rep: dict[str, Any], recheck_tolerance: float | None) -> dict[str, Any]:
    from dataclasses import asdict

    cfg = asdict(_autotune_config(rep["seed"], recheck_tolerance))
    cfg.pop("cache_path")
    cfg.pop("trace_dir")
    return cfg


def _headline(a: dict[str, Any], reps: list[dict[str, Any]], second: dict[str, Any]) -> dict[str, Any]:
    r0 = a["reps"][0]
    s2 = second["summary"]
    return {
        "winner": r0["winner"], "best": a["best"], "static_plan": a["static"],
        "regret": r0["regret"], "regret_median": a["regret_median"], "regret_max": a["regret_max"],
        "regret_paired": r0["regret_paired"], "regret_paired_median": a["regret_paired_median"],
        "regret_paired_max": a["regret_paired_max"],
        "reps": len(reps), "reps_meeting_target": a["reps_meeting_target"],
        "meets_target": r0["regret"] <= TARGET_REGRET,
        "never_slower_than_static": a["never_slower_than_static"],
        "probe_steps": r0["probe_steps"], "probe_budget": reps[0]["summary"]["probe_budget"],
        "probe_wall_s": r0["probe_wall_s"], "startup_cost_s": r0["startup_cost_s"],
        "share_of_1000_steps": r0["share_of_1000_steps"],
        "share_of_1000_iterations": r0["share_of_1000_iterations"],
        "startup_cost_sweep_ref_s": r0["startup_cost_sweep_ref_s"],
        "share_of_1000_steps_sweep_ref": r0["share_of_1000_steps_sweep_ref"],
        "cache_hit": s2["cache_hit"], "cache_probe_steps": s2["probe_steps"], "cache_check_steps": s2["check_steps"],
        "cache_startup_cost_s": second["startup_cost_s"],
    }


_DEFINITIONS = {
    "objective": "StepStats.step_s: wall time of CPUOffloadAdamW.step() (the tuner's objective without "
                 "overlap_backward)",
    "regret": "(median_sweep(winner) - median_sweep(best)) / median_sweep(best); best = smallest sweep median",
    "regret_paired": "median over sweep rounds of (median(winner) / median(best) in that round) - 1",
    "paired_ratio": "per sweep round: median(a's samples) / median(b's samples); median over rounds, "
                    f"{int(CI_LEVEL * 100)}% percentile bootstrap interval over rounds "
                    f"({BOOTSTRAP_RESAMPLES} resamples)",
    "slower_than_static_beyond_noise": "median_sweep(winner) - median_sweep(static) > max(IQR(winner), IQR(static))",
    "startup_cost_s": "tuner start overhead (summary()['overhead_s'] right after construction) + sum of step() wall "
                      "times while probing (or re-checking), except the run's first step + wall of the first locked "
                      "step - (active steps) x locked_step_s (one step out, one in). The first step of a run "
                      "(optimizer state "
                      "initialisation, first touch of the host slabs: first_step_s) is paid with or without a "
                      "tuner and left out",
    "locked_step_s": "median wall time of step() over locked steps 2..L of the same run",
    "share_of_1000_steps": "startup_cost_s / (1000 x locked_step_s)",
    "share_of_1000_iterations": "startup_cost_s / (1000 x (locked_step_s + median forward+backward time))",
    "startup_cost_sweep_ref_s": "startup_cost_s with locked_step_s replaced by the sweep's median step() wall time "
                                "of the winner (more samples, measured at another time)",
    "share_of_1000_steps_sweep_ref": "startup_cost_sweep_ref_s / (1000 x the sweep's median step() wall of the winner)",
    "break_even_steps": "startup_cost_s / (median_sweep(static) - median_sweep(winner)), when positive",
}


# ------------------------------------------------------------------------------------ output
def _ci(d: dict[str, Any]) -> str:
    return f"{d['median']:.3f} [{d['ci'][0]:.3f}, {d['ci'][1]:.3f}]"


def render_text(result: dict[str, Any]) -> str:
    h, a = result["headline"], result["analysis"]
    lines = [f"{'candidate':<26} {'median ms':>10} {'IQR ms':>8} {'n':>3} {'x best':>7}  marks"]
    for row in sorted(a["candidates"], key=lambda r: r["median"]):
        lines.append(f"{row['label']:<26} {row['median'] * _MS:>10.2f} {row['iqr'] * _MS:>8.2f} {row['n']:>3} "
                     f"{row['ratio_to_best']:>7.3f}  {_marks(row)}")
    lines.append(f"regret (rep 0): {h['regret'] * 100:.2f}% (target <= {TARGET_REGRET * 100:.0f}%: "
                 f"{'met' if h['meets_target'] else 'NOT met'}); over {h['reps']} reps: median "
                 f"{h['regret_median'] * 100:.2f}%, max {h['regret_max'] * 100:.2f}%")
    lines.append(f"paired per round: regret (rep 0) {h['regret_paired'] * 100:.2f}%, median "
                 f"{h['regret_paired_median'] * 100:.2f}%, max {h['regret_paired_max'] * 100:.2f}%")
    lines.append(f"never slower than the static plan beyond noise: {h['never_slower_than_static']}")
    lines.append(f"probe steps {h['probe_steps']} of {h['probe_budget']}; probing cost {h['startup_cost_s']:.3f} s = "
                 f"{h['share_of_1000_steps'] * 100:.2f}% of 1000 steps, {h['share_of_1000_iterations'] * 100:.2f}% "
                 "of 1000 iterations")
    lines.append(f"cache-hit run: cache_hit {h['cache_hit']}, probe_steps {h['cache_probe_steps']}, re-check steps "
                 f"{h['cache_check_steps']}, start-up cost {h['cache_startup_cost_s']:.3f} s")
    return "\n".join(lines)


def _marks(row: dict[str, Any]) -> str:
    marks = []
    if row["is_best"]:
        marks.append("best")
    if row["is_static"]:
        marks.append("static plan")
    if row["winner_of_reps"]:
        marks.append("tuner winner (rep " + ", ".join(map(str, row["winner_of_reps"])) + ")")
    return "; ".join(marks)


def render_markdown(result: dict[str, Any]) -> str:
    m, c, h, a = result["machine"], result["config"], result["headline"], result["analysis"]
    cv, w = result["cache_hit_run"], result["workload"]
    grads = (f"the trainer's forward+backward (batch {c['batch_size']}, seq {c['seq_len']}, "
             f"{c['forward_backward_threads']} intra-op threads) before every step" if c["grads"] == "backward"
             else "fixed synthetic gradients (no forward/backward)")
    out = [
        "# Tuner quality: the online tuner vs. an exhaustive sweep",
        "",
        f"- command: `{result['command']}`",
        f"- date (UTC): {m['date_utc']}; duration {result['duration_s']} s",
        f"- CPU: {m['cpu_model']}; {m['physical_cores']} physical cores, {m['logical_cpus']} logical, "
        f"{m['affinity_cpus']} in the affinity mask; {m['memory_gib']} GiB; torch {m['torch']} "
        f"({m['torch_parallel_backend']}); Python {m['python']}",
        _code_text(result.get("code")),
        f"- `uptime` before: `{result['uptime_before']}`",
        f"- `uptime` after: `{result['uptime_after']}`",
        f"- load average (1/5/15 min) at the start and end of each phase: {_loads_text(result)}",
        f"- workload: reference trainer model `{c['model_size']}` {c['dtype']} ({w['params']:,} parameters, the "
        f"trainer's 2 parameter groups), {grads}; objective `StepStats.step_s` (wall time of `step()`)",
        f"- tuner: `AutotuneConfig` defaults ({_config_text(result['autotune_config'])}), a fresh temporary "
        f"cache per repetition, seeds {c['seed']}..{c['seed'] + c['reps'] - 1}",
        f"- sweep: {len(a['candidates'])} candidates x {c['rounds']} interleaved rounds (fresh random order per "
        f"round), each visit 1 discarded warm-up step + {c['per_visit']} measured",
    ]
    if result["note"]:
        out.append(f"- note: {result['note']}")
    out += [
        "",
        "## Headline",
        "",
        f"- **regret {h['regret'] * 100:.2f}%** (repetition 0; target <= {TARGET_REGRET * 100:.0f}%: "
        f"{'met' if h['meets_target'] else 'not met'}): the tuner chose {_label(h['winner'])}, the sweep's best "
        f"is {_label(h['best'])}, the static plan is {_label(h['static_plan'])}.",
        f"- over {h['reps']} repetitions: regret median {h['regret_median'] * 100:.2f}%, max "
        f"{h['regret_max'] * 100:.2f}%, {h['reps_meeting_target']} of {h['reps']} within "
        f"{TARGET_REGRET * 100:.0f}%. Paired per round (drift cancels): regret {h['regret_paired'] * 100:.2f}% "
        f"(rep 0), median {h['regret_paired_median'] * 100:.2f}%, max {h['regret_paired_max'] * 100:.2f}%.",
        f"- never slower than the static plan beyond noise: **{'yes' if h['never_slower_than_static'] else 'NO'}**.",
        f"- probe steps: {h['probe_steps']} of a budget of {h['probe_budget']}; probing wall time (sum of "
        f"`step()` while probing) {h['probe_wall_s']:.2f} s; probing cost with the locked step time taken from "
        f"the sweep (the winner's median over every round) {h['startup_cost_sweep_ref_s']:.3f} s = "
        f"**{h['share_of_1000_steps_sweep_ref'] * 100:.2f}% of a 1000-step run** (optimizer steps only); with the "
        f"run's own few locked steps as the reference instead (exposed to load spikes right after lock-in): "
        f"{h['startup_cost_s']:.3f} s = {h['share_of_1000_steps'] * 100:.2f}% of 1000 steps, "
        f"{h['share_of_1000_iterations'] * 100:.2f}% of 1000 iterations.",
        f"- second run with the same cache: cache_hit **{h['cache_hit']}** ({cv['cache_status']}), probe steps "
        f"**{h['cache_probe_steps']}**, {h['cache_check_steps']} re-check steps; start-up cost "
        f"{h['cache_startup_cost_s']:.3f} s vs {h['startup_cost_s']:.3f} s on the first run.",
        "",
        "## Sweep (all candidates, interleaved)",
        "",
        "Step times in ms. `x best` is the ratio of medians; `paired / best` and `paired / static` are the",
        "per-round ratios (median over rounds, 95% bootstrap interval).",
        "",
        "| candidate | median | IQR | n | x best | paired / best | paired / static | |",
        "|---|---:|---:|---:|---:|---|---|---|",
    ]
    for row in sorted(a["candidates"], key=lambda r: r["median"]):
        out.append(f"| {row['label']} | {row['median'] * _MS:.2f} | {row['iqr'] * _MS:.2f} | {row['n']} | "
                   f"{row['ratio_to_best']:.3f} | {_ci(row['paired_ratio_to_best'])} | "
                   f"{_ci(row['paired_ratio_to_static'])} | {_marks(row)} |")
    out += [
        "",
        "## Tuner repetitions",
        "",
        "| rep | seed | sampler | probe steps | explored | winner | regret | winner / best (paired) | IQRs overlap | "
        "slower than static beyond noise | speedup over static: tuner's claim / sweep (paired) | probing cost s | "
        "share of 1000 steps (sweep ref.) | break-even steps |",
        "|---:|---:|---|---:|---:|---|---:|---|---|---|---|---:|---|---:|",
    ]
    for j in a["reps"]:
        be = f"{j['break_even_steps']:.0f}" if j["break_even_steps"] is not None else "-"
        out.append(f"| {j['rep']} | {j['seed']} | {j['sampler']} | {j['probe_steps']} | {j['explored']} of "
                   f"{j['n_candidates']}{'' if j['best_was_explored'] else ' (best not explored)'} | "
                   f"{j['winner_label']}{' (static plan)' if j['kept_static_plan'] else ''} | "
                   f"{j['regret'] * 100:.2f}% | {_ci(j['paired_ratio_to_best'])} | "
                   f"{'yes' if j['iqr_overlaps_best'] else 'no'} | "
                   f"{'YES' if j['slower_than_static_beyond_noise'] else 'no'} | {_speedups(j)} | "
                   f"{j['startup_cost_s']:.3f} | "
                   f"{j['share_of_1000_steps'] * 100:.2f}% ({j['share_of_1000_steps_sweep_ref'] * 100:.2f}%) | {be} |")
    out += ["", "Each repetition's reason for its decision:", ""]
    out += [f"- rep {j['rep']}: {j['reason']}" for j in a["reps"]]
    over = [j for j in a["reps"] if not j["meets_target"]]
    if over:
        out += ["", "Repetitions over the target, from the data (the paired interval decides noise vs. a real "
                "difference: both were measured in every round):", ""]
        out += [f"- rep {j['rep']}: regret {j['regret'] * 100:.2f}% (paired {j['regret_paired'] * 100:.2f}%): "
                + _explain(j) for j in over]
    f1, f2 = cv["first_run"], cv["second_run"]
    out += [
        "",
        "## Second run: start-up with a cache hit",
        "",
        f"A new optimizer with the same cache file (same fingerprint) right after repetition 0: cache_hit "
        f"{cv['cache_hit']}, probe steps {cv['probe_steps']}, re-check steps {cv['check_steps']}, winner "
        f"{cv['winner_label']} ({'same as' if cv['same_winner_as_first_run'] else 'DIFFERENT from'} the first run). "
        f"`first {cv['k']} steps` compares the second run's steps up to its lock-in with the first run's first "
        f"{cv['k']} (probing) steps."
        + (" The re-check found the cached choice clearly slower than recorded (beyond `recheck_tolerance` and "
           "the noise), so the tuner re-tuned: its probe steps are counted above." if cv["cache_status"] == "stale"
           else ""),
        "",
        "| run | construct s | tuner start s | first step s (state init) | steps to lock | step() wall to lock s | "
        f"first {cv['k']} steps s | start-up cost s | locked step ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, f in (("first (probing)", f1), ("second (cache hit)", f2)):
        out.append(f"| {name} | {f['construct_s']:.3f} | {f['start_overhead_s']:.3f} | {f['first_step_s']:.3f} | "
                   f"{f['steps_to_lock']} | {f['wall_to_lock_s']:.3f} | {f['first_k_wall_s']:.3f} | "
                   f"{f['startup_cost_s']:.3f} | {f['locked_step_s'] * _MS:.2f} |")
    out += ["", "## Definitions", ""]
    out += [f"- {k}: {v}" for k, v in result["definitions"].items()]
    return "\n".join(out) + "\n"


def _explain(j: dict[str, Any]) -> str:
    """Why a repetition missed the target, from its numbers."""
    ci = _ci(j["paired_ratio_to_best"])
    if j["paired_ci_includes_1"]:
        return f"within the noise of this machine: the paired ratio winner/best {ci} includes 1."
    why = f"a real difference: the paired ratio winner/best {ci} excludes 1; "
    if not j["best_was_explored"]:
        return why + f"the tuner never measured the best (it explored {j['explored']} of {j['n_candidates']})."
    if j["kept_static_plan"]:
        return why + f"the tuner measured the best but kept the static plan on its few samples ({j['reason']})."
    return why + f"the tuner measured the best but ranked it behind its winner on its few samples ({j['reason']})."


def _code_text(code: dict[str, Any] | None) -> str:
    if not code or not code.get("commit"):
        return "- code: not recorded"
    return f"- code: commit {code['commit']}; changed since: {', '.join(code['changed']) or 'nothing'}"


def _speedups(j: dict[str, Any]) -> str:
    claimed = j["claimed_speedup"]
    return f"{claimed:.3f}x / {1.0 / j['paired_ratio_to_static']['median']:.3f}x" if claimed else "-"


def _loads_text(result: dict[str, Any]) -> str:
    phases = [("tuner rep 0", result["tuner_runs"][0]), ("cache-hit run", result["second_run"]),
              ("sweep", result["sweep_raw"])]
    phases += [(f"rep {k}", run) for k, run in enumerate(result["tuner_runs"]) if k]
    return "; ".join(f"{name} {run['load_before']} -> {run['load_after']} (CPU capacity used by other processes "
                     f"{run['cpu_use']['others_share'] * 100:.0f}%, by this one "
                     f"{run['cpu_use']['own_share'] * 100:.0f}%)"
                     for name, run in phases)


def _config_text(cfg: dict[str, Any]) -> str:
    keys = ("probe_steps", "warmup_steps", "measure_steps", "finalists", "final_rounds", "min_gain",
            "noise_factor", "tie_tolerance")
    return ", ".join(f"{k}={cfg[k]}" for k in keys)


def _plot(result: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot")
        return None
    rows = sorted(result["analysis"]["candidates"], key=lambda r: r["median"])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for x, row in enumerate(rows):
        color = "tab:green" if row["is_best"] else ("tab:orange" if row["winner_of_reps"] else "tab:gray")
        ax.bar(x, row["median"] * _MS, color=color, hatch="//" if row["is_static"] else None, edgecolor="black")
        spread = [[(row["median"] - row["q25"]) * _MS], [(row["q75"] - row["median"]) * _MS]]
        ax.errorbar(x, row["median"] * _MS, yerr=spread, color="black", capsize=3)
        ax.scatter([x] * row["n"], [s * _MS for s in row["samples_s"]], s=6, color="black", alpha=0.3, zorder=3)
    ax.set_xticks(range(len(rows)), [r["label"].replace(" ", "\n") for r in rows], fontsize=8)
    ax.set_ylabel("step() ms (median, IQR, samples)")
    h = result["headline"]
    ax.set_title(f"green: best; orange: a tuner winner; hatched: static plan. Regret (rep 0) "
                 f"{h['regret'] * 100:.1f}%, max over {h['reps']} reps {h['regret_max'] * 100:.1f}%", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = _resolve(parser, parser.parse_args(argv))
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    run(args, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
