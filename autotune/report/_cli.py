"""``python -m autotune``: inspect, export, plot and clear tuning results.

Works on the tuning cache (``--cache PATH``, else ``OFFLOAD_AUTOTUNE_CACHE``, else the user's
cache directory) and on run directories written by :class:`autotune.report._trace.TraceWriter`
(``--run DIR``). Imports neither the tuner nor torch.

A user error (a cache path that does not exist or is not a regular file, a run path that is not
a directory, a malformed environment variable) is one line on stderr and exit status 1, never a
traceback; the cache path is examined before it is opened, so a FIFO or a device is never read.
Output into a pipe whose reader has gone (``| head -1``) ends quietly with status 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from autotune import knobs
from autotune.cache._cache import SCHEMA_VERSION, CacheWriteError, TuningCache
from autotune.cache._entry import CacheEntry
from autotune.report._runs import resolve_run_dir
from autotune.report._trace import (
    SUMMARY_JSON,
    TRACE_JSONL,
    TUNING_PNG,
    plot_trace,
    read_rows,
    read_summary,
    rows_to_csv,
)

__all__ = ["main"]

_KEY_WIDTH = 12


class CliError(Exception):
    """A user error the CLI reports on stderr with exit status 1."""


def _knobs_text(value: Any) -> str:
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={v}" for k, v in sorted(value.items()))
    return "-" if value is None else str(value)


def _created(entry: CacheEntry) -> str:
    try:
        return datetime.datetime.fromtimestamp(entry.created_unix).isoformat(sep=" ", timespec="seconds")
    except (OverflowError, OSError, ValueError):
        return "-"


def _machine(entry: CacheEntry) -> str:
    fp = entry.fingerprint  # its keys are the fingerprint's (autotune.cache._fingerprint), not the entry's
    if fp is None:
        return "-"
    hw = fp.get("hardware") if isinstance(fp.get("hardware"), Mapping) else {}
    acc = hw.get("accelerator") if isinstance(hw.get("accelerator"), Mapping) else {}
    parts = [str(hw.get("cpu_model", "?")), f"{hw.get('affinity_cpus', '?')} cpus"]
    if acc and acc.get("name") not in (None, "cpu"):
        parts.append(f"{acc.get('count')}x {acc.get('name')}")
    parts.append(_count(fp.get("local_world_size", "?"), "local rank"))
    return ", ".join(parts)


def _count(n: Any, noun: str) -> str:
    """``"1 entry"``, ``"2 entries"``, ``"1 local rank"``: ``n`` and ``noun`` in the right number."""
    if n == 1:
        return f"1 {noun}"
    plural = noun[:-1] + "ies" if noun.endswith("y") else noun + "s"
    return f"{n} {plural}"


def _select(entries: Mapping[str, Any], prefixes: Sequence[str]) -> dict[str, Any]:
    if not prefixes:
        return dict(entries)
    chosen: dict[str, Any] = {}
    for prefix in prefixes:
        hits = [k for k in entries if k.startswith(prefix)]
        if not hits:
            raise CliError(f"no cache entry has a key starting with {prefix!r}")
        if len(hits) > 1:
            raise CliError(f"key prefix {prefix!r} is ambiguous: it matches {len(hits)} entries")
        chosen[hits[0]] = entries[hits[0]]
    return chosen


def _cache(args: argparse.Namespace, *, must_exist: bool = True) -> TuningCache:
    """The cache named by ``--cache`` (or the environment), refused unless it is a regular file."""
    cache = TuningCache(args.cache)
    problem = cache.file_problem()
    if problem is not None and (must_exist or problem != "does not exist"):
        raise CliError(f"cache file {cache.path} {problem}")
    return cache


def _run_dir(path: str | Path) -> Path:
    """The run in directory ``path`` (or its newest ``run-N``), else a :class:`CliError` saying
    what ``path`` is."""
    run = Path(path).expanduser()
    if run.is_dir():
        return resolve_run_dir(run)
    if run.exists():
        raise CliError(f"{run} is not a directory: expected a run directory (the --trace-dir of a run)")
    raise CliError(f"run directory {run} does not exist")


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() + "\n")


# --------------------------------------------------------------------------------------------
# Commands


def _show(args: argparse.Namespace, out: TextIO) -> int:
    if args.run is not None:
        run = _run_dir(args.run)
        summary = read_summary(run)
        if summary is None:
            raise CliError(f"{run / SUMMARY_JSON} does not exist or is not a JSON object")
        if args.json:
            out.write(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        else:
            _run_summary(run, summary, out)
        return 0
    cache = _cache(args)
    if args.json or args.keys:  # the entries as stored (keys a later version added included)
        raw = _select(cache.entries(repair=False), args.keys)  # inspection: never changes a file
        out.write(json.dumps(raw, indent=2, sort_keys=True) + "\n")
        return 0
    entries = cache.records(repair=False)
    out.write(f"cache: {cache.path} ({_count(len(entries), 'entry')})\n")
    bad = cache.bad_files()
    if bad:
        out.write(f"bad files kept aside: {', '.join(p.name for p in bad)}\n")
    if not entries:
        return 0
    rows = [["KEY", "CREATED", "WINNER", "BASELINE", "SPEEDUP", "PROBES", "PROBE COST", "MACHINE"]]
    for key, entry in sorted(entries.items(), key=lambda kv: kv[1].created_unix):
        speedup = entry.speedup
        rows.append([
            key[:_KEY_WIDTH],
            _created(entry),
            _knobs_text(entry.winner),
            _knobs_text(entry.baseline),
            f"{speedup:.2f}x" if speedup is not None else "-",
            str(entry.probe_steps),
            _cost(entry.probe_cost_s, entry.probe_cost_pct),
            _machine(entry),
        ])
    _table(rows, out)
    return 0


def _seconds(value: Any) -> str:
    return f"{value * 1e3:.2f} ms" if _finite(value) else "-"


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _cost(cost_s: Any, pct: Any) -> str:
    """``"250.00 ms (0.25%)"``: a cache entry's probing cost and its percentage of 1000 steps at
    the winner's median; "-" when not recorded (entries of older versions)."""
    if not _finite(cost_s):
        return "-"
    return _seconds(cost_s) + (f" ({pct:.2f}%)" if _finite(pct) else "")


