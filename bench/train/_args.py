"""``python -m bench.train``'s command line: the parser (every flag with its default and why) and
the checks of flag combinations that would otherwise be ignored or change the run silently.
Values are checked as they are parsed: a bad one is one usage line naming it (exit status 2).
"""

from __future__ import annotations

import argparse
import math

import torch

from bench._args import PATH_RULE, HelpFormatter, output_dir, output_file
from bench.train import _dist
from bench.train.model import PRESETS, preset

__all__ = ["DTYPES", "build_parser", "check_args"]

#: --dtype / --fsdp-param-dtype
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return value


def _thread_count(text: str) -> int:
    from offload._settings import MAX_THREADS

    value = _positive_int(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a thread count from 1 to {MAX_THREADS}")
    return value


def _chunk_numel(text: str) -> int:
    from offload._settings import MIN_CHUNK_NUMEL

    value = _positive_int(text)
    if value < MIN_CHUNK_NUMEL:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a chunk size of at least {MIN_CHUNK_NUMEL} elements")
    return value


def _float(text: str, ok, expected: str) -> float:
    """``text`` as a float for which ``ok(value)`` holds (a finite one), else a usage error."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}")
    return value


def _nonnegative_float(text: str) -> float:
    return _float(text, lambda v: v >= 0, "a finite number >= 0")


def _positive_seconds(text: str) -> float:
    return _float(text, lambda v: v > 0, "a number of seconds > 0")


def _clip_norm(text: str) -> float:
    return _float(text, lambda v: v > 0, "a finite max norm > 0")


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.train", description=description,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model-size", default="small", choices=sorted(PRESETS), help="model preset")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="model parameter dtype")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda if available, else cpu")
    p.add_argument("--steps", type=_positive_int, default=20, help="optimizer steps")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="sequences per micro-batch per rank")
    p.add_argument("--seq-len", type=_positive_int, default=None, help="default: min(128, model max)")
    p.add_argument("--grad-accum", type=_positive_int, default=1, help="micro-batches per step")
    p.add_argument("--seed", type=int, default=0, help="model init (same on all ranks) and data seed")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warmup; default 10%% of --steps")
    p.add_argument("--weight-decay", type=_nonnegative_float, default=0.1, help="on matrices only (not biases, norms)")
    p.add_argument("--optim-cpu-offload", action="store_true",
                   help="use offload.CPUOffloadAdamW (else torch.optim.AdamW(fused=True) on the device)")
    p.add_argument("--threads", type=_thread_count, default=None,
                   help="optimizer intra-op threads (default: the rank's thread plan)")
    p.add_argument("--chunk-numel", type=_chunk_numel, default=None,
                   help="optimizer pipeline chunk size in elements")
    p.add_argument("--kernel", choices=("auto", "torch", "fused-mp"), default=None,
                   help="CPU AdamW kernel of the offloaded step (default auto: fused-mp where it builds "
                        "and is verified bitwise equal to torch's kernel, else torch; fused-mp: the "
                        "native single-pass kernel, torch's where it cannot build)")
    p.add_argument("--numa-bind", action="store_true",
                   help="bind to the NUMA node of the GPU (CPU: of the affinity mask) before the "
                        "optimizer allocates its host state (OffloadSettings.bind_numa)")
    p.add_argument("--optim-state-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the moments' dtype in host memory (CPUOffloadAdamW(state_dtype=)): bf16 moves 20 "
                        "instead of 28 bytes per parameter per step of a bf16 model, rounded to nearest-even")
    p.add_argument("--optim-state-rounding", choices=("nearest", "stochastic"), default="nearest",
                   help="with --optim-state-dtype bf16: how the moments are rounded (state_rounding; "
                        "stochastic: seeded by --seed)")
    p.add_argument("--overlap-backward", action="store_true",
                   help="start each chunk's update during backward (one process, or several with --fsdp)")
    p.add_argument("--autotune", action="store_true", help="tune threads and chunk size online")
    p.add_argument("--clip-grad-norm", type=_clip_norm, default=None, metavar="X",
                   help="clip the total gradient norm to X before each step: opt.clip_grad_norm_(X) with "
                        "--optim-cpu-offload, else torch.nn.utils.clip_grad_norm_")
    p.add_argument("--amp", choices=("fp16",), default=None,
                   help="fp16 autocast of forward and torch.amp.GradScaler (scaled backward, scaler.step; "
                        "scaler.unscale_ before --clip-grad-norm)")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2: fully_shard each block and the root (see bench.train._fsdp)")
    p.add_argument("--fsdp-cpu-offload", action="store_true",
                   help="with --fsdp: FSDP2's CPUOffloadPolicy and stock torch.optim.AdamW(fused=True) stepping "
                        "on the CPU shards; --autotune / --threads set that step's threads (offload.tune_step_threads)")
    p.add_argument("--fsdp-param-dtype", choices=sorted(DTYPES), default=None,
                   help="with --fsdp: MixedPrecisionPolicy(param_dtype=...) for forward/backward")
    p.add_argument("--tp", type=_positive_int, default=1, help="with --fsdp: tensor parallel over N ranks (bench.train._parallel)")
    p.add_argument("--hsdp", type=_positive_int, default=1, help="with --fsdp: HSDP, R replica groups of FSDP shards")
    p.add_argument("--cache", type=output_file, default=None,
                   help="tuning cache file (default: $OFFLOAD_AUTOTUNE_CACHE, else "
                        "$XDG_CACHE_HOME/offload-autotune/cache.json, XDG_CACHE_HOME defaulting "
                        "to ~/.cache); its folder: as for --trace-dir")
    p.add_argument("--trace-dir", type=output_dir, default=None,
                   help="folder of run traces: each run writes a new DIR/run-N (DIR/latest links "
                        f"to it) with the tuner's trace, train_steps.jsonl and run.json ({PATH_RULE})")
    p.add_argument("--compute-threads", type=_thread_count, default=None,
                   help="intra-op threads for forward/backward (default: the rank's thread plan)")
    p.add_argument("--summary-json", type=output_file, default=None,
                   help="write the run summary here (its folder: as for --trace-dir)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="logging level of the trainer and the libraries (stderr)")
    p.add_argument("--dist-timeout", type=_positive_seconds, default=_dist.DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="timeout of every collective, the tuner's included, and of each host wait of "
                        "CPUOffloadAdamW on a device event (device_timeout_s): a rank that stops answering "
                        "fails the others within it, naming the step and the rank")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse flag combinations that would be ignored or silently change the run (``p.error``)."""
    if args.fsdp_cpu_offload:  # stock AdamW on CPU shards: only its thread count is ours to set
        if not args.fsdp or args.optim_cpu_offload:
            p.error("--fsdp-cpu-offload is FSDP2's CPUOffloadPolicy with stock AdamW: add --fsdp, drop --optim-cpu-offload")
        for flag, value in (("--chunk-numel", args.chunk_numel), ("--kernel", args.kernel),
                            ("--overlap-backward", args.overlap_backward),
                            ("--optim-state-dtype bf16", args.optim_state_dtype != "fp32")):
            if value:
                p.error(f"{flag} configures CPUOffloadAdamW, not the stock AdamW of --fsdp-cpu-offload")
    elif not args.optim_cpu_offload:
        for flag, value in (("--threads", args.threads), ("--chunk-numel", args.chunk_numel),
                            ("--kernel", args.kernel), ("--numa-bind", args.numa_bind),
                            ("--overlap-backward", args.overlap_backward), ("--autotune", args.autotune),
                            ("--optim-state-dtype bf16", args.optim_state_dtype != "fp32")):
            if value:
                p.error(f"{flag} configures the offloaded optimizer: add --optim-cpu-offload")
    if args.optim_state_rounding != "nearest" and args.optim_state_dtype != "bf16":
        p.error("--optim-state-rounding stochastic rounds bf16 moments: add --optim-state-dtype bf16")
    if args.amp is not None:
        for flag, value in (("--dtype bf16", args.dtype != "fp32"), ("--fsdp-param-dtype", args.fsdp_param_dtype),
                            ("--fsdp-cpu-offload", args.fsdp_cpu_offload)):
            if value:
                p.error(f"--amp {args.amp} with {flag}: autocast with GradScaler expects fp32 parameters on the "
                        "device; drop one of them")
    if (args.fsdp_param_dtype is not None or args.tp > 1 or args.hsdp > 1) and not args.fsdp:
        p.error("--fsdp-param-dtype, --tp and --hsdp configure FSDP2: add --fsdp")
    if (args.cache is not None) and not args.autotune:
        p.error("--cache is the tuning cache: add --autotune")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch reports no CUDA device here; use --device cpu")
    max_seq_len = preset(args.model_size).max_seq_len
    if args.seq_len is not None and args.seq_len > max_seq_len:
        p.error(f"--seq-len {args.seq_len}: the {args.model_size} model's max_seq_len is {max_seq_len}; "
                f"expected 1 to {max_seq_len}")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        p.error(f"--warmup-steps {args.warmup_steps}: expected an integer >= 0")
    if not (math.isfinite(args.lr) and args.lr > 0):
        p.error(f"--lr {args.lr}: expected a finite float > 0")
