"""Reference trainer: a small GPT on synthetic tokens, with the CPU-offloaded AdamW or torch's AdamW.

    python -m bench.train --optim-cpu-offload --model-size small --steps 20
    python -m bench.train --optim-cpu-offload --autotune --steps 60 --trace-dir runs/x
    torchrun --nproc-per-node 2 -m bench.train --optim-cpu-offload --device cpu --steps 10
    torchrun --nproc-per-node 2 -m bench.train --fsdp --optim-cpu-offload --overlap-backward --autotune
    torchrun --nproc-per-node 2 -m bench.train --fsdp --fsdp-cpu-offload --autotune --device cpu
    python -m bench.train --optim-cpu-offload --overlap-backward --clip-grad-norm 1.0 --amp fp16

``--clip-grad-norm X`` clips before each step (``opt.clip_grad_norm_(X)`` with the offloaded
optimizer: the coefficient is applied inside its kernel; else ``torch.nn.utils.clip_grad_norm_``);
``--amp fp16`` runs forward under fp16 autocast with a ``torch.amp.GradScaler`` (unscaled before
the clip). The summary gives the last step's total gradient norm and, with overlap, the share of
the chunks started during backward that were committed (:mod:`bench.train._summary`).

Rank 0 prints one line per step (loss, step wall time, the optimizer's stage times) and a final
summary, and writes ``--summary-json`` once, atomically. With ``--trace-dir DIR`` every run gets
its own ``DIR/run-N`` (``DIR/latest`` links to the newest; see :mod:`autotune.report._runs`) holding the
tuner's trace, ``train_steps.jsonl`` and ``run.json`` (the summary), so a second run never
overwrites the first. A bad ``--trace-dir`` or environment value ends the run with one line
naming it and exit status 2. Under torchrun the ranks initialise the
model from the same seed, draw different data, and average gradients with one all-reduce after
backward (see :mod:`bench.train._dist` for why not DDP).

Threads: the main thread's intra-op threads (forward/backward) are set to this rank's
``plan_cpu_threads()`` share, because torchrun sets ``OMP_NUM_THREADS=1`` for every rank and the
CPU forward/backward would then run on one core; the plan splits the CPUs between the local ranks
without oversubscribing. ``--compute-threads`` overrides it. ``--threads`` / ``--chunk-numel``
only set the optimizer's knobs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from bench._stats import atomic_write_json
from bench.train import _dist
from bench.train import _args
from bench.train._args import DTYPES, check_args
from bench.train._summary import (SpeculationTally, build_summary, format_step, locked_setting, opt_knobs,
                                   plot_note, print_summary, stats_dict, step_legend)
from bench.train.model import GPT, SyntheticTokens, count_params, preset

logger = logging.getLogger("bench.train")

__all__ = ["build_parser", "main", "run"]

#: Written into each run directory under --trace-dir.
RUN_SUMMARY = "run.json"
TRAIN_STEPS = "train_steps.jsonl"


def build_parser() -> argparse.ArgumentParser:
    """The trainer's command line (:mod:`bench.train._args`)."""
    return _args.build_parser(description=__doc__.split("\n\n")[0])


class _SetupError(Exception):
    """A bad --trace-dir, environment value or flag for this launch (found once the ranks are
    known): reported in one line, exit status 2, like the parser's own errors."""


class _Interrupted(KeyboardInterrupt):
    """Ctrl-C, with the rank that got it (read before the process group is torn down)."""

    def __init__(self, rank: int | None) -> None:
        super().__init__()
        self.rank = rank


def _lr_lambda(steps: int, warmup: int):
    """Linear warmup to 1, then cosine down to 0.1 at the last step."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        span = max(1, steps - warmup)
        progress = min(1.0, (step - warmup) / span)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _autotune_kwargs(args: argparse.Namespace, run_dir: Path | None) -> dict[str, Any]:
    """``autotune=AutotuneConfig(...)`` with ``--cache`` / this run's trace directory, or nothing."""
    if not args.autotune:
        return {}
    from autotune import AutotuneConfig

    return {
        "autotune": AutotuneConfig(
            seed=args.seed,
            timeout_s=args.dist_timeout,
            cache_path=str(args.cache) if args.cache is not None else None,
            trace_dir=str(run_dir) if run_dir is not None else None,
            trace_runs=False,  # run_dir is this run's folder already (_run_dir), with the trainer's files
        )
    }


