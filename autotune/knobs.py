"""Every environment variable this project reads, in one place.

Nothing here is read at import time; each accessor reads the environment when called, so tests
and launchers can set variables late. A malformed value raises :class:`KnobError` naming the
variable, the bad value and what was expected. The list is documented in ``docs/environment.md``.

``offload`` and ``bench`` read their environment through this module too (``offload`` depends on
``autotune``, never the other way round), so one ``grep`` finds every variable the project reads.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "KnobError",
    "THREADS_VAR",
    "CACHE_VAR",
    "MAX_THREADS",
    "threads_override",
    "cache_path",
    "local_world_size",
    "local_rank",
    "node_local_rank",
    "omp_num_threads",
    "TORCH_EXTENSIONS_VAR",
    "torch_extensions_dir",
    "extensions_dir",
]

#: Forces the intra-op thread count of every rank; wins over the ThreadPlan and the tuner's
#: thread knob.
THREADS_VAR = "OFFLOAD_AUTOTUNE_THREADS"
#: Path of the tuning cache file (default: ``$XDG_CACHE_HOME/offload-autotune/cache.json``).
CACHE_VAR = "OFFLOAD_AUTOTUNE_CACHE"
#: torch's own variable for where C++ extensions are built; the fused-mp kernel follows it.
TORCH_EXTENSIONS_VAR = "TORCH_EXTENSIONS_DIR"


#: Most intra-op threads one rank may ask for, from any source (argument, settings, environment).
#: Far above the cores of any single machine's rank; a count beyond it is a typo, and reached
#: ``torch.set_num_threads`` unchecked it crashed the process (100000: libgomp cannot create the
#: threads and the process dies with SIGSEGV). Counts between the rank's CPUs and this are
#: clamped with a warning by ``offload.plan_cpu_threads``.
MAX_THREADS = 1024

#: Only plain ASCII digits: ``int()`` also accepts "٣", "1_000" and surrounding whitespace.
_ASCII_INT = re.compile(r"[0-9]+")
#: More digits than any value this module accepts; longer strings are not converted at all.
_MAX_DIGITS = 18


class KnobError(ValueError):
    """An environment variable holds a value this project cannot use."""


def _int(name: str, *, minimum: int, maximum: int | None = None) -> int | None:
    """The ASCII integer in ``name`` (surrounding whitespace allowed), or None when unset or empty."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    text = raw.strip()
    expected = f"an integer >= {minimum}" if maximum is None else f"an integer from {minimum} to {maximum}"
    if not _ASCII_INT.fullmatch(text) or len(text.lstrip("0")) > _MAX_DIGITS:
        raise KnobError(f"Unable to use {name}={raw!r}: expected {expected} in ASCII digits")
    value = int(text)
    if value < minimum or (maximum is not None and value > maximum):
        raise KnobError(f"Unable to use {name}={raw!r}: expected {expected}")
    return value


def _positive_int(name: str) -> int | None:
    return _int(name, minimum=1)


def threads_override() -> int | None:
    """``OFFLOAD_AUTOTUNE_THREADS``: explicit intra-op thread count for this rank, or None.

    An integer from 1 to :data:`MAX_THREADS`; ``plan_cpu_threads`` clamps it to the rank's CPUs.
    """
    return _int(THREADS_VAR, minimum=1, maximum=MAX_THREADS)


def _cache_home() -> Path:
    """``$XDG_CACHE_HOME`` (or ``~/.cache``)/offload-autotune: the default home of our files."""
    try:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base).expanduser() / "offload-autotune"
    except RuntimeError as exc:  # "~user/..." of an unknown user, or no home directory at all
        value = os.environ.get("XDG_CACHE_HOME", "")
        raise KnobError(f"Unable to use XDG_CACHE_HOME={value!r}: {exc} (expected a path)") from None


def cache_path() -> Path:
    """``OFFLOAD_AUTOTUNE_CACHE``, else ``$XDG_CACHE_HOME`` (or ``~/.cache``)/offload-autotune/cache.json."""
    raw = os.environ.get(CACHE_VAR)
    if not raw:
        return _cache_home() / "cache.json"
    try:
        return Path(raw).expanduser()
    except RuntimeError as exc:  # "~user/..." of an unknown user, or no home directory at all
        raise KnobError(f"Unable to use {CACHE_VAR}={raw!r}: {exc} (expected a path)") from None


def torch_extensions_dir() -> Path | None:
    """``TORCH_EXTENSIONS_DIR`` (torch's convention for C++ extension builds), or None if unset."""
    raw = os.environ.get(TORCH_EXTENSIONS_VAR)
    if not raw:
        return None
    try:
        return Path(raw).expanduser()
    except RuntimeError as exc:
        raise KnobError(f"Unable to use {TORCH_EXTENSIONS_VAR}={raw!r}: {exc} (expected a path)") from None


def extensions_dir() -> Path:
    """Where native kernels are built: ``TORCH_EXTENSIONS_DIR``, else ``$XDG_CACHE_HOME`` (or
    ``~/.cache``)/offload-autotune/ext.

    Independent of ``OFFLOAD_AUTOTUNE_CACHE`` on purpose: a cache path of ``/dev/null`` or
    ``c.json`` once put the build in ``/dev/ext/`` or a silent rebuild in ``./ext/``.
    """
    return torch_extensions_dir() or _cache_home() / "ext"


def local_world_size() -> int | None:
    """``LOCAL_WORLD_SIZE`` as set by torchrun: ranks on this node, or None outside a launcher."""
    return _positive_int("LOCAL_WORLD_SIZE")


def local_rank() -> int | None:
    """``LOCAL_RANK`` as set by torchrun, or None outside a launcher."""
    return _int("LOCAL_RANK", minimum=0)


def node_local_rank() -> int:
    """``LOCAL_RANK`` (0 when unset), checked to be below ``LOCAL_WORLD_SIZE`` when that is set:
    a :class:`KnobError` naming both, where a launcher would otherwise get torch's traceback."""
    rank = local_rank()
    size = local_world_size()
    if rank is not None and size is not None and rank >= size:
        raise KnobError(
            f"Unable to use LOCAL_RANK={rank} with LOCAL_WORLD_SIZE={size}: expected LOCAL_RANK "
            f"from 0 to {size - 1}"
        )
    return rank or 0


def omp_num_threads() -> int | None:
    """``OMP_NUM_THREADS`` (torchrun sets 1); only reported, never obeyed over an explicit plan."""
    return _positive_int("OMP_NUM_THREADS")


#: Prefixes of environment variables that change how a step runs (OpenMP's threads, spinning and
#: binding; Intel's and GNU's OpenMP runtimes; glibc's allocator): a setting tuned under one value
#: is not the optimum under another, so they are part of the tuning cache key.
STEP_ENV_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MALLOC_")


def step_environment() -> dict[str, str]:
    """The set variables of :data:`STEP_ENV_PREFIXES`, by name (read as they are, never parsed)."""
    return {k: os.environ[k] for k in sorted(os.environ) if k.startswith(STEP_ENV_PREFIXES)}
