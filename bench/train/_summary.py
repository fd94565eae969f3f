"""What the reference trainer reports: the per-step line, the run summary (a JSON-able dict) and
its printed form.

Kept apart from :mod:`bench.train` (argument handling, model, loop) so that the loop stays
readable and under the module size limit; nothing here touches the model or the optimizer's
state, it only reads ``opt.last_stats`` / ``opt.tuner`` and the loop's measurements.

The speculation commit rate (``--overlap-backward``) is the sum over the run's steps of
``StepStats.committed_chunks`` over the sum of ``StepStats.speculated_chunks``: a chunk started
during backward and committed as it was is overlap that paid off; one redone in ``step()`` (a
gradient, hyper-parameter, clip coefficient or grad scale changed after it started) cost its
work twice. ``None`` ("n/a") where nothing was speculated (no overlap, or the stock optimizer).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from bench._stats import iqr, median

__all__ = ["STAGES", "SpeculationTally", "build_summary", "format_step", "locked_setting", "opt_knobs",
           "plot_note", "print_summary", "stats_dict", "step_legend", "tuner_summary"]

#: StepStats fields summarised per step (seconds).
STAGES = ("step_s", "d2h_s", "adam_kernel_s", "materialize_s", "drain_s")


class SpeculationTally:
    """Running sums of ``StepStats.speculated_chunks`` / ``committed_chunks`` over a run."""

    __slots__ = ("speculated", "committed")

    def __init__(self) -> None:
        self.speculated = 0
        self.committed = 0

    def add(self, opt: torch.optim.Optimizer) -> tuple[int, int] | None:
        """Count the optimizer's last step; its (committed, speculated) chunks, ``None`` for an
        optimizer without ``last_stats`` (the stock one)."""
        stats = getattr(opt, "last_stats", None)
        if stats is None:
            return None
        step = (int(stats.committed_chunks), int(stats.speculated_chunks))
        self.committed += step[0]
        self.speculated += step[1]
        return step

    @property
    def rate(self) -> float | None:
        """committed / speculated, ``None`` when no chunk was speculated."""
        return self.committed / self.speculated if self.speculated else None


def stats_dict(opt: torch.optim.Optimizer) -> dict[str, float] | None:
    stats = getattr(opt, "last_stats", None)
    if stats is None:
        return None
    return {name: float(getattr(stats, name)) for name in STAGES}


def opt_knobs(opt: torch.optim.Optimizer) -> tuple[int, int | None]:
    """(threads, chunk_numel) the optimizer used in its last step."""
    stats = getattr(opt, "last_stats", None)
    if stats is not None:
        return int(stats.threads), int(stats.chunk_numel)
    return getattr(opt, "threads", None) or torch.get_num_threads(), None  # tune_step_threads: its step's


def tuner_summary(opt: torch.optim.Optimizer) -> dict[str, Any]:
    tuner = getattr(opt, "tuner", None)
    if tuner is None:
        return {"state": "off", "cache_hit": None, "probe_steps": None, "baseline": None, "winner": None}
    summary = dict(tuner.summary())
    for key in ("state", "cache_hit", "probe_steps", "baseline", "winner"):
        summary.setdefault(key, None)
    return summary


def step_legend(offloaded: bool) -> str:
    """What the step line's figures are, printed once before the first step line: two wall times
    of the trainer's (``step_s`` and ``opt_s`` in the summary JSON) and, for the offloaded
    optimizer, its own ``StepStats`` (``opt_stats_median``)."""
    lines = [
        "per step: step = wall time of the whole training step (forward, backward, gradient averaging, "
        "clip + optimizer step, loss averaging)",
        "  opt = the trainer's wall time of clip + opt.step() alone, with GradScaler's unscale/step/update, "
        "the tuner's work after the step and the device sync",
    ]
    if offloaded:
        lines += [
            "  (...) = the optimizer's own StepStats: step() = StepStats.step_s, from the call of step() to its "
            "return (no clip, no tuner)",
            "  d2h/adam/mat/drain = its stage times summed over chunks (they overlap: their sum may exceed step())",
        ]
    lines.append("  threads/chunk = the setting that step ran with (a tuner's lock-in applies from the next step)")
    return "\n".join(lines)


def locked_setting(opt: torch.optim.Optimizer, was_locked: bool) -> tuple[dict[str, Any] | None, bool]:
    """``(setting, locked)``: the setting the optimizer's tuner locked in during the last step
    (what the next steps run; None if it did not lock in then) and whether it is locked now."""
    tuner = getattr(opt, "tuner", None)
    locked = tuner is not None and tuner.state == "locked"
    return (dict(tuner.current) if locked and not was_locked else None), locked


def _setting_text(setting: dict[str, Any]) -> str:
    return " ".join(f"{'chunk' if k == 'chunk_numel' else k} {v}" for k, v in setting.items())


def _rate_text(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate * 100:.1f}%"


def format_step(step: int, steps: int, loss: float, step_s: float, opt_s: float,
                stats: dict[str, float] | None, knobs: tuple[int, int | None],
                grad_norm: float | None = None, commit: tuple[int, int] | None = None,
                locked: dict[str, Any] | None = None) -> str:
    """One step's line (its figures: :func:`step_legend`). ``knobs``: the (threads, chunk_numel)
    this step ran with; ``commit``: (committed, speculated) chunks of this step, shown when any
    chunk was speculated; ``grad_norm``: the total norm the clip measured; ``locked``: the setting
    the tuner locked in during this step, which the next steps run (:func:`locked_setting`)."""
    line = f"step {step:>4}/{steps} | loss {loss:8.4f} | step {step_s * 1e3:9.1f} ms | opt {opt_s * 1e3:8.1f} ms"
    if stats is not None:
        line += (
            f" (d2h {stats['d2h_s'] * 1e3:.1f} adam {stats['adam_kernel_s'] * 1e3:.1f}"
            f" mat {stats['materialize_s'] * 1e3:.1f} drain {stats['drain_s'] * 1e3:.1f}"
            f" step() {stats['step_s'] * 1e3:.1f})"
        )
    line += f" | threads {knobs[0]} chunk {knobs[1] if knobs[1] is not None else '-'}"
    if grad_norm is not None:
        line += f" | gnorm {grad_norm:.4g}"
    if commit is not None and commit[1]:
        line += f" | commit {commit[0]}/{commit[1]}"
    if locked is not None:
        line += f" | tuner locked in {_setting_text(locked)}: from the next step"
    return line


def plot_note(run_dir: Path | None, autotune: bool) -> str | None:
    """Why this run has no tuning.png, when it should have one."""
    if run_dir is None or not autotune:
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (f"no {run_dir}/tuning.png: matplotlib is not installed "
                "(pip install -c constraints.txt -e '.[plot]', or python -m autotune plot later)")
    return None


def build_summary(args: argparse.Namespace, info: Any, device: torch.device, n_params: int, seq_len: int,
                  opt: torch.optim.Optimizer, ranks: list[dict[str, Any]], losses: Sequence[float],
                  step_times: Sequence[float], opt_times: Sequence[float],
                  stats_rows: Sequence[dict[str, float]], *, grad_norms: Sequence[float] = (),
                  speculation: SpeculationTally | None = None,
                  skipped_steps: int | None = None) -> dict[str, Any]:
    """The run summary every rank returns (rank 0 prints and writes it). ``grad_norms``: the
    total norm the clip measured at each step (empty without clipping)."""
    # The first step pays one-off costs (allocation, state init, lazy kernels): it is kept in
    # step_times_s but left out of the medians when there is more than one step.
    skip = 1 if len(step_times) > 1 else 0
    measured = list(step_times[skip:])
    opt_stats_median = None
    if stats_rows:
        rows = stats_rows[skip:] if len(stats_rows) > 1 else stats_rows
        opt_stats_median = {name: median([r[name] for r in rows]) for name in STAGES}
    speculation = speculation or SpeculationTally()
    return {
        "ranks": ranks,
        "tuner": tuner_summary(opt),
        "step_s_median": median(measured),
        "step_s_iqr": iqr(measured),
        "opt_s_median": median(opt_times[skip:]),
        "opt_s_iqr": iqr(opt_times[skip:]),
        "steps_measured": len(measured),
        "step_times_s": list(step_times),
        "opt_times_s": list(opt_times),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "losses": list(losses),
        "params": n_params,
        "model_size": args.model_size,
        "dtype": args.dtype,
        "device": str(device),
        "world_size": info.world_size,
        "backend": info.backend,
        "optimizer": "CPUOffloadAdamW" if args.optim_cpu_offload else "torch.optim.AdamW(fused=True)"
                     + (" + tune_step_threads" if hasattr(opt, "wrapped") else ""),
        "fsdp_cpu_offload": bool(args.fsdp_cpu_offload),
        "overlap_backward": bool(args.overlap_backward),
        "optim_state_dtype": getattr(args, "optim_state_dtype", "fp32"),
        "optim_state_rounding": getattr(args, "optim_state_rounding", "nearest"),
        "fsdp": bool(args.fsdp),
        "fsdp_param_dtype": args.fsdp_param_dtype,
        "clip_grad_norm": getattr(args, "clip_grad_norm", None),
        "grad_norm_last": grad_norms[-1] if grad_norms else None,
        "grad_norms": list(grad_norms),
        "amp": getattr(args, "amp", None),
        "amp_skipped_steps": skipped_steps,
        "speculated_chunks": speculation.speculated,
        "committed_chunks": speculation.committed,
        "commit_rate": speculation.rate,
        "opt_stats_median": opt_stats_median,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": seq_len,
        "grad_accum": args.grad_accum,
        "seed": args.seed,
        "lr": args.lr,
        "torch": torch.__version__,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def print_summary(s: dict[str, Any]) -> None:
    print(f"summary: {s['params']:,} params {s['dtype']} on {s['device']} x{s['world_size']} | "
          f"step median {s['step_s_median'] * 1e3:.1f} ms IQR {s['step_s_iqr'] * 1e3:.1f} ms "
          f"(n={s['steps_measured']}) | opt median {s['opt_s_median'] * 1e3:.1f} ms | "
          f"loss {s['loss_first']:.4f} -> {s['loss_last']:.4f}", flush=True)
    norm = s.get("grad_norm_last")
    clip = f"clip {s['clip_grad_norm']:g} grad norm (last step) {norm:.6g}" if norm is not None else "clip off"
    amp = f"amp {s['amp']} (skipped steps {s['amp_skipped_steps']})" if s.get("amp") else "amp off"
    print(f"{clip} | {amp} | speculation commit rate {_rate_text(s.get('commit_rate'))} "
          f"({s.get('committed_chunks', 0)}/{s.get('speculated_chunks', 0)} chunks)", flush=True)
    med = s["opt_stats_median"]
    if med:
        print("StepStats medians: " + " ".join(f"{'step()' if k == 'step_s' else k[:-2]} {v * 1e3:.1f} ms"
                                             for k, v in med.items()), flush=True)
    t = s["tuner"]
    if t["state"] == "off":
        print("tuner: off", flush=True)
    else:
        print(f"tuner: state {t['state']} cache_hit {t['cache_hit']} probe_steps {t['probe_steps']} "
              f"baseline {t['baseline']} winner {t['winner']}", flush=True)
    for r in s["ranks"]:
        chunk = r["chunk_numel"] if r["chunk_numel"] is not None else "n/a (stock optimizer)"
        print(f"rank {r['rank']}: threads {r['threads']} chunk {chunk} compute_threads "
              f"{r['compute_threads']} params sha256 {r['param_sha256'][:16]}", flush=True)