def _make_optimizer(args: argparse.Namespace, model: torch.nn.Module,
                    tune_kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    groups = _param_groups(model, args.weight_decay)
    betas = (0.9, 0.95)
    if not args.optim_cpu_offload:
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=betas, eps=1e-8, fused=True)
        if args.fsdp_cpu_offload and (args.autotune or args.threads is not None):
            from offload import tune_step_threads

            return tune_step_threads(opt, autotune=tune_kwargs.get("autotune", False), threads=args.threads)
        return opt
    from offload import CPUOffloadAdamW, OffloadSettings
    from offload._settings import DEFAULT_CHUNK_NUMEL

    settings = None
    if args.threads is not None or args.chunk_numel is not None or args.kernel is not None:
        settings = OffloadSettings(threads=args.threads, chunk_numel=args.chunk_numel or DEFAULT_CHUNK_NUMEL,
                                   kernel=args.kernel or "auto")
    if args.numa_bind:
        import dataclasses

        settings = dataclasses.replace(settings or OffloadSettings(), bind_numa=True)
    return CPUOffloadAdamW(
        groups, lr=args.lr, betas=betas, eps=1e-8, weight_decay=args.weight_decay,
        settings=settings, overlap_backward=args.overlap_backward,
        state_dtype=torch.bfloat16 if args.optim_state_dtype == "bf16" else torch.float32,
        state_rounding=args.optim_state_rounding, state_rounding_seed=args.seed,
        device_timeout_s=args.dist_timeout,  # a dead peer fails a wait on a device event as a collective
        **tune_kwargs,
    )


def _run_dir(args: argparse.Namespace, info: _dist.DistInfo) -> Path | None:
    """This run's ``--trace-dir/run-N``: made by each node's local rank 0 on that node's file
    system (the same path on the node's ranks; nodes may have different N), the path its tuner's
    traces go to. torchrun numbers a node's ranks consecutively."""
    if args.trace_dir is None:
        return None
    from autotune.report._runs import RunDirError, new_run_dir

    made: str | Path = ""
    if info.local_rank == 0:
        try:
            made = new_run_dir(args.trace_dir)
        except RunDirError as exc:
            made = f"--trace-dir: {exc}"
    everyone = _dist.gather_objects(made, info)
    failed = [m for m in everyone if isinstance(m, str) and m]
    if failed:  # every rank stops with the same message
        raise _SetupError(failed[0])
    return everyone[info.rank - info.local_rank]


def _clip_and_step(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer,
                   scaler: torch.amp.GradScaler | None) -> torch.Tensor | None:
    """Unscale (GradScaler), clip, step; the total gradient norm when clipping (unscaled), else None."""
    norm = None
    if args.clip_grad_norm is not None:
        if scaler is not None:
            scaler.unscale_(opt)
        if args.optim_cpu_offload:
            norm = opt.clip_grad_norm_(args.clip_grad_norm)
        else:
            norm = _stock_clip(model, args.clip_grad_norm)
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()
    return norm


