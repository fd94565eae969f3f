"""The real online tuner on this machine under a controlled background load: how far its lock-in is
from the best setting of its own search space, scored right after lock-in under the same load.

    python -m bench.tuner_load --load threads --sessions 20 --out-dir bench/results
    python -m bench.tuner_load --load busy --quick --out-dir runs/tuner_load   # smoke run (tests)

Load (:mod:`bench.tuner_load._load`, started before the first session, stopped in ``finally``, also on
Ctrl-C; with ``--load-starts lock`` started in each session right after its lock-in and stopped
after its scoring: a load that starts mid-run, which only the post-lock watch can follow): ``threads``: ``--load-procs`` processes each running a ``--load-threads``-thread torch
loop without pause; ``bursts``: the same loop busy 30-150 ms, idle 10-60 ms (seeded); ``busy``:
plain Python busy loops; ``none``: nothing.

Sessions, alternated by kind, ``--sessions`` of each; session ``i`` seeds its model, its tuner
(``AutotuneConfig(use_cache=False, seed=--seed + i)``) and its scoring order with ``--seed + i``:

* ``stock``: ``offload.tune_step_threads(torch.optim.AdamW(params, fused=True))``;
* ``offload``: ``offload.CPUOffloadAdamW(params, autotune=...)``.

The model is six ``Linear(1024, 1024)`` layers (6,297,600 fp32 parameters; ``--quick``: width
128, 99,072) with fixed synthetic gradients set once, so a step is only the optimizer's work.
A fresh model and optimizer per session: ``step()`` until the tuner is ``locked`` (at most
``--max-steps``; a session that never locks is recorded and not scored), timing the wall time
of every ``step()`` (the probe steps). The run then goes on for ``--watch-steps`` steps with the
tuner's post-lock watch, which may switch settings (what a training run pays after lock-in); the
latest decision then is the session's *settled* setting. Then every candidate of
``opt.tuner.space.candidates()`` is scored interleaved: ``--rounds`` rounds, each visiting every
candidate once in a fresh seeded random order; a visit is one discarded warm-up step after the switch and ``--per-visit`` measured
steps (wall time of the step). No tuner runs while scoring: the tuned optimizer is closed
before it (its watch would switch settings between the scoring's steps). ``stock`` then
steps ``opt.wrapped`` inside ``offload.thread_limit(threads)``, what the wrapper's ``step()`` runs
with its tuned count (it has no public setter for the count); ``offload`` steps a new
``CPUOffloadAdamW`` without autotune over the same parameters, from the settings in force then,
switched with ``apply_settings``, checking after each step that they are the candidate's.

Per session (definitions also in the JSON): mean and median of each candidate's samples (a run
pays the sum of its steps, so the mean decides); best = smallest mean; lock-in regret =
mean(winner) / mean(best) - 1; whole-run regret of a 2000-step run = (sum of the probe steps' wall
times + (2000 - probe steps) x mean(winner)) / (2000 x mean(best)) - 1 (the first step, which
also initialises the state, is among the probe steps; one untuned step of each kind before the
load keeps the process's one-time costs out of it); ``regret_ci95``: a 95 % bootstrap over scoring
rounds of the regret with the best fixed ("beyond noise" where it is above 0); the settled
setting's regret, and the whole-run regret with the probe and watched steps' real times and the
settled setting after them; the pooled regret (see ``DEFINITIONS``), for loads whose statistics do
not change from session to session. Per kind: max, median, p90 of the regret, sessions above
25 %, median whole-run regret and probe steps, winners; the same for the settled setting.
On the 2-core VM under ``--load threads`` a session took 8-17 s (stock AdamW at 2 threads is 5-7x
slower than at 1 under that load, and scoring visits it 45 times).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import shlex
import time
from collections import Counter
from contextlib import nullcontext
from typing import Any, Callable, Sequence

import torch

from bench._args import OUT_DIR_HELP, HelpFormatter, output_dir
from bench._cli import bench_entry
from bench._stats import machine_info, median, quantile
from bench.tuner_load._load import BackgroundLoad, LoadSpec, add_load_arguments

logger = logging.getLogger("bench.tuner_load")

__all__ = ["KINDS", "RUN_STEPS", "analyse_session", "build_parser", "lock_in_regret", "main", "regret_interval",
           "pooled_means", "run", "summarize", "whole_run_regret"]

KINDS = ("stock", "offload")
#: The run length the whole-run regret charges the probe steps against.
RUN_STEPS = 2000
#: A session whose lock-in regret is above this is counted as a bad lock-in.
BAD_REGRET = 0.25
#: Model shape: LAYERS x Linear(width, width); 1024 -> 6,297,600 parameters, 128 -> 99,072.
LAYERS, WIDTH, QUICK_WIDTH = 6, 1024, 128
LR = 1e-3
BOOTSTRAP_RESAMPLES = 1000
DEFINITIONS = {
    "samples": "wall time of one step() (s), measured steps of a scoring visit only",
    "mean_s": "mean of a candidate's samples (a run pays the sum of its steps)",
    "best": "the candidate with the smallest mean_s",
    "regret": "mean_s(winner) / mean_s(best) - 1",
    "whole_run_regret": f"(sum of the probe steps' wall times + ({RUN_STEPS} - probe steps) x mean_s(winner)) "
                        f"/ ({RUN_STEPS} x mean_s(best)) - 1",
    "regret_ci95": "95 % percentile bootstrap over scoring rounds of mean(winner) / mean(best) - 1, best fixed",
    "probe_steps": "step() calls before the tuner was locked (its summary's probe_steps is stored too)",
    "settled": "the latest decision after --watch-steps more steps with the post-lock watch (its switches)",
    "settled_regret": "mean_s(settled) / mean_s(best) - 1",
    "whole_run_regret_watched": f"(sum of the probe and watched steps' wall times + ({RUN_STEPS} - those steps) x "
                                f"mean_s(settled)) / ({RUN_STEPS} x mean_s(best)) - 1: the watch's rounds "
                                "and switches as the run paid them",
    "pooled_regret": "pooled_mean(winner) / min over candidates of pooled_mean - 1, where a candidate's "
                     "pooled_mean is the mean of its mean_s over every scored session of the kind: the "
                     "sessions' scoring rounds together (15 x sessions), for a load whose statistics do not "
                     "change over the run (threads, bursts, busy, none); a session's own scores cannot tell "
                     "settings apart by less than their noise, and its best is picked on the same noise "
                     "(under bursts two chunk sizes of one thread count scored 25-43 % apart)",
    "scoring_floor": "per session, mean_s(pooled best) / mean_s(best) - 1: the regret a tuner that always "
                     "locked the pooled best would score; its median and max are what the session scores "
                     "can resolve (under bursts, 15 rounds: a median of 3.2 % and a max of 23.5 % for "
                     "CPUOffloadAdamW's 6 settings)",
}


# ------------------------------------------------------------------------------------ arithmetic
def lock_in_regret(winner_mean: float, best_mean: float) -> float:
    if not best_mean > 0:
        raise ValueError(f"best_mean={best_mean!r}: expected a positive number of seconds")
    return winner_mean / best_mean - 1.0


def whole_run_regret(probe_walls: Sequence[float], winner_mean: float, best_mean: float,
                     run_steps: int = RUN_STEPS) -> float:
    if len(probe_walls) > run_steps:
        raise ValueError(f"{len(probe_walls)} probe steps: expected at most run_steps={run_steps}")
    tuned_mean = (sum(probe_walls) + (run_steps - len(probe_walls)) * winner_mean) / run_steps
    return lock_in_regret(tuned_mean, best_mean)


def regret_interval(winner_rounds: Sequence[Sequence[float]], best_rounds: Sequence[Sequence[float]], *,
                    seed: int = 0) -> tuple[float, float]:
    """95 % percentile bootstrap, over scoring rounds, of mean(winner) / mean(best) - 1 with the best
    fixed (below 0 where the winner may be the faster): is a regret more than scoring noise?"""
    rng, n, values = random.Random(seed), len(winner_rounds), []
    for _ in range(BOOTSTRAP_RESAMPLES):
        rounds = [rng.randrange(n) for _ in range(n)]
        w = [x for r in rounds for x in winner_rounds[r]]
        b = [x for r in rounds for x in best_rounds[r]]
        values.append((sum(w) / len(w)) / (sum(b) / len(b)) - 1.0)
    return quantile(values, 0.025), quantile(values, 0.975)


def label(setting: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in setting.items())


def analyse_session(candidates: Sequence[dict[str, Any]], samples_s: Sequence[Sequence[Sequence[float]]],
                    winner: dict[str, Any], probe_walls: Sequence[float], *, settled: dict[str, Any] | None = None,
                    watch_walls: Sequence[float] = ()) -> dict[str, Any]:
    """Scores of one session from its raw samples (``samples_s[candidate][round]`` lists):
    ``winner`` locked in after ``probe_walls``; ``settled`` followed after ``watch_walls`` more
    steps with the watch (default: the winner, no watched steps)."""
    flat = [[x for visit in rounds for x in visit] for rounds in samples_s]
    if any(not xs for xs in flat):
        raise ValueError("analyse_session: a candidate has no samples: expected every candidate scored")
    means = [sum(xs) / len(xs) for xs in flat]
    w = list(candidates).index(winner)
    f = list(candidates).index(settled if settled is not None else winner)
    b = min(range(len(means)), key=means.__getitem__)
    return {
        "settled_index": f,
        "settled_regret": lock_in_regret(means[f], means[b]),
        "whole_run_regret_watched": whole_run_regret(list(probe_walls) + list(watch_walls), means[f], means[b]),
        "candidate_mean_s": means,
        "candidate_median_s": [median(xs) for xs in flat],
        "winner_index": w,
        "best_index": b,
        "best": dict(candidates[b]),
        "regret": lock_in_regret(means[w], means[b]),
        "whole_run_regret": whole_run_regret(probe_walls, means[w], means[b]),
        "regret_ci95": regret_interval(samples_s[w], samples_s[b]),
    }


def pooled_means(scored: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per candidate label, the mean of its session means over ``scored`` sessions of one kind."""
    totals: dict[str, list[float]] = {}
    for s in scored:
        for candidate, mean in zip(s["candidates"], s["score"]["candidate_mean_s"]):
            totals.setdefault(label(candidate), []).append(mean)
    return {k: sum(v) / len(v) for k, v in totals.items()}


