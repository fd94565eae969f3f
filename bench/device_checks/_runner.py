"""One check of ``bench.device_checks`` run whatever it raises or however long it hangs.

The first GPU run of this project is one try of a few minutes (issue 40): a check that raises
anything must not skip the others, and one that hangs must say where before the script's
``timeout`` kills it.
"""

from __future__ import annotations

import faulthandler
import gc
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TRACEBACK_LINES", "run_check"]

#: Lines of a failed check's traceback kept in its record (the whole one goes to stderr).
TRACEBACK_LINES = 12


def _stderr() -> Any:
    """A file with a real descriptor for faulthandler (pytest's capture replaces ``sys.stderr``)."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__


def run_check(name: str, check: Callable[[str], dict[str, Any]], device: str, *,
              watchdog_s: float) -> dict[str, Any]:
    """``check(device)``'s record: ``{"check": name, "ok": True, **what it returned}``, or, whatever
    it raised, ``ok: False`` with the exception's type and message and its traceback's tail (the
    whole traceback goes to stderr); ``seconds`` either way. A check still running after
    ``watchdog_s`` seconds (0: never) has every thread's stack dumped to stderr and goes on. On
    CUDA the device is synchronized inside the check's time, so an asynchronous failure is its
    own, not the next check's; what a failed check left (optimizers, their workers and pinned
    blocks, cached device memory) is collected after it."""
    print(f"device_checks: {name} started"
          + (f" (every thread's stack is dumped to stderr if it runs past {watchdog_s:g} s)" if watchdog_s else ""),
          file=sys.stderr, flush=True)
    if watchdog_s:
        faulthandler.dump_traceback_later(watchdog_s, exit=False, file=_stderr())
    t0 = time.perf_counter()
    try:
        result: dict[str, Any] = {"check": name, "ok": True, **check(device)}
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - every check runs and reports its own failure
        lines = traceback.format_exception(exc)
        print(f"device_checks: {name} failed:\n{''.join(lines)}", file=sys.stderr, flush=True)
        tail = "".join(lines).rstrip("\n").splitlines()[-TRACEBACK_LINES:]
        result = {"check": name, "ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": tail}
    finally:
        if watchdog_s:
            faulthandler.cancel_dump_traceback_later()
    result["seconds"] = round(time.perf_counter() - t0, 2)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result
