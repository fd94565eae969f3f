"""``TraceWriter``: an exportable record of every measured step of a tuning run.

One run directory holds:

- ``trace.jsonl``: one JSON object per measured step, appended and flushed as steps arrive (a
  crashed run keeps what it measured);
- ``trace.csv``: the same rows, flattened (``candidate.threads``, ``ranks.1.step_s``, ...), with a
  header; written by :meth:`~TraceWriter.write_summary` and :meth:`~TraceWriter.close` (which
  also runs at interpreter exit for a writer nobody closed), like the Chrome trace;
- ``trace.chrome.json``: pipeline stages per rank in Chrome trace format (open it in Perfetto or
  ``chrome://tracing``): one process per rank, one thread lane per stage, one ``X`` event per
  stage of each chunk, plus a ``step`` lane;
- ``summary.json``: what the tuner decided (baseline, winner, speed-up, probe steps, cache hit,
  fingerprint), written by :meth:`~TraceWriter.write_summary`;
- ``tuning.png``: step time per step, colour = candidate, shape = phase, the winner ringed; only when
  matplotlib is installed (drawn by :mod:`autotune.report._plot`).

The rows are whatever the tuner passes; the documented shape is ``{"step": int, "phase": str,
"candidate": {knob: value}, "ranks": {rank: {stage: seconds}}, "node_time_s": float,
"decision": str | None}``, where ``step`` counts training steps from 1, as the trainer's console
and ``tuning.png`` do (the Chrome trace's steps are the same numbers); the lock-in row also has
``probe_cost_s`` and ``probe_cost_pct_of_1000_steps``. Values are made JSON-safe
(NaN and infinities become null).

The writer with ``rank=0`` writes the names above; a writer created with another rank writes
``trace.rank<r>.jsonl`` and so on, so that writers on several ranks never clobber each other.
The intended use is one writer on local rank 0 that receives every rank's spans (gathered by the
tuner) through ``add_spans(rank=r, ...)``.

Writing a trace must never stop training: I/O errors log one warning and disable the writer.
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import dataclasses
import io
import json
import logging
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from autotune.report._plot import plot_text, plot_trace, step_time_of

__all__ = [
    "TraceWriter",
    "TRACE_JSONL",
    "TRACE_CSV",
    "TRACE_CHROME",
    "SUMMARY_JSON",
    "TUNING_PNG",
    "read_rows",
    "read_summary",
    "rows_to_csv",
    "plot_trace",
    "plot_text",
    "step_time_of",
]

logger = logging.getLogger(__name__)

TRACE_JSONL = "trace.jsonl"
TRACE_CSV = "trace.csv"
TRACE_CHROME = "trace.chrome.json"
SUMMARY_JSON = "summary.json"
TUNING_PNG = "tuning.png"

#: Spans kept for the Chrome trace; beyond this, further spans are dropped (with one warning) so
#: a long run cannot grow the trace without bound.
MAX_SPANS = 500_000
#: Fixed lanes of the Chrome trace; other stages get the next lane numbers in order of arrival.
_LANES = {"step": 0, "d2h": 1, "adam_kernel": 2, "materialize": 3, "drain": 4}
#: Gap between steps when step start times are unknown, as a fraction of the previous step.
_STEP_GAP = 0.1


# --------------------------------------------------------------------------------------------
# JSON helpers


def _jsonable(value: Any) -> Any:
    """``value`` as JSON data: non-finite floats -> None, tuples -> lists, scalars unwrapped."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return _jsonable(to_dict())
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        return _jsonable(item())
    return str(value)


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        if not value and prefix:
            out[prefix] = ""
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, list):
        if not value and prefix:
            out[prefix] = ""
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), out)
    else:
        out[prefix] = "" if value is None else value