def summarize(sessions: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind: the figures of the report (scored sessions only; never-locked ones counted); writes
    each scored session's ``pooled_regret`` into its score (it needs every session of the kind)."""
    out = {}
    for kind in dict.fromkeys(s["kind"] for s in sessions):
        mine = [s for s in sessions if s["kind"] == kind]
        scored = [s for s in mine if s.get("score")]
        regrets = [s["score"]["regret"] for s in scored]
        pooled = pooled_means(scored)
        pooled_best = min(pooled.values(), default=float("nan"))
        for s in scored:
            s["score"]["pooled_regret"] = lock_in_regret(pooled[label(s["winner"])], pooled_best)
        pooled_regrets = [s["score"]["pooled_regret"] for s in scored]
        pooled_best_label = min(pooled, key=pooled.__getitem__, default=None)
        floor = []  # the pooled best scored session by session (see DEFINITIONS["scoring_floor"])
        for s in scored:
            means = dict(zip(map(label, s["candidates"]), s["score"]["candidate_mean_s"]))
            floor.append(lock_in_regret(means[pooled_best_label], min(means.values())))
        out[kind] = {
            "sessions": len(mine),
            "never_locked": sum(not s["locked"] for s in mine),
            "scored": len(scored),
            "max_regret": max(regrets, default=float("nan")),
            "median_regret": median(regrets),
            "p90_regret": quantile(regrets, 0.9),
            "above_bad_regret": sum(r > BAD_REGRET for r in regrets),
            "beyond_noise": sum(s["score"]["regret_ci95"][0] > 0 for s in scored),
            "max_settled_regret": max((s["score"]["settled_regret"] for s in scored), default=float("nan")),
            "above_bad_settled_regret": sum(s["score"]["settled_regret"] > BAD_REGRET for s in scored),
            "median_whole_run_regret_watched": median([s["score"]["whole_run_regret_watched"] for s in scored]),
            "sessions_with_switches": sum(bool(s.get("switches")) for s in scored),
            "median_first_switch_step": median([s["first_switch_step"] for s in scored
                                                if s.get("first_switch_step") is not None]),
            "pooled_means_s": pooled,
            "max_pooled_regret": max(pooled_regrets, default=float("nan")),
            "above_bad_pooled_regret": sum(r > BAD_REGRET for r in pooled_regrets),
            "median_scoring_floor": median(floor),
            "max_scoring_floor": max(floor, default=float("nan")),
            "median_whole_run_regret": median([s["score"]["whole_run_regret"] for s in scored]),
            "median_probe_steps": median([s["probe_steps"] for s in mine if s["locked"]]),
            "winners": dict(Counter(label(s["winner"]) for s in mine if s["locked"]).most_common()),
            "median_session_s": median([s["session_s"] for s in mine]),
            "space_size": mine[0]["space_size"],
        }
    return out


# ------------------------------------------------------------------------------------ optimizers
def make_params(width: int, seed: int) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    params = list(torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(LAYERS)]).parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    return params


