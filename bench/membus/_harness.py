"""The one harness of the memory-bus benchmarks: the timing loop, its statistics, the parts of the
command line and of the report that every ``bench.membus`` benchmark shares.

Why interleaved rounds: the development VM shares its memory bus with other machines, and its
two-thread bandwidth swings between about 30 and 90 GB/s (bench/results/README.md).
A variant timed in a block of its own would carry the load of its minutes; round ``r`` therefore
runs every variant once, in the order :func:`rotation` gives (ABC, BCA, CAB; with two variants AB,
then BA), so a drift hits all variants alike, and ratios are taken per round (:func:`paired`)
before their median. A variant is reported by the median and IQR of its samples
(:func:`summary`), never by its fastest sample alone: on a shared CPU a slow sample is often the
variant's own cost.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

from bench._args import OUT_DIR_HELP, HelpFormatter, output_dir
from bench._stats import iqr, median

__all__ = ["add_output", "alternate", "command", "interleaved", "machine_line", "new_parser", "paired",
           "require_positive", "rotation", "summary", "timed"]

K = TypeVar("K", bound=Hashable)


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes (wall clock)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rotation(items: Sequence[K], round_: int) -> list[K]:
    """The order of round ``round_``: ``items`` rotated left by ``round_`` (ABC, BCA, CAB, ...)."""
    k = round_ % len(items)
    return [*items[k:], *items[:k]]


def alternate(items: Sequence[K], round_: int) -> list[K]:
    """``items`` forwards in even rounds, backwards in odd ones."""
    return list(items) if round_ % 2 == 0 else list(reversed(items))


def interleaved(variants: Mapping[K, Callable[[], float | Sequence[float]]], rounds: int, *, warmup: int = 0,
                order: Callable[[int], Sequence[K]] | None = None,
                then: tuple[K, Callable[[], float]] | None = None,
                progress: logging.Logger | None = None) -> dict[K, list[float]]:
    """The samples of ``warmup + rounds`` interleaved rounds, the first ``warmup`` discarded.

    Each variant is a call that measures itself: it returns its seconds (or several, one per
    step it measured). Round ``r`` visits the variants in ``order(r)`` (default: :func:`rotation`
    of the mapping's order); ``then``, a ``(key, call)``, runs last in every round (a probe that
    reads the bus after the steps it is compared with). ``progress`` logs each round.
    """
    keys = list(variants)
    order = order or (lambda r: rotation(keys, r))
    samples: dict[K, list[float]] = {k: [] for k in keys}
    if then is not None:
        samples[then[0]] = []
    for r in range(warmup + rounds):
        got = [(k, variants[k]()) for k in order(r)]
        if then is not None:
            got.append((then[0], then[1]()))
        if r >= warmup:
            for k, seconds in got:
                samples[k].extend(seconds if isinstance(seconds, Sequence) else [seconds])
        if progress is not None:
            progress.info("round %d/%d done", r + 1, warmup + rounds)
    return samples


def summary(samples: Sequence[float], bytes_moved: int) -> dict[str, Any]:
    """One variant's samples: median, IQR, count, GB/s at the median, and the samples."""
    med = median(samples)
    return {"median_s": med, "iqr_s": iqr(samples), "n": len(samples),
            "gbps": bytes_moved / med / 1e9, "samples_s": list(samples)}


def paired(numerators: Sequence[float], denominators: Sequence[float], scale: float = 1.0) -> dict[str, Any]:
    """Median, IQR and count of the per-round ratios ``scale * a / b``."""
    values = [scale * a / b for a, b in zip(numerators, denominators)]
    return {"median": median(values), "iqr": iqr(values), "n": len(values)}


def command(name: str, argv: Sequence[str]) -> str:
    """The command line that reproduces a run of ``bench.membus.<name>`` with ``argv``."""
    return f"python -m bench.membus.{name} " + shlex.join(list(argv))


def new_parser(name: str, description: str | None) -> argparse.ArgumentParser:
    """The parser of ``python -m bench.membus.<name>``, with the benchmarks' help formatter."""
    return argparse.ArgumentParser(prog=f"python -m bench.membus.{name}", description=description,
                                   formatter_class=HelpFormatter)


def add_output(p: argparse.ArgumentParser, name: str | None, name_help: str = "result file stem") -> None:
    """``--out-dir`` and ``--name`` (the result files' stem, default ``name``)."""
    p.add_argument("--out-dir", type=output_dir, default=None, help=OUT_DIR_HELP)
    p.add_argument("--name", default=name, help=name_help)


def require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """Refuse (``parser.error``) the first of ``names`` whose value is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected an integer >= 1")


def machine_line(m: Mapping[str, Any]) -> str:
    """The report's last line: the machine and its load when the run started."""
    return (f"Machine: {m.get('cpu_model', '?')}, {m.get('logical_cpus', '?')} logical CPUs, "
            f"{m.get('torch_cpu_capability', '?')}; load average {m.get('load_avg_1_5_15', '?')} at the start.")
