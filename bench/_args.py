"""Command-line value parsers shared by the benchmarks."""

from __future__ import annotations

import argparse

from autotune.knobs import MAX_THREADS

__all__ = ["int_list", "thread_list"]


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