def rows_to_csv(rows: Iterable[Mapping[str, Any]], stream: io.TextIOBase | Any) -> int:
    """Write ``rows`` flattened (nested keys joined with ``.``) as CSV with a header; returns the row count."""
    flat: list[dict[str, Any]] = []
    columns: dict[str, None] = {}
    for row in rows:
        out: dict[str, Any] = {}
        _flatten(_jsonable(row), "", out)
        flat.append(out)
        columns.update(dict.fromkeys(out))
    writer = csv.DictWriter(stream, fieldnames=list(columns), restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows(flat)
    return len(flat)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


# --------------------------------------------------------------------------------------------
# Reading a run directory back (CLI)


def read_rows(directory: str | os.PathLike[str], name: str = TRACE_JSONL) -> list[dict[str, Any]]:
    """Rows of ``trace.jsonl`` in ``directory``; unparseable lines are skipped with a warning."""
    rows: list[dict[str, Any]] = []
    path = Path(directory) / name
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                logger.warning("%s:%d is not JSON; skipped", path, n)
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                logger.warning("%s:%d is not a JSON object; skipped", path, n)
    return rows


def read_summary(directory: str | os.PathLike[str], name: str = SUMMARY_JSON) -> dict[str, Any] | None:
    """``summary.json`` of a run directory, or None if absent or not a JSON object."""
    path = Path(directory) / name
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("Cannot read %s: %s", path, exc)
        return None
    return doc if isinstance(doc, dict) else None


# --------------------------------------------------------------------------------------------
# Writer


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    """A Chrome-trace metadata event (names and orders processes and thread lanes)."""
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _span_fields(span: Any) -> tuple[str, int, float, float]:
    if isinstance(span, (tuple, list)):
        stage, chunk, start, end = span
    else:  # an object with .stage/.chunk/.start_s/.end_s (e.g. offload.StageSpan)
        stage, chunk, start, end = span.stage, span.chunk, span.start_s, span.end_s
    return str(stage), int(chunk), float(start), float(end)


class TraceWriter:
    """Writes one run's trace into ``directory`` (created if needed).

    Args:
        directory: the run directory.
        rank: rank of the writing process; rank 0 writes the plain file names, rank r the
            ``.rank<r>`` variants.
        plot: draw ``tuning.png`` on close when matplotlib is installed.
        max_spans: most spans kept (the rest are counted and dropped), default :data:`MAX_SPANS`.
    """

    def __init__(
        self, directory: str | os.PathLike[str], rank: int = 0, *, plot: bool = True, max_spans: int = MAX_SPANS
    ):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank={rank!r}: expected an int >= 0")
        if isinstance(max_spans, bool) or not isinstance(max_spans, int) or max_spans < 0:
            raise ValueError(f"max_spans={max_spans!r}: expected an int >= 0")
        self.max_spans = max_spans
        self.directory = Path(directory).expanduser()
        self.rank = rank
        self.plot = plot
        self._rows: list[dict[str, Any]] = []
        # (rank, step, stage, chunk, start_s, end_s)
        self._spans: list[tuple[int, int, str, int, float, float]] = []
        self._step_starts: dict[tuple[int, int], float | None] = {}
        self._summary: dict[str, Any] | None = None
        self._jsonl: io.TextIOWrapper | None = None
        self._dropped_spans = 0
        self._closed = False
        self._failed = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # outputs of an earlier run in this directory must not mix with this run's
            for name in (TRACE_CSV, TRACE_CHROME, SUMMARY_JSON, TUNING_PNG):
                self.path(name).unlink(missing_ok=True)
            self._jsonl = open(self.path(TRACE_JSONL), "w", encoding="utf-8")
        except OSError as exc:
            self._fail(f"cannot create {self.directory}", exc)
        # A run that never calls close() still gets its CSV, Chrome trace and plot at exit.
        atexit.register(self.close)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TraceWriter({str(self.directory)!r}, rank={self.rank})"

    def path(self, name: str) -> Path:
        """Where this writer puts file ``name`` (``trace.jsonl`` -> ``trace.rank1.jsonl`` on rank 1)."""
        if self.rank == 0:
            return self.directory / name
        stem, dot, suffix = name.partition(".")
        return self.directory / f"{stem}.rank{self.rank}{dot}{suffix}"

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The rows added so far (JSON-safe copies)."""
        return list(self._rows)

    def _fail(self, what: str, exc: BaseException) -> None:
        if not self._failed:
            logger.warning("Tuning trace disabled: %s (%s)", what, exc)
        self._failed = True
        if self._jsonl is not None:
            with contextlib.suppress(OSError):
                self._jsonl.close()
            self._jsonl = None

    def add_step(self, row: Mapping[str, Any]) -> None:
        """Record one measured step (appended to ``trace.jsonl`` at once)."""
        if not isinstance(row, Mapping):
            raise TypeError(f"row={row!r}: expected a mapping such as {{'step': 3, 'phase': 'probe', ...}}")
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        clean = _jsonable(row)
        self._rows.append(clean)
        if self._jsonl is not None:
            try:
                self._jsonl.write(json.dumps(clean, allow_nan=False) + "\n")
                self._jsonl.flush()
            except OSError as exc:
                self._fail(f"cannot append to {self.path(TRACE_JSONL)}", exc)

    def add_spans(
        self,
        rank: int,
        step: int,
        spans: Iterable[Any],
        *,
        step_start_s: float | None = None,
    ) -> None:
        """Record the pipeline stages of one step of one rank.

        Args:
            rank: the rank that ran them (the Chrome-trace process).
            step: the training step.
            spans: ``(stage, chunk, start_s, end_s)`` tuples, or objects with those attributes,
                in seconds relative to the start of the step (negative: started during backward).
            step_start_s: the step's start on a clock shared by all ranks, if known; when every
                step has one, the Chrome trace uses real times, otherwise steps are laid end to end.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank={rank!r}: expected an int >= 0")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step={step!r}: expected an int")
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        self._step_starts[(rank, step)] = step_start_s
        for span in spans:
            stage, chunk, start, end = _span_fields(span)
            if not (math.isfinite(start) and math.isfinite(end)):
                continue
            if len(self._spans) >= self.max_spans:
                if self._dropped_spans == 0:
                    logger.warning("Tuning trace keeps at most %d spans; dropping the rest", self.max_spans)
                self._dropped_spans += 1
                continue
            self._spans.append((rank, step, stage, chunk, start, max(end, start)))

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        """Write ``summary.json`` (and refresh ``trace.csv`` and ``trace.chrome.json``).

        Adds ``speedup`` (baseline median / winner median) when both medians are present and
        the summary has none.
        """
        if not isinstance(summary, Mapping):
            raise TypeError(f"summary={summary!r}: expected a mapping")
        clean = _jsonable(summary)
        base, win = clean.get("baseline_median_s"), clean.get("winner_median_s")
        if "speedup" not in clean and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (base, win)):
            if win > 0:
                clean["speedup"] = base / win
        self._summary = clean
        if self._failed:
            return
        try:
            text = json.dumps(clean, indent=2, sort_keys=True, allow_nan=False) + "\n"
            _atomic_write_text(self.path(SUMMARY_JSON), text)
        except OSError as exc:
            self._fail(f"cannot write {self.path(SUMMARY_JSON)}", exc)
        self._write_csv()
        self._write_chrome()

    def close(self) -> None:
        """Write ``trace.csv``, ``trace.chrome.json`` and ``tuning.png``; idempotent.

        Runs at interpreter exit for writers that were never closed.
        """
        if self._closed:
            return
        self._closed = True
        if self._jsonl is not None:
            with contextlib.suppress(OSError):
                self._jsonl.close()
            self._jsonl = None
        atexit.unregister(self.close)
        if self._failed:
            return
        self._write_csv()
        self._write_chrome()
        if self.plot and self._rows and not self._failed:
            self._write_plot()

    def _write_chrome(self) -> None:
        if self._failed:
            return
        try:
            _atomic_write_text(self.path(TRACE_CHROME), json.dumps(self.chrome_trace(), separators=(",", ":")))
        except OSError as exc:
            self._fail(f"cannot write {self.path(TRACE_CHROME)}", exc)

    def _write_csv(self) -> None:
        if self._failed:
            return
        buf = io.StringIO()
        rows_to_csv(self._rows, buf)
        try:
            _atomic_write_text(self.path(TRACE_CSV), buf.getvalue())
        except OSError as exc:
            self._fail(f"cannot write {self.path(TRACE_CSV)}", exc)

    def _write_plot(self) -> None:
        try:
            import matplotlib  # noqa: F401  (only to test availability)
        except ImportError:
            logger.info("matplotlib is not installed; no %s", TUNING_PNG)
            return
        try:
            plot_trace(self._rows, self._summary, self.path(TUNING_PNG))
        except Exception as exc:  # a plotting problem must never fail the training run
            logger.warning("Could not draw %s: %s", self.path(TUNING_PNG), exc)

    # -- Chrome trace ----------------------------------------------------------------------------

    def _step_origins(self) -> dict[tuple[int, int], float]:
        """Start of each (rank, step) on the trace timeline, in seconds."""
        keys = sorted({(r, s) for r, s, *_ in self._spans})
        lo: dict[int, float] = {}
        hi: dict[int, float] = {}
        for _, step, _, _, start, end in self._spans:
            lo[step] = min(lo.get(step, 0.0), start)
            hi[step] = max(hi.get(step, 0.0), end)
        starts = [self._step_starts.get(k) for k in keys]
        if keys and all(isinstance(v, (int, float)) and math.isfinite(v) for v in starts):
            t0 = min(float(self._step_starts[k]) + lo[k[1]] for k in keys)  # type: ignore[arg-type]
            return {k: float(self._step_starts[k]) - t0 for k in keys}  # type: ignore[arg-type]
        origin: dict[int, float] = {}
        cursor = 0.0
        for step in sorted(lo):
            extent = hi[step] - lo[step]
            origin[step] = cursor - lo[step]
            cursor += extent * (1.0 + _STEP_GAP)
        return {k: origin[k[1]] for k in keys}

    def chrome_trace(self) -> dict[str, Any]:
        """The Chrome trace document (``traceEvents`` in microseconds)."""
        origins = self._step_origins()
        lanes = dict(_LANES)
        for _, _, stage, *_ in self._spans:
            lanes.setdefault(stage, len(lanes))
        row_by_step = {r.get("step"): r for r in self._rows if isinstance(r, dict)}
        events: list[dict[str, Any]] = []
        ranks = sorted({r for r, *_ in self._spans})
        used_lanes: dict[int, set[int]] = {r: set() for r in ranks}
        step_extent: dict[tuple[int, int], tuple[float, float]] = {}
        for rank, step, stage, chunk, start, end in self._spans:
            t = origins[(rank, step)]
            tid = lanes[stage]
            used_lanes[rank].add(tid)
            events.append({
                "name": stage, "cat": "stage", "ph": "X",
                "ts": round((t + start) * 1e6, 3), "dur": round((end - start) * 1e6, 3),
                "pid": rank, "tid": tid, "args": {"step": step, "chunk": chunk},
            })
            a, b = step_extent.get((rank, step), (0.0, 0.0))
            step_extent[(rank, step)] = (min(a, start), max(b, end))
        for (rank, step), (start, end) in sorted(step_extent.items()):
            t = origins[(rank, step)]
            row = row_by_step.get(step, {})
            args: dict[str, Any] = {"step": step}
            for key in ("phase", "candidate", "decision"):
                if key in row:
                    args[key] = row[key]
            used_lanes[rank].add(lanes["step"])
            events.append({
                "name": f"step {step}", "cat": "step", "ph": "X",
                "ts": round((t + start) * 1e6, 3), "dur": round((end - start) * 1e6, 3),
                "pid": rank, "tid": lanes["step"], "args": args,
            })
        names = {tid: stage for stage, tid in lanes.items()}
        meta: list[dict[str, Any]] = []
        for rank in ranks:
            meta.append(_meta("process_name", rank, 0, name=f"rank {rank}"))
            meta.append(_meta("process_sort_index", rank, 0, sort_index=rank))
            for tid in sorted(used_lanes[rank]):
                meta.append(_meta("thread_name", rank, tid, name=names[tid]))
                meta.append(_meta("thread_sort_index", rank, tid, sort_index=tid))
        doc: dict[str, Any] = {"traceEvents": meta + events, "displayTimeUnit": "ms"}
        if self._dropped_spans:
            doc["otherData"] = {"dropped_spans": self._dropped_spans}
        return doc
