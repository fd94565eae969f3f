"""Command-line value parsers and the result directory shared by the benchmarks.

Results go to a new ``runs/bench/<name>-N`` (under the current directory) unless ``--out-dir``
names a folder: the committed results in ``bench/results`` are replaced only on purpose
(``--out-dir bench/results``), never by a quick try of a README command.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from autotune.knobs import MAX_THREADS

__all__ = ["OUT_DIR_HELP", "RUNS_ROOT", "int_list", "new_result_dir", "resolve_out_dir", "thread_list"]

#: Where results go without --out-dir: one new numbered folder per run below it.
RUNS_ROOT = Path("runs") / "bench"
OUT_DIR_HELP = ("where the result files go (default: a new runs/bench/<name>-N; the committed results "
                "are replaced only with --out-dir bench/results)")


def new_result_dir(name: str, root: Path = RUNS_ROOT) -> Path:
    """Create and return the first free ``<root>/<name>-N`` (N from 1)."""
    root.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        candidate = root / f"{name}-{n}"
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            n += 1


def resolve_out_dir(args: argparse.Namespace, name: str) -> Path:
    """``args.out_dir`` if given, else a new :func:`new_result_dir` (stored back into ``args``)."""
    if args.out_dir is None:
        args.out_dir = new_result_dir(name)
    return args.out_dir


def int_list(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``: comma-separated positive (ASCII) integers."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1 or not text.isascii():
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers")
    return values


def thread_list(text: str) -> list[int]:
    """Thread counts: :func:`int_list` values up to ``autotune.knobs.MAX_THREADS`` (larger ones
    would reach ``torch.set_num_threads``, which crashes the process on absurd values)."""
    values = int_list(text)
    if max(values) > MAX_THREADS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: thread count {max(values)} is above {MAX_THREADS}: expected 1 to {MAX_THREADS}"
        )
    return values