def make_tuned(kind: str, params: list[torch.nn.Parameter], config: Any) -> Any:
    """The optimizer whose ``tuner`` is measured (``step()`` tunes; ``close()`` ends the tuner)."""
    from offload import CPUOffloadAdamW, tune_step_threads

    if kind == "stock":
        return tune_step_threads(torch.optim.AdamW(params, lr=LR, fused=True), autotune=config)
    return CPUOffloadAdamW(params, lr=LR, autotune=config)


def make_scorer(kind: str, tuned: Any, params: list[torch.nn.Parameter]
                ) -> tuple[Callable[[dict[str, Any]], None], Callable[[], None]]:
    """``(step_as(setting), close)`` for the scoring, with no tuner in the step: ``tuned`` is closed.

    ``stock``: the wrapped AdamW under ``thread_limit(threads)``, what the wrapper's ``step()`` runs.
    ``offload``: a ``CPUOffloadAdamW`` without autotune over the same parameters, from the settings
    in force at lock-in, switched with ``apply_settings``.
    """
    from offload import CPUOffloadAdamW, thread_limit

    if kind == "stock":
        tuned.close()

        def stock_as(setting: dict[str, Any]) -> None:
            with thread_limit(int(setting["threads"])):
                tuned.wrapped.step()

        return stock_as, lambda: None
    settings = tuned.settings
    tuned.close()
    opt = CPUOffloadAdamW(params, lr=LR, settings=settings)

    def offload_as(setting: dict[str, Any]) -> None:  # every knob of the space is an OffloadSettings field
        if any(getattr(opt.settings, k) != v for k, v in setting.items()):
            opt.apply_settings(dataclasses.replace(opt.settings, **setting))
        opt.step()
        ran = {k: getattr(opt.settings, k) for k in setting}
        if ran != setting:
            raise RuntimeError(f"asked for {setting}, the step ran with {ran}")

    return offload_as, opt.close


