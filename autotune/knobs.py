"""Every environment variable this project reads, in one place.

Nothing here is read at import time; each accessor reads the environment when called, so tests
and launchers can set variables late. A malformed value raises :class:`KnobError` naming the
variable, the bad value and what was expected. The list is documented in ``docs/environment.md``.

``offload`` and ``bench`` read their environment through this module too (``offload`` depends on
``autotune``, never the other way round), so one ``grep`` finds every variable the project reads.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "KnobError",
    "THREADS_VAR",
    "CACHE_VAR",
    "threads_override",
    "cache_path",
    "local_world_size",
    "local_rank",
    "omp_num_threads",
    "TORCH_EXTENSIONS_VAR",
    "torch_extensions_dir",
]

#: Forces the intra-op thread count of every rank; wins over the ThreadPlan and the tuner's
#: thread knob.
THREADS_VAR = "OFFLOAD_AUTOTUNE_THREADS"
#: Path of the tuning cache file (default: ``$XDG_CACHE_HOME/offload-autotune/cache.json``).
CACHE_VAR = "OFFLOAD_AUTOTUNE_CACHE"
#: torch's own variable for where C++ extensions are built; the fused-mp kernel follows it.
TORCH_EXTENSIONS_VAR = "TORCH_EXTENSIONS_DIR"


class KnobError(ValueError):
    """An environment variable holds a value this project cannot use."""


def _positive_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise KnobError(f"Unable to use {name}={raw!r}: expected a positive integer") from None
    if value < 1:
        raise KnobError(f"Unable to use {name}={raw!r}: expected a positive integer")
    return value


def threads_override() -> int | None:
    """``OFFLOAD_AUTOTUNE_THREADS``: explicit intra-op thread count for this rank, or None."""
    return _positive_int(THREADS_VAR)


def cache_path() -> Path:
    """``OFFLOAD_AUTOTUNE_CACHE``, else ``$XDG_CACHE_HOME`` (or ``~/.cache``)/offload-autotune/cache.json."""
    raw = os.environ.get(CACHE_VAR)
    if raw:
        return Path(raw).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "offload-autotune" / "cache.json"


def torch_extensions_dir() -> Path | None:
    """``TORCH_EXTENSIONS_DIR`` (torch's convention for C++ extension builds), or None if unset."""
    raw = os.environ.get(TORCH_EXTENSIONS_VAR)
    return Path(raw).expanduser() if raw else None


def local_world_size() -> int | None:
    """``LOCAL_WORLD_SIZE`` as set by torchrun: ranks on this node, or None outside a launcher."""
    return _positive_int("LOCAL_WORLD_SIZE")


def local_rank() -> int | None:
    """``LOCAL_RANK`` as set by torchrun, or None outside a launcher."""
    raw = os.environ.get("LOCAL_RANK")
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise KnobError(f"Unable to use LOCAL_RANK={raw!r}: expected an integer >= 0") from None
    if value < 0:
        raise KnobError(f"Unable to use LOCAL_RANK={raw!r}: expected an integer >= 0")
    return value


def omp_num_threads() -> int | None:
    """``OMP_NUM_THREADS`` (torchrun sets 1); only reported, never obeyed over an explicit plan."""
    return _positive_int("OMP_NUM_THREADS")