def _stock_clip(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` for the stock optimizer; with parameters on several meshes
    (``--tp`` with ``--fsdp``: torch's function cannot stack norms across meshes) the norm per
    mesh by torch's ``get_total_norm``, combined, and torch's coefficient on the local gradients."""
    params = [p for p in model.parameters() if p.grad is not None]
    meshes = {id(p.device_mesh): p.device_mesh for p in params if hasattr(p, "device_mesh")}
    if len(meshes) <= 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    total = torch.zeros((), dtype=torch.float32)
    for key in meshes:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if id(getattr(p, "device_mesh", None)) == key])
        total = total + _full(norm).float().cpu() ** 2
    plain = [p.grad for p in params if not hasattr(p, "device_mesh")]
    if plain:
        total = total + torch.nn.utils.get_total_norm(plain).float().cpu() ** 2
    total = total.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_([_local(p.grad) for p in params], coef)
    return total


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _norm_value(norm: torch.Tensor | None) -> float | None:
    if norm is None:
        return None
    full = getattr(norm, "full_tensor", None)  # torch's clip of DTensor gradients returns a DTensor
    return float((full() if full is not None else norm).item())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train for ``args.steps`` steps; return the summary (every rank returns the same dict)."""
    from offload import plan_cpu_threads

    from autotune import AgreementError

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    info = None
    try:
        info = _dist.setup(device, timeout_s=args.dist_timeout, group=args.fsdp)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        if info.world_size > 1 and args.overlap_backward and not args.fsdp:
            raise _SetupError(
                "--overlap-backward with world size "
                f"{info.world_size}: the optimizer would start chunk updates during backward, before "
                "gradients are averaged across ranks; add --fsdp (FSDP2 reduce-scatters each "
                "gradient before its hook runs) or run it single-process"
            )
        return _train(args, device, info, plan_cpu_threads)
    except (_dist.DistFailure, AgreementError) as exc:  # a peer died, froze or disagreed: one line
        raise SystemExit(f"error: {exc}") from None
    except KeyboardInterrupt:
        raise _Interrupted(info.rank if info is not None and info.world_size > 1 else None) from None
    finally:
        if info is not None:
            _dist.teardown(info)


def _train(args: argparse.Namespace, device: torch.device, info: _dist.DistInfo, plan_cpu_threads) -> dict[str, Any]:
    is_main = info.rank == 0
    if not is_main:  # one "thread plan" line per run (rank 0's); every rank's plan is in the summary
        logging.getLogger("offload.threads._plan").setLevel(logging.WARNING)
    plan = plan_cpu_threads(threads=args.compute_threads)
    torch.set_num_threads(plan.threads)
    if is_main:  # offload.threads._plan logged the plan itself
        logger.debug("forward/backward use %d intra-op threads (thread plan source %s)",
                     plan.threads, plan.source)
    run_dir = _run_dir(args, info)

    cfg = preset(args.model_size)
    seq_len = args.seq_len or min(128, cfg.max_seq_len)  # check_args refused one above max_seq_len
    torch.manual_seed(args.seed)  # same init on every rank
    model = GPT(cfg).to(device=device, dtype=DTYPES[args.dtype])
    n_params = count_params(model)
    stream = info.rank  # the data stream: the ranks of a TP group share one
    if args.fsdp:
        from bench.train._parallel import parallelize

        param_dtype = DTYPES[args.fsdp_param_dtype] if args.fsdp_param_dtype else None
        stream = parallelize(model, tp=args.tp, hsdp=args.hsdp, param_dtype=param_dtype, cpu_offload=args.fsdp_cpu_offload)
    if is_main:
        print(f"model {args.model_size}: {n_params:,} parameters ({n_params / 1e6:.1f}M), dtype {args.dtype}, "
              f"device {device}, world size {info.world_size}", flush=True)
    data = SyntheticTokens(vocab_size=cfg.vocab_size, batch_size=args.batch_size, seq_len=seq_len,
                           seed=args.seed, stream=stream, device=device)
    opt = _make_optimizer(args, model, _autotune_kwargs(args, run_dir))
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(args.steps, warmup))

    step_log = None
    if is_main and run_dir is not None:
        step_log = open(run_dir / TRAIN_STEPS, "w", encoding="utf-8")

    overlap = args.optim_cpu_offload and args.overlap_backward
    scaler = torch.amp.GradScaler(device.type) if args.amp else None
    autocast = (lambda: torch.autocast(device.type, dtype=torch.float16)) if args.amp else contextlib.nullcontext
    scale = scaler.get_scale() if scaler is not None else None
    skipped = 0
    speculation = SpeculationTally()
    grad_norms: list[float] = []
    losses: list[float] = []
    step_times: list[float] = []
    opt_times: list[float] = []
    stats_rows: list[dict[str, float]] = []
    knobs_used = opt_knobs(opt)
    _, was_locked = locked_setting(opt, False)
    local_loss = math.nan
    if is_main:
        print(step_legend(offloaded=args.optim_cpu_offload), flush=True)
    try:
        for step in range(1, args.steps + 1):
            # Synthetic data is made before the clock starts: it is not what the step measures.
            batches = [data.next_batch() for _ in range(args.grad_accum)]
            _sync(device)
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), dtype=torch.float32, device=device)
            for micro, (x, y) in enumerate(batches):
                last = micro == args.grad_accum - 1
                ctx = opt.accumulating() if (overlap and not last) else contextlib.nullcontext()
                if args.fsdp:  # reduce-scatter once, after the last micro-batch
                    model.set_requires_gradient_sync(last)
                with ctx:
                    with autocast():
                        loss = model(x, y) / args.grad_accum
                    (loss if scaler is None else scaler.scale(loss)).backward()
                loss_sum += loss.detach()
            if not args.fsdp:  # FSDP2 already averaged them in its reduce-scatter
                _dist.average_gradients(model.parameters(), info, step=step)
            _sync(device)
            t_opt = time.perf_counter()
            norm = _clip_and_step(args, model, opt, scaler)
            _sync(device)
            opt_s = time.perf_counter() - t_opt
            opt.zero_grad(set_to_none=True)
            sched.step()
            local_loss = float(loss_sum.item())
            loss_value = _dist.average_scalar(local_loss, info, device, step=step)
            _sync(device)
            step_s = time.perf_counter() - t0

            stats = stats_dict(opt)
            knobs_used = opt_knobs(opt)
            grad_norm = _norm_value(norm)
            if grad_norm is not None:
                grad_norms.append(grad_norm)
            if scaler is not None:  # GradScaler lowers the scale after a step it skipped (inf/nan)
                skipped += scaler.get_scale() < scale
                scale = scaler.get_scale()
            commit = speculation.add(opt)
            locked, was_locked = locked_setting(opt, was_locked)
            losses.append(loss_value)
            step_times.append(step_s)
            opt_times.append(opt_s)
            if stats is not None:
                stats_rows.append(stats)
            if is_main:
                print(format_step(step, args.steps, loss_value, step_s, opt_s, stats, knobs_used, grad_norm, commit,
                                  locked), flush=True)
                if step_log is not None:
                    row = {"step": step, "loss": loss_value, "step_s": step_s, "opt_s": opt_s,
                           "threads": knobs_used[0], "chunk_numel": knobs_used[1], "stats": stats,
                           "grad_norm": grad_norm, "commit": commit}
                    step_log.write(json.dumps(row) + "\n")
                    step_log.flush()
    finally:
        if step_log is not None:
            step_log.close()
        close = getattr(opt, "close", None)  # CPUOffloadAdamW: stop its worker thread now, not at exit
        if close is not None:
            close()

    rank_entry = {
        "rank": info.rank,
        "local_rank": info.local_rank,
        "threads": knobs_used[0],
        "chunk_numel": knobs_used[1],
        "kernel": getattr(getattr(opt, "last_stats", None), "kernel", None),
        "compute_threads": torch.get_num_threads(),
        "plan": {"threads": plan.threads, "reason": plan.reason, "source": plan.source,
                 "cpus": len(plan.cpus), "local_world_size": plan.local_world_size},
        "param_sha256": _dist.param_checksum(model.parameters()),
        "loss_last_local": local_loss if losses else None,
    }
    ranks = _dist.gather_objects(rank_entry, info, step=args.steps)
    summary = build_summary(args, info, device, n_params, seq_len, opt, ranks, losses, step_times, opt_times,
                            stats_rows, grad_norms=grad_norms, speculation=speculation,
                            skipped_steps=skipped if scaler is not None else None)
    if is_main:
        print_summary(summary)
        if args.summary_json is not None:
            atomic_write_json(args.summary_json, summary)
            logger.info("summary written to %s", args.summary_json)
        if run_dir is not None:
            atomic_write_json(run_dir / RUN_SUMMARY, summary)
            print(f"trace: {run_dir} (inspect: python -m autotune show --run {args.trace_dir})", flush=True)
            note = plot_note(run_dir, args.autotune)
            if note is not None:
                print(note, flush=True)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    from autotune.knobs import KnobError

    try:
        run(args)
    except (_SetupError, KnobError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt as exc:  # one line per rank, not a traceback per rank
        rank = getattr(exc, "rank", None)
        where = f" (rank {rank})" if rank is not None else ""
        print(f"{parser.prog}: interrupted{where}", file=sys.stderr, flush=True)
        return 130
    return 0