# ------------------------------------------------------------------------------------ one session
def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def score(step_as: Callable[[dict[str, Any]], None], candidates: Sequence[dict[str, Any]], *, rounds: int, per_visit: int,
          seed: int) -> dict[str, Any]:
    """Every candidate interleaved: fresh random order per round, 1 discarded + ``per_visit`` steps a visit."""
    rng = random.Random(seed)
    samples: list[list[list[float]]] = [[] for _ in candidates]
    orders = []
    for _ in range(rounds):
        order = list(range(len(candidates)))
        rng.shuffle(order)
        orders.append(order)
        for i in order:
            step_as(candidates[i])  # warm-up after the switch, discarded
            samples[i].append([_timed(lambda: step_as(candidates[i])) for _ in range(per_visit)])
    return {"orders": orders, "samples_s": samples}


def run_session(kind: str, seed: int, args: argparse.Namespace, load_at_lock: LoadSpec | None = None) -> dict[str, Any]:
    """One session; ``load_at_lock``: a load started right after the lock-in (its workers ready
    before the first watched step) and stopped after the scoring."""
    from autotune import AutotuneConfig

    began = time.perf_counter()
    load_before = [round(x, 2) for x in os.getloadavg()]
    params = make_params(args.width, seed)
    opt = make_tuned(kind, params, AutotuneConfig(use_cache=False, seed=seed))
    close_scorer: Callable[[], None] = lambda: None
    try:
        tuner = opt.tuner
        walls: list[float] = []
        while tuner.state not in ("locked", "failed") and len(walls) < args.max_steps:
            walls.append(_timed(opt.step))
        summary = tuner.summary()
        candidates = [dict(c) for c in tuner.space.candidates()]
        rec: dict[str, Any] = {
            "kind": kind, "seed": seed, "locked": summary["state"] == "locked", "state": summary["state"],
            "winner": summary["winner"], "baseline": summary["baseline"], "probe_steps": len(walls),
            "summary_probe_steps": summary["probe_steps"], "probe_walls_s": walls, "tuning_s": sum(walls),
            "candidates": candidates, "space_size": len(candidates), "reason": summary.get("reason")}
        if rec["locked"]:
            if summary["winner"] not in candidates:
                raise RuntimeError(f"{kind}: winner {summary['winner']} is not in the space {candidates}")
            # The run goes on with the post-lock watch for --watch-steps steps (its rounds and
            # switches included, as a training run pays them); then the setting it follows is scored.
            with BackgroundLoad(load_at_lock) if load_at_lock is not None else nullcontext() as load:
                rec["load_pids_at_lock"] = list(load.pids) if load is not None else None
                watched, first_switch = [], None
                for i in range(args.watch_steps):
                    watched.append(_timed(opt.step))
                    if first_switch is None and tuner.summary()["switches"]:
                        first_switch = i + 1
                after = tuner.summary()
                rec.update(watch_walls_s=watched, settled=after["winner"], switches=after["switches"],
                           watch_rounds_steps=after["watch_steps"], first_switch_step=first_switch)
                step_as, close_scorer = make_scorer(kind, opt, params)  # closes opt: no tuner from here on
                t0 = time.perf_counter()
                raw = score(step_as, candidates, rounds=args.rounds, per_visit=args.per_visit, seed=seed)
                rec.update(raw, scoring_s=time.perf_counter() - t0)
            rec["score"] = analyse_session(candidates, raw["samples_s"], summary["winner"], walls,
                                           settled=after["winner"], watch_walls=watched)
    finally:
        close_scorer()
        opt.close()  # idempotent
    rec.update(session_s=time.perf_counter() - began, load_before=load_before,
               load_after=[round(x, 2) for x in os.getloadavg()])
    s = rec.get("score")
    logger.info("%s seed %d: %s %s after %d steps; %s (%.1f s)", kind, seed, rec["state"], rec["winner"],
                rec["probe_steps"], f"regret {s['regret']:.1%}, best {label(s['best'])}" if s else "not scored",
                rec["session_s"])
    return rec


