"""``fingerprint(...)``: the cache key of a tuning result.

A tuned setting is only valid where it was measured, so the key covers everything that moves
the optimum: the hardware (CPU model, physical and logical cores, this process's affinity size,
NUMA nodes, memory, accelerator name and count), the software (Python, torch, optuna, numpy and
this package's versions), the job shape (local world size), the workload (parameter count and
dtypes, as the caller describes it) and the search space.

The key is the SHA-256 of the canonical JSON of :attr:`Fingerprint.details` (sorted keys, no
whitespace), so it is stable across processes and runs: no ``hash()``, no dict ordering. Memory is
rounded to whole GiB so small fluctuations in what the kernel reports do not change it.
"""

from __future__ import annotations

import enum
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import platform
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune import knobs

__all__ = ["CPUINFO", "NUMA_ROOT", "Fingerprint", "fingerprint", "hardware_details", "software_details", "canonical_json"]

logger = logging.getLogger(__name__)

#: Bumped when the layout of ``details`` changes, so old keys stop matching.
FINGERPRINT_VERSION = 1
#: Distribution name of this package (``pyproject.toml``).
PACKAGE_NAME = "offload-autotune"
#: Where :func:`hardware_details` counts NUMA nodes and reads the CPU model by default.
NUMA_ROOT = Path("/sys/devices/system/node")
CPUINFO = Path("/proc/cpuinfo")
_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """A cache key and what it was computed from.

    Equality and hashing use ``key`` only.
    """

    key: str
    """SHA-256 hex digest of the canonical JSON of ``details``."""
    details: dict[str, Any] = field(compare=False, repr=False)
    """Hardware, software, local world size, workload and search space (JSON values only)."""


def canonical_json(value: Any) -> str:
    """Deterministic JSON text of ``value`` (after :func:`_canonical`): sorted keys, no spaces."""
    return json.dumps(_canonical(value, "value"), sort_keys=True, separators=(",", ":"), allow_nan=False)


def _canonical(value: Any, where: str) -> Any:
    """``value`` as plain JSON data; raises TypeError/ValueError naming what cannot be keyed."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return _canonical(value.value, where)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}={value!r}: expected a finite number")
        return float(value)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"{where}: key {k!r} is not a str or int")
            out[str(k)] = _canonical(v, f"{where}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return sorted((_canonical(v, f"{where}[]") for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return _canonical(to_dict(), where)
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value)  # "torch.bfloat16"; no torch import needed here
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item) and getattr(value, "ndim", None) == 0:
        return _canonical(item(), where)
    raise TypeError(
        f"{where}={value!r} ({type(value).__name__}): expected JSON-like data "
        "(str, int, float, bool, None, lists, dicts, or an object with to_dict())"
    )


# --------------------------------------------------------------------------------------------
# Hardware


def _cpu_model(cpuinfo: Path) -> str:
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        text = ""
    for key in ("model name", "Model", "Hardware", "cpu model"):
        match = re.search(rf"^{key}\s*:\s*(.+)$", text, flags=re.MULTILINE)
        if match and match.group(1).strip():
            return match.group(1).strip()
    return platform.processor() or platform.machine() or "unknown"


def _numa_nodes(root: Path) -> int:
    try:
        nodes = [p for p in root.iterdir() if re.fullmatch(r"node\d+", p.name)]
    except OSError:
        return 1
    return max(1, len(nodes))


def _affinity_size() -> int | None:
    getter = getattr(os, "sched_getaffinity", None)
    if getter is None:
        return os.cpu_count()
    try:
        return len(getter(0))
    except OSError:
        return os.cpu_count()


def _accelerator() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"name": "cpu", "count": 0}
    try:
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
            return {"name": " + ".join(names), "count": count}
    except Exception as exc:  # a broken driver must not stop training; key it as "cpu"
        logger.warning("Could not query CUDA devices for the tuning fingerprint (%s); keying as cpu", exc)
    return {"name": "cpu", "count": 0}


def hardware_details(*, numa_root: Path = NUMA_ROOT, cpuinfo: Path = CPUINFO) -> dict[str, Any]:
    """What this machine looks like to the tuner (JSON values only). ``numa_root`` (the sysfs
    node directory) and ``cpuinfo`` say where NUMA nodes are counted and the CPU model is read."""
    import psutil

    try:
        memory_gib = round(psutil.virtual_memory().total / _GIB)
    except Exception:  # psutil on an exotic platform
        memory_gib = None
    return {
        "cpu_model": _cpu_model(Path(cpuinfo)),
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": psutil.cpu_count(logical=True),
        "affinity_cpus": _affinity_size(),
        "numa_nodes": _numa_nodes(Path(numa_root)),
        "memory_gib": memory_gib,
        "accelerator": _accelerator(),
    }


# --------------------------------------------------------------------------------------------
# Software


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def software_details() -> dict[str, Any]:
    """Versions that can move the optimum (read from package metadata; nothing is imported), and
    the environment variables that change the step (only where some is set: keys made without any
    stay what they were)."""
    package = _version(PACKAGE_NAME)
    if package is None:  # running from a source checkout that was never installed
        package = "source"
    details: dict[str, Any] = {
        "python": ".".join(str(v) for v in sys.version_info[:3]),
        "torch": _version("torch"),
        "optuna": _version("optuna"),
        "numpy": _version("numpy"),
        "package": package,
    }
    env = knobs.step_environment()
    if env:
        details["environment"] = env
    return details


# --------------------------------------------------------------------------------------------


def fingerprint(
    *,
    workload: Mapping[str, Any],
    space: Any,
    local_world_size: int,
    extra: Mapping[str, Any] | None = None,
    hardware: Mapping[str, Any] | None = None,
    software: Mapping[str, Any] | None = None,
) -> Fingerprint:
    """The cache key of tuning ``space`` for ``workload`` on this machine.

    Args:
        workload: what is being tuned, e.g. ``{"params": 124_439_808, "dtypes": ["torch.bfloat16"]}``.
        space: the search space, a mapping or an object with ``to_dict()``.
        local_world_size: ranks on this node sharing the CPU.
        extra: anything else that should split the cache (e.g. a user-chosen tag).
        hardware: the machine's facts instead of :func:`hardware_details` (simulations, tests).
        software: the versions instead of :func:`software_details`.
    """
    if isinstance(local_world_size, bool) or not isinstance(local_world_size, int) or local_world_size < 1:
        raise ValueError(f"local_world_size={local_world_size!r}: expected an int >= 1")
    if not isinstance(workload, Mapping):
        raise TypeError(f"workload={workload!r}: expected a mapping such as {{'params': n, 'dtypes': [...]}}")
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"extra={extra!r}: expected a mapping or None")
    if not isinstance(space, Mapping) and not callable(getattr(space, "to_dict", None)):
        raise TypeError(f"space={space!r}: expected a mapping or an object with to_dict()")
    for name, facts in (("hardware", hardware), ("software", software)):
        if facts is not None and not isinstance(facts, Mapping):
            raise TypeError(f"{name}={facts!r}: expected a mapping or None")
    details = {
        "version": FINGERPRINT_VERSION,
        "hardware": hardware_details() if hardware is None else dict(hardware),
        "software": software_details() if software is None else dict(software),
        "local_world_size": local_world_size,
        "workload": _canonical(workload, "workload"),
        "space": _canonical(space, "space"),
        "extra": _canonical(dict(extra or {}), "extra"),
    }
    text = canonical_json(details)
    return Fingerprint(key=hashlib.sha256(text.encode("utf-8")).hexdigest(), details=json.loads(text))
