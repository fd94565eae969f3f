"""``overlap_backward`` against off on an emulated accelerator: the CPU side of a GPU node.

    python -m bench.overlap --out-dir bench/results    # 8 x Linear(1536) (18.9M params), ~3 min
    python -m bench.overlap --quick --out-dir /tmp/ov  # 4 x Linear(256), seconds
    python -m bench.overlap --overlap on               # one mode alone (no comparison)
    python -m bench.overlap --ranks 2 --out-dir bench/results --name overlap-2ranks  # 2 ranks (torchrun)
    python -m bench.overlap --threads 2 --backward-threads 1 --clip off   # the drain on both cores

On a CPU-only machine backward's math needs the cores the early chunks would run on, so
overlap can only lose there (``bench.clip``'s trainer part). A GPU node leaves the CPU idle during
backward; this benchmark puts that idle time back: every layer of the model also sleeps, GIL
released, for a modelled GPU time in forward and in backward (``bench.overlap._emulation``).

Calibration: per dtype, the plain ``step()`` (overlap off, 1 optimizer thread, no waits) is
timed first; each case then sets the per-layer backward wait so that the whole backward waits
``ratio`` x that step (forward: ``--forward-fraction`` x the backward wait). Cases: fp32 and bf16
parameters x with and without ``opt.clip_grad_norm_(max_norm)`` every step (its norm stays far
above ``max_norm``, so every step clips) x the ratios. Each case gets fresh optimizers, one per
mode (what a mode keeps from step to step, such as a paused speculation, does not leak into the
next case), same initial weights, same batch every iteration (lr 1e-6: the work stays the same);
``OffloadSettings(threads=1)`` (the trainer thread has the other core of a 2-core machine),
``torch.set_num_threads(1)`` for the model. ``--threads 2 --backward-threads 1``: every mode's
``step()`` runs on 2 threads (after backward the trainer thread only waits in ``step()``, its core
is free), and with overlap on the chunks started during backward run on 1
(``OffloadSettings.backward_threads``), leaving the trainer its core while backward runs; the
plain step of the calibration runs on ``--threads`` too. ``--ranks N``: N torchrun ranks (gloo) on this host,
each with its replica, its share of the CPUs and the same cases, side by side
(``bench.overlap._ranks``: a barrier before each iteration, the slowest rank's record kept).

Per case the modes are visited in rotating order (off, on / on, off / ...), ``--iters``
iterations per visit, ``--rounds`` rounds, after ``--warmup`` discarded iterations per mode (the
first creates the optimizer state, so nothing speculates in it; the second first-touches the
second generation).
Reported per case: iteration, forward+backward and exposed (after backward) times of each mode;
per round the hidden fraction ``(iteration_off - iteration_on) / exposed_off``, the
forward+backward slowdown and the redo cost; commit rate, redone chunks, and host bytes per
parameter (slabs + their second generation). ``bench.overlap._report`` says how each is computed.

``--overlap`` picks the modes (:data:`MODES`: a new way to overlap is one more entry, compared
against off the same way). Results: ``<out-dir>/<name>.json``, ``.md`` and ``.png`` (the hidden
fraction against the ratio, where matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from bench._args import OUT_DIR_HELP, HelpFormatter, output_dir
from bench._cli import bench_main
from bench._stats import machine_info
from bench.overlap._emulation import Trainee, Waits, build_model, host_bytes_per_param, visit
from bench.overlap._ranks import RESULT_FLAG, Ranks, launch, slowest
from bench.overlap._report import compare, mode_summary, plot, render_markdown, spread

logger = logging.getLogger("bench.overlap")

__all__ = ["MODES", "build_parser", "main", "run"]

#: The modes a case can run: ``CPUOffloadAdamW`` keyword arguments. "off" is the reference
#: every other mode is compared with.
MODES: dict[str, dict[str, Any]] = {
    "off": {"overlap_backward": False},
    "on": {"overlap_backward": True},
}
#: ``--overlap`` choices: a mode, or "both" (every mode of :data:`MODES`).
OVERLAP_CHOICES = ("both", *MODES)
DEFAULT_RATIOS = (0.5, 1.0, 1.5, 3.0)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_CLIP_CHOICES = ("both", "off", "on")
_REPO = Path(__file__).absolute().parents[1]


def _ratio_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < v < math.inf for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated finite ratios > 0")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--overlap", choices=OVERLAP_CHOICES, default="both",
                   help="modes to run: both (off and on, interleaved, compared) or one alone")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated parameter dtypes: fp32, bf16")
    p.add_argument("--clip", choices=_CLIP_CHOICES, default="both",
                   help="cases with opt.clip_grad_norm_(--max-norm) every step, without, or both")
    p.add_argument("--max-norm", type=float, default=1.0, help="clip max norm")
    p.add_argument("--ratios", type=_ratio_list, default=list(DEFAULT_RATIOS),
                   help="total backward wait / plain step, one case each")
    p.add_argument("--forward-fraction", type=float, default=0.5,
                   help="forward wait per layer as a fraction of the backward wait")
    p.add_argument("--layers", type=int, default=None, help="Linear layers (default 8; 4 with --quick)")
    p.add_argument("--width", type=int, default=None, help="features of each Linear (default 1536; 256 with --quick)")
    p.add_argument("--batch", type=int, default=4, help="rows of the (fixed) input batch")
    p.add_argument("--chunk-numel", type=int, default=None,
                   help="OffloadSettings.chunk_numel (default the library's, 4194304; 65536 with --quick)")
    p.add_argument("--lr", type=float, default=1e-6,
                   help="learning rate (small: the gradient norm stays put, every iteration is the same work)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds per case (default 16; 3 with --quick)")
    p.add_argument("--iters", type=int, default=None, help="iterations per visit (default 2; 1 with --quick)")
    p.add_argument("--warmup", type=int, default=2,
                   help="discarded iterations per mode and case (the first creates the state: nothing speculates)")
    p.add_argument("--calibration-steps", type=int, default=None,
                   help="timed plain steps per dtype (default 10; 3 with --quick)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and batch")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--quick", action="store_true", help="a tiny model, few rounds: a smoke run of seconds")
    p.add_argument("--out-dir", type=output_dir, default=None, help=OUT_DIR_HELP)
    p.add_argument("--name", default=None, help="result file stem (default overlap or overlap-quick)")
    p.add_argument("--note", default="", help="free text stored with the results")
    p.add_argument("--threads", type=int, default=1,
                   help="OffloadSettings.threads of every mode: the intra-op threads of step()")
    p.add_argument("--backward-threads", type=int, default=None,
                   help="OffloadSettings.backward_threads of the overlapped mode: the threads of the chunks "
                        "started during backward (default: the same as --threads)")
    p.add_argument("--ranks", type=int, default=1,
                   help="ranks on this host (torchrun, gloo), each with its replica and share of the CPUs")
    p.add_argument(RESULT_FLAG, dest="rank_result", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def _resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from offload._settings import DEFAULT_CHUNK_NUMEL, MIN_CHUNK_NUMEL

    q = args.quick
    args.layers = args.layers if args.layers is not None else (4 if q else 8)
    args.width = args.width if args.width is not None else (256 if q else 1536)
    args.chunk_numel = args.chunk_numel if args.chunk_numel is not None else (65536 if q else DEFAULT_CHUNK_NUMEL)
    args.rounds = args.rounds if args.rounds is not None else (3 if q else 16)
    args.iters = args.iters if args.iters is not None else (1 if q else 2)
    args.calibration_steps = args.calibration_steps if args.calibration_steps is not None else (3 if q else 10)
    args.name = args.name or ("overlap-quick" if q else "overlap")
    args.modes = list(MODES) if args.overlap == "both" else [args.overlap]
    args.dtype_list = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not args.dtype_list or any(d not in _DTYPES for d in args.dtype_list):
        p.error(f"--dtypes {args.dtypes!r}: expected a comma-separated list of {sorted(_DTYPES)}")
    args.clips = {"both": [None, args.max_norm], "off": [None], "on": [args.max_norm]}[args.clip]
    for flag in ("layers", "width", "batch", "rounds", "iters", "calibration_steps", "ranks", "threads"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected an integer >= 1")
    if args.backward_threads is not None and not 1 <= args.backward_threads <= args.threads:
        p.error(f"--backward-threads {args.backward_threads}: expected an integer from 1 to --threads "
                f"({args.threads})")
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: expected an integer >= 0")
    if args.chunk_numel < MIN_CHUNK_NUMEL:
        p.error(f"--chunk-numel {args.chunk_numel}: expected an integer >= {MIN_CHUNK_NUMEL}")
    if not 0 < args.max_norm < math.inf:
        p.error(f"--max-norm {args.max_norm}: expected a finite number > 0")
    if not 0 <= args.forward_fraction < math.inf:
        p.error(f"--forward-fraction {args.forward_fraction}: expected a finite number >= 0")
    if not 0 <= args.lr < math.inf:
        p.error(f"--lr {args.lr}: expected a finite number >= 0")


def _trainees(args: argparse.Namespace, dtype: torch.dtype, waits: Waits, modes: Sequence[str]) -> dict[str, Trainee]:
    from offload import CPUOffloadAdamW, OffloadSettings

    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.batch, args.width, generator=gen).to(dtype)
    target = 10.0 * torch.randn(args.batch, args.width, generator=gen)  # far from the output: norm >> 1
    out = {}
    for mode in modes:
        model = build_model(layers=args.layers, width=args.width, dtype=dtype, waits=waits, seed=args.seed)
        backward = args.backward_threads if MODES[mode].get("overlap_backward") else None
        settings = OffloadSettings(threads=args.threads, chunk_numel=args.chunk_numel, backward_threads=backward)
        opt = CPUOffloadAdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                              settings=settings, **MODES[mode])
        out[mode] = Trainee(mode, model, opt, x, target)
    return out


def _rotation(modes: Sequence[str], r: int) -> list[str]:
    k = r % len(modes)
    return [*modes[k:], *modes[:k]]


def _calibrate(args: argparse.Namespace, dtype_name: str, ranks: Ranks | None) -> dict[str, Any]:
    """The plain step: "off" without waits, after the warm-up (the first step creates the state);
    and the model's own forward+backward math without waits (the trainer core's share). With
    ``ranks``, every rank's steps side by side, and their mean is the step every rank models."""
    trainee = _trainees(args, _DTYPES[dtype_name], Waits(), ["off"])["off"]
    before = None if ranks is None else ranks.barrier
    try:
        visit(trainee, iters=max(3, args.warmup), clip=None, before=before)
        got = visit(trainee, iters=args.calibration_steps, clip=None, before=before)
    finally:
        trainee.opt.close()
    if ranks is not None:
        got = [r for recs in ranks.gather(got) for r in recs]
    return {"dtype": dtype_name, "step_s": spread([r["step_s"] for r in got]),
            "model_fb_s": spread([r["fb_s"] for r in got]), "num_chunks": got[0]["num_chunks"]}