# ------------------------------------------------------------------------------------ report
def _pct(x: float) -> str:
    return "-" if x != x else f"{x:.1%}"


def render_markdown(result: dict[str, Any]) -> str:
    m, cfg = result["machine"], result["config"]
    lines = [
        f"# Tuner under load: {result['load']['description']}"
        + (", starting at each session's lock-in" if cfg.get("load_starts") == "lock" else ""), "",
        f"Command: `{result['command']}`", "",
        f"Machine: {m['cpu_model']}, {m['affinity_cpus']} CPUs in the affinity mask, torch {m['torch']}, "
        f"{m['date_utc']}; {cfg['params']:,} fp32 parameters ({LAYERS} x Linear({cfg['width']}, {cfg['width']})), "
        f"fixed synthetic gradients; {result['duration_s']:.0f} s in all.", "",
        f"How: per session a fresh model and optimizer step until the tuner locks (at most {cfg['max_steps']} "
        f"steps); then every candidate of its space is scored right away under the same load, {cfg['rounds']} "
        f"interleaved rounds in seeded random orders, per visit 1 discarded + {cfg['per_visit']} measured "
        "steps (wall time of `step()`). Regret = mean(winner) / mean(best) - 1; whole-run = a "
        f"{RUN_STEPS}-step run with the probe steps' real times against {RUN_STEPS} steps at the best. "
        f"Between lock-in and scoring the run goes on for {cfg['watch_steps']} steps with the post-lock watch: "
        "settled = the setting it follows then (after its switches), whole-run watched = the same run "
        "with those steps' real times and the settled setting after them.", "",
        f"| kind | space | sessions | never locked | max regret | median | p90 | > {BAD_REGRET:.0%} | "
        "beyond noise | max pooled regret | median whole-run regret | median probe steps | median s / session "
        "| winners |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for kind, k in result["summary"].items():
        winners = "; ".join(f"{w}: {n}" for w, n in k["winners"].items())
        lines.append(f"| {kind} | {k['space_size']} | {k['sessions']} | {k['never_locked']} | "
                     f"{_pct(k['max_regret'])} | {_pct(k['median_regret'])} | {_pct(k['p90_regret'])} | "
                     f"{k['above_bad_regret']} | {k['beyond_noise']} | {_pct(k['max_pooled_regret'])} | "
                     f"{_pct(k['median_whole_run_regret'])} | "
                     f"{k['median_probe_steps']} | {k['median_session_s']:.1f} | {winners} |")
    if cfg.get("load_starts") == "lock":
        lines[-1] += (" The load started in each session right after its lock-in (the probe steps ran "
                      "unloaded) and stopped after its scoring: the watched steps and the scoring ran under it.")
    lines += ["", f"| kind | max settled regret | settled > {BAD_REGRET:.0%} | sessions that switched | "
              "median watched steps to the first switch | median whole-run regret, watched |",
              "|---|---:|---:|---:|---:|---:|"]
    for kind, k in result["summary"].items():
        lines.append(f"| {kind} | {_pct(k['max_settled_regret'])} | {k['above_bad_settled_regret']} | "
                     f"{k['sessions_with_switches']} | {k.get('median_first_switch_step', float('nan'))} | "
                     f"{_pct(k['median_whole_run_regret_watched'])} |")
    lines += ["", "Beyond noise: sessions whose regret interval (95 % bootstrap over scoring rounds) is above 0. "
              "Pooled regret: the winner's mean over every session's scoring rounds against the best such "
              "mean (the load's statistics do not change from session to session): "]
    lines[-1] += "; ".join(
        f"{kind}: " + ", ".join(f"{c} {v * 1e3:.2f} ms" for c, v in sorted(k["pooled_means_s"].items(),
                                                                           key=lambda cv: cv[1]))
        for kind, k in result["summary"].items()) + "."
    lines[-1] += (" Scoring floor: the regret the pooled best itself scores session by session, what a tuner "
                  "that always locked it would show (median / max): " + "; ".join(
                      f"{kind}: {_pct(k['median_scoring_floor'])} / {_pct(k['max_scoring_floor'])}"
                      for kind, k in result["summary"].items()) + ".")
    lines += ["",
              "| kind | seed | winner | best | regret (95 % interval) | whole-run | settled (regret) | "
              "whole-run watched | probe steps | load before | s |",
              "|---|---:|---|---|---:|---:|---|---:|---:|---|---:|"]
    nan = float("nan")
    for s in result["sessions"]:
        sc = s.get("score") or {}
        lo, hi = sc.get("regret_ci95", (nan, nan))
        lines.append(f"| {s['kind']} | {s['seed']} | {label(s['winner'] or {})} | {label(sc.get('best', {}))} | "
                     f"{_pct(sc.get('regret', nan))} ({_pct(lo)} to {_pct(hi)}) | "
                     f"{_pct(sc.get('whole_run_regret', nan))} | "
                     f"{label(s.get('settled') or {})} ({_pct(sc.get('settled_regret', nan))}) | "
                     f"{_pct(sc.get('whole_run_regret_watched', nan))} | "
                     f"{s['probe_steps']} | {s['load_before'][0]} | "
                     f"{s['session_s']:.1f} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ command line
def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds) or len(set(kinds)) != len(kinds):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct comma-separated kinds of {KINDS}")
    return kinds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.tuner_load", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    add_load_arguments(p, default="none")
    p.add_argument("--load-starts", choices=("start", "lock"), default="start",
                   help="when the load starts: before the first session, or in each session right after "
                        "its lock-in (stopped after its scoring: a load that starts mid-run)")
    p.add_argument("--sessions", type=int, default=None, help="sessions per kind (default 20; 2 quick)")
    p.add_argument("--kinds", type=_kinds, default=list(KINDS), help="session kinds, alternated")
    p.add_argument("--rounds", type=int, default=None, help="interleaved scoring rounds (default 15; 3 quick)")
    p.add_argument("--per-visit", type=int, default=2, help="measured steps per scoring visit, after one discarded")
    p.add_argument("--max-steps", type=int, default=200, help="steps a session may take to lock")
    p.add_argument("--watch-steps", type=int, default=None,
                   help="steps run after lock-in with the post-lock watch before scoring (default 200; 4 quick)")
    p.add_argument("--seed", type=int, default=0, help="session i seeds model, tuner and order with seed + i")
    p.add_argument("--quick", action="store_true", help="smoke run: 99,072 parameters, 2 sessions per kind, 3 rounds")
    p.add_argument("--out-dir", type=output_dir, default=None, help=OUT_DIR_HELP)
    p.add_argument("--name", default=None, help="result file stem (default tuner_load-<load>, -quick appended "
                                                "with --quick)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="logging level (stderr)")
    return p


def _resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    q = args.quick
    args.sessions = args.sessions if args.sessions is not None else (2 if q else 20)
    args.rounds = args.rounds if args.rounds is not None else (3 if q else 15)
    args.watch_steps = args.watch_steps if args.watch_steps is not None else (4 if q else 200)
    args.width = QUICK_WIDTH if q else WIDTH
    args.name = args.name or (f"tuner_load-{args.load}" + ("-at-lock" if args.load_starts == "lock" else "")
                               + ("-quick" if q else ""))
    for flag, value, lo in (("--sessions", args.sessions, 1), ("--rounds", args.rounds, 1),
                            ("--per-visit", args.per_visit, 1), ("--max-steps", args.max_steps, 1),
                            ("--load-procs", args.load_procs, 1), ("--load-threads", args.load_threads, 1),
                            ("--seed", args.seed, 0), ("--watch-steps", args.watch_steps, 0)):
        if value < lo:
            p.error(f"{flag} {value}: expected an integer >= {lo}")


def _warm_up() -> None:
    """One untuned step of each kind on a small model, before the load: the process's one-time
    costs (torch._dynamo's import by torch's Optimizer, loading the native kernel) stay out of the
    first session's probe steps."""
    from offload import CPUOffloadAdamW, tune_step_threads

    opt = tune_step_threads(torch.optim.AdamW(make_params(QUICK_WIDTH, 0), lr=LR, fused=True), autotune=False)
    opt.step()
    opt.close()
    offload = CPUOffloadAdamW(make_params(QUICK_WIDTH, 0), lr=LR)
    offload.step()
    offload.close()


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    from offload import plan_cpu_threads

    started = time.perf_counter()
    plan = plan_cpu_threads()
    _warm_up()
    spec = LoadSpec(kind=args.load, procs=args.load_procs, threads=args.load_threads, seed=args.seed)
    sessions = []
    at_lock = args.load_starts == "lock"
    with BackgroundLoad(dataclasses.replace(spec, kind="none") if at_lock else spec) as load:
        for i in range(args.sessions):
            for kind in args.kinds:
                sessions.append(run_session(kind, args.seed + i, args, load_at_lock=spec if at_lock else None))
    params = sum(p.numel() for p in make_params(args.width, 0))
    return {
        "benchmark": "bench.tuner_load",
        "command": "python -m bench.tuner_load " + " ".join(shlex.quote(a) for a in argv),
        "machine": machine_info(),
        "load": {**dataclasses.asdict(spec), "description": spec.describe(), "pids": load.pids},
        "config": {"kinds": args.kinds, "sessions_per_kind": args.sessions, "rounds": args.rounds,
                   "per_visit": args.per_visit, "max_steps": args.max_steps, "watch_steps": args.watch_steps,
                   "load_starts": args.load_starts,
                   "seed": args.seed, "quick": args.quick,
                   "width": args.width, "layers": LAYERS, "params": params, "lr": LR, "run_steps": RUN_STEPS,
                   "plan_threads": plan.threads, "plan_reason": plan.reason},
        "definitions": DEFINITIONS,
        "duration_s": time.perf_counter() - started,
        "summary": summarize(sessions),
        "sessions": sessions,
    }


main = bench_entry(build_parser=build_parser, run=run, resolve=_resolve, render_markdown=render_markdown)