def _run_summary(run: Path, summary: Mapping[str, Any], out: TextIO) -> None:
    """A few readable lines of a run's summary.json (the raw form: ``show --run DIR --json``)."""
    speedup = summary.get("speedup")
    ratio = f"{speedup:.2f}x" if isinstance(speedup, (int, float)) and math.isfinite(speedup) else "-"
    out.write(f"run: {run}\n")
    out.write(f"state: {summary.get('state', '-')}, cache: {summary.get('cache_status', '-')}, "
              f"steps: {summary.get('steps', '-')} (probe {summary.get('probe_steps', '-')}, "
              f"check {summary.get('check_steps', '-')})\n")
    out.write(f"static plan: {_knobs_text(summary.get('baseline'))} "
              f"({_seconds(summary.get('baseline_median_s'))})\n")
    out.write(f"winner: {_knobs_text(summary.get('winner'))} ({_seconds(summary.get('winner_median_s'))}, "
              f"{ratio} vs the static plan)\n")
    if summary.get("cache_status") == "hit":
        out.write("probing cost: none (cache hit: nothing probed)\n")
    elif "probe_cost_s" in summary:  # summaries of older versions have no such key
        cost, pct = summary.get("probe_cost_s"), summary.get("probe_cost_pct_of_1000_steps")
        share = f" ({pct:.2f}% of 1000 steps at it)" if _finite(pct) else ""
        text = f"{_seconds(cost)} beyond the winner's median{share}" if _finite(cost) else "-"
        out.write(f"probing cost: {text}\n")
    if summary.get("reason"):
        out.write(f"reason: {summary['reason']}\n")
    for warning in summary.get("warnings") or ():  # what the tuner's client said of the run
        out.write(f"warning: {warning}\n")
    out.write(f"(all fields: python -m autotune show --run {run} --json)\n")


def _export(args: argparse.Namespace, out: TextIO) -> int:
    if args.run is not None:
        run = _run_dir(args.run)
        try:
            rows = read_rows(run)
        except OSError as exc:
            raise CliError(f"cannot read {run / TRACE_JSONL}: {exc}") from None
        if args.format == "csv":
            rows_to_csv(rows, out)
        else:
            out.write(json.dumps(rows, indent=1) + "\n")
        return 0
    cache = _cache(args)
    if args.format == "csv":
        records = _select(cache.records(), args.keys)
        rows = [{"key": k, "created": _created(e), **e.export_row()} for k, e in sorted(records.items())]
        rows_to_csv(rows, out)
    else:  # the entries as stored (keys a later version added included)
        entries = _select(cache.entries(), args.keys)
        out.write(json.dumps({"schema": SCHEMA_VERSION, "entries": entries}, indent=1, sort_keys=True) + "\n")
    return 0


def _plot(args: argparse.Namespace, out: TextIO) -> int:
    run = _run_dir(args.run_dir)
    try:
        rows = read_rows(run)
    except OSError as exc:
        raise CliError(f"cannot read {run / TRACE_JSONL}: {exc}") from None
    if not rows:
        raise CliError(f"{run / TRACE_JSONL} has no rows to plot")
    target = Path(args.output) if args.output else run / TUNING_PNG
    try:
        plot_trace(rows, read_summary(run), target)
    except ImportError:
        raise CliError("plotting needs matplotlib: pip install matplotlib") from None
    out.write(f"wrote {target}\n")
    return 0