def _code_version() -> dict[str, Any]:
    """The commit measured and the files of ``offload/`` that differ from it (others may be
    editing the library while a benchmark runs; the results say which code they measured)."""
    def git(*cmd: str) -> str | None:
        try:
            proc = subprocess.run(["git", *cmd], cwd=_REPO, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    changed = git("status", "--porcelain", "--", "offload")
    return {"commit": None if commit is None else commit.strip(),
            "offload_changed": None if changed is None else [line[3:] for line in changed.splitlines() if line[3:]]}


def _case(args: argparse.Namespace, *, dtype: str, clip: float | None, ratio: float, step_s: float,
          ranks: Ranks | None = None) -> dict[str, Any]:
    """One case on fresh optimizers (every case has the same history: state a mode keeps from
    step to step, such as a paused speculation, does not leak into the next case). With
    ``ranks``, every rank runs it side by side and the slowest rank's records are kept."""
    waits = Waits(backward_s=ratio * step_s / args.layers)
    waits.forward_s = args.forward_fraction * waits.backward_s
    trainees = _trainees(args, _DTYPES[dtype], waits, args.modes)
    modes = list(trainees)
    before = None if ranks is None else ranks.barrier
    try:
        for t in trainees.values():
            visit(t, iters=args.warmup, clip=clip, before=before)
        rounds = []
        for r in range(args.rounds):
            rounds.append({mode: visit(trainees[mode], iters=args.iters, clip=clip, before=before)
                           for mode in _rotation(modes, r)})
        summaries = {mode: mode_summary(rounds, mode) for mode in modes}
        for mode, t in trainees.items():
            summaries[mode]["host_bytes_per_param"] = host_bytes_per_param(t.opt, t.numel)
        equal = None
        if "off" in trainees and len(trainees) > 1:  # the overlap contract, checked on the way
            ref = list(trainees["off"].model.parameters())
            equal = all(all(torch.equal(a, b) for a, b in zip(ref, t.model.parameters())) for t in trainees.values())
        if ranks is not None:
            gathered = ranks.gather((rounds, equal))
            rounds = slowest([g[0] for g in gathered])
            equal = None if equal is None else all(g[1] for g in gathered)
            summaries = {mode: {**mode_summary(rounds, mode), "host_bytes_per_param": summaries[mode]["host_bytes_per_param"]}
                         for mode in modes}
        numel = next(iter(trainees.values())).numel
    finally:
        for t in trainees.values():
            t.opt.close()
    backward_wait = waits.backward_s * args.layers
    off_step = summaries["off"]["step_s"]["median"] if "off" in summaries else math.nan
    case = {
        "dtype": dtype, "clip": clip, "ratio": ratio, "params": numel,
        "backward_wait_s": backward_wait, "forward_wait_s": waits.forward_s * args.layers,
        "effective_ratio": backward_wait / off_step if off_step > 0 else math.nan,
        "params_equal_to_off": equal,
        "modes": summaries,
        "compare": {m: compare(rounds, m, "off") for m in modes if m != "off" and "off" in modes},
        "rounds": [{m: list(recs) for m, recs in r.items()} for r in rounds],
    }
    for name, k in case["compare"].items():
        logger.info("%s clip=%s ratio %g: %s hidden fraction %+.2f, iteration off %.1f / %s %.1f ms",
                    dtype, clip, ratio, name, k["hidden_fraction"]["median"],
                    summaries["off"]["iter_s"]["median"] * 1e3, name, summaries[name]["iter_s"]["median"] * 1e3)
    return case


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    if args.ranks > 1:  # the ranks measure; this process reports (and plots) what rank 0 wrote
        began = time.perf_counter()
        result = launch(argv, args.ranks)
        result["wall_s"] = time.perf_counter() - began
        result["command"] = " ".join(["python -m bench.overlap", shlex.join(argv)]).strip()
        result["machine"] = machine_info()
        if not args.no_plot:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            path = plot(result, args.out_dir / f"{args.name}.png")
            result["plot"] = None if path is None else str(path)
        return result
    return _measure(args, argv, None)


def _measure(args: argparse.Namespace, argv: Sequence[str], ranks: Ranks | None) -> dict[str, Any]:
    began = time.perf_counter()
    code = _code_version()  # at the start: the modules are imported by now, later edits do not run
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        infos, cases = [], []
        for dtype in args.dtype_list:
            calibration = _calibrate(args, dtype, ranks)
            step_s = calibration["step_s"]["median"]
            logger.info("%s: plain step %.1f ms (median of %d)", dtype, step_s * 1e3, calibration["step_s"]["n"])
            infos.append(calibration)
            cases += [_case(args, dtype=dtype, clip=clip, ratio=ratio, step_s=step_s, ranks=ranks)
                      for clip in args.clips for ratio in args.ratios]
    finally:
        torch.set_num_threads(previous)
    result: dict[str, Any] = {
        "benchmark": "bench.overlap",
        "command": " ".join(["python -m bench.overlap", shlex.join(argv)]).strip(),
        "quick": args.quick, "modes": args.modes, "params": cases[0]["params"],
        "config": {k: getattr(args, k) for k in ("layers", "width", "batch", "chunk_numel", "lr", "rounds", "iters",
                                                 "warmup", "calibration_steps", "forward_fraction", "max_norm",
                                                 "ratios", "seed")},
        "optimizer_threads": args.threads, "backward_threads": args.backward_threads,
        "ranks": 1 if ranks is None else ranks.world,
        "rank_cpus": None if ranks is None else ranks.gather(ranks.cpus),
        "dtypes": infos, "cases": cases, "note": args.note, "plot": None, "code": code,
    }
    result["machine"] = machine_info()
    if not args.no_plot and ranks is None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = plot(result, args.out_dir / f"{args.name}.png")
        result["plot"] = None if path is None else str(path)
    result["wall_s"] = time.perf_counter() - began
    return result


def _rank_main(argv: Sequence[str]) -> int:
    """A rank started by :func:`bench.overlap._ranks.launch`: measure side by side with the
    others; rank 0 writes the result where the parent reads it (no report, no folder)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _resolve(parser, args)
    logging.basicConfig(level="WARNING", stream=sys.stderr)
    ranks = Ranks.join()
    try:
        result = _measure(args, [a for a in argv if a != RESULT_FLAG and a != str(args.rank_result)], ranks)
    finally:
        ranks.close()
    if ranks.rank == 0:
        args.rank_result.write_text(json.dumps(result))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if RESULT_FLAG in argv:
        return _rank_main(argv)
    bench_main(argv, build_parser=build_parser, run=run, resolve=_resolve, render_markdown=render_markdown)
    return 0
