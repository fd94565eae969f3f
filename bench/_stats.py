"""Small helpers shared by the trainer and the benchmarks: robust statistics, atomic JSON, machine info."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import platform
import statistics
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = ["median", "iqr", "quantile", "atomic_write_text", "atomic_write_json", "machine_info"]


def quantile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default), ``nan`` for no samples."""
    xs = sorted(samples)
    if not xs:
        return math.nan
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples) if samples else math.nan


def iqr(samples: Sequence[float]) -> float:
    """Interquartile range (q75 - q25); 0 for a single sample, ``nan`` for none."""
    return quantile(samples, 0.75) - quantile(samples, 0.25)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        # mkstemp makes the file 0600; results are meant to be read: use the usual umask mode.
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """JSON with ``NaN``/``inf`` written as ``null`` so strict parsers accept the file."""
    return atomic_write_text(path, json.dumps(_finite(obj), indent=2, sort_keys=False) + "\n")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """CPU model, core counts, memory, torch build and the current date (UTC)."""
    import psutil

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        affinity = os.cpu_count() or 1
    return {
        "cpu_model": _cpu_model(),
        "logical_cpus": psutil.cpu_count(logical=True),
        "physical_cores": psutil.cpu_count(logical=False),
        "affinity_cpus": affinity,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_parallel_backend": _parallel_backend(),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _parallel_backend() -> str:
    for line in torch.__config__.parallel_info().splitlines():
        if "parallel backend" in line:
            return line.split(":", 1)[1].strip()
    return "unknown"