def _clear(args: argparse.Namespace, out: TextIO) -> int:
    cache = _cache(args, must_exist=False)
    problem = cache.file_problem()
    try:
        if problem is not None and problem not in ("does not exist", "is a dangling symlink"):
            raise CliError(f"cache file {cache.path} {problem}")
        if problem is not None:
            if args.keys:
                raise CliError(f"cache file {cache.path} {problem}: no entry to remove")
            out.write(f"nothing to remove: cache file {cache.path} {problem}\n")
        elif args.keys:
            removed = sum(cache.delete(key, strict=True) for key in _select(cache.entries(), args.keys))
            out.write(f"removed {_count(removed, 'entry')} from {cache.path}\n")
        else:
            out.write(f"removed {_count(cache.clear(strict=True), 'entry')} from {cache.path}\n")
    except CacheWriteError as exc:
        raise CliError(f"cannot clear {cache.path}: {exc}") from None
    if args.bad:
        for path in cache.bad_files():
            path.unlink(missing_ok=True)
            out.write(f"removed {path}\n")
    return 0


# --------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--cache", metavar="PATH", default=argparse.SUPPRESS,
        help=f"tuning cache file (default: ${knobs.CACHE_VAR} or the user cache directory)",
    )
    parser = argparse.ArgumentParser(
        prog="python -m autotune",
        description="Inspect, export, plot and clear the online autotuner's cache and run traces.",
        parents=[common],
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    show = sub.add_parser("show", parents=[common], help="list cache entries, or one run's summary",
                          description="List the cache entries (or print the ones named by key prefix as JSON), "
                                      "or summarise a run directory's summary.json with --run (all of it with --json).")
    show.add_argument("keys", nargs="*", metavar="KEY", help="key prefixes to print in full")
    show.add_argument("--json", action="store_true", help="print the entries (or, with --run, the "
                      "whole summary.json) as JSON")
    show.add_argument("--run", metavar="DIR", help="summarise DIR/summary.json instead of the cache "
                      "(DIR: a run directory, or a trainer's --trace-dir: its newest run-N)")
    show.set_defaults(func=_show)

    export = sub.add_parser("export", parents=[common], help="export cache entries or a run's trace rows",
                            description="Write the cache entries (or, with --run, a run's trace rows) to "
                                        "stdout or --output, as JSON or CSV.")
    export.add_argument("keys", nargs="*", metavar="KEY", help="key prefixes to export (default: all)")
    export.add_argument("--format", choices=("json", "csv"), default="json")
    export.add_argument("--output", "-o", metavar="FILE", help="write here instead of stdout")
    export.add_argument("--run", metavar="DIR", help="export DIR/trace.jsonl instead of the cache "
                        "(DIR: a run directory, or a trainer's --trace-dir: its newest run-N)")
    export.set_defaults(func=_export)

    plot = sub.add_parser("plot", help="draw a run's tuning.png (needs matplotlib)",
                          description="Draw step time per step of a run directory: colour = candidate, "
                                      "marker shape = phase, a ring = the winner.")
    plot.add_argument("run_dir", metavar="DIR", help="run directory holding trace.jsonl, or a "
                      "trainer's --trace-dir (its newest run-N)")
    plot.add_argument("--output", "-o", metavar="PNG", help=f"image path (default: DIR/{TUNING_PNG})")
    plot.set_defaults(func=_plot)

    clear = sub.add_parser("clear", parents=[common], help="remove cache entries",
                           description="Remove the entries named by key prefix, or all entries.")
    clear.add_argument("keys", nargs="*", metavar="KEY", help="key prefixes to remove (default: all)")
    clear.add_argument("--bad", action="store_true", help="also delete corrupt files kept aside (*.bad-*)")
    clear.set_defaults(func=_clear)
    return parser


def _reader_went_away(out: TextIO) -> int:
    """The reader closed the pipe (``| head``): stop quietly with status 0, as CLI tools do.

    ``out`` is pointed at /dev/null, so the interpreter's last flush of what is still buffered
    does not fail again ("Exception ignored ... BrokenPipeError" and status 120).
    """
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):  # an in-memory stream: nothing left to flush
        return 0
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
    return 0


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Run the CLI; returns the exit status."""
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    args = _parser().parse_args(argv)
    if not hasattr(args, "cache"):
        args.cache = None
    if args.cache == "":
        err.write(f"python -m autotune {args.command}: error: --cache '': expected a file path\n")
        return 1
    try:
        if getattr(args, "output", None) and args.func is _export:
            with open(args.output, "w", encoding="utf-8", newline="") as f:
                return args.func(args, f)
        status = args.func(args, out)
        out.flush()  # a closed pipe raises here, inside the try, not at interpreter exit
        return status
    except BrokenPipeError:
        return _reader_went_away(out)
    except CliError as exc:
        err.write(f"python -m autotune {args.command}: error: {exc}\n")
        return 1
    except (OSError, ValueError) as exc:  # ValueError: knobs.KnobError, a NUL byte in a path
        err.write(f"python -m autotune {args.command}: error: {exc}\n")
        return 1
