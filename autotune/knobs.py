"""Every environment variable ``autotune`` reads, in one place, and the parsers a client reads its
own variables with.

Nothing here is read at import time; each accessor reads the environment when called, so tests
and launchers can set variables late. A malformed value raises :class:`KnobError` naming the
variable, the bad value and what was expected. The list is documented in ``docs/environment.md``.

A client package reads its own variables in one module of its own with :func:`read_int` and
:func:`read_path` (so its errors are :class:`KnobError` too, worded the same); the launcher's
(``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) and the cache home (``XDG_CACHE_HOME``) are read here only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "KnobError",
    "CACHE_VAR",
    "cache_path",
    "cache_home",
    "local_world_size",
    "local_rank",
    "node_local_rank",
    "read_int",
    "read_path",
]

#: Path of the tuning cache file (default: ``$XDG_CACHE_HOME/offload-autotune/cache.json``).
CACHE_VAR = "OFFLOAD_AUTOTUNE_CACHE"

#: Only plain ASCII digits: ``int()`` also accepts "٣", "1_000" and surrounding whitespace.
_ASCII_INT = re.compile(r"[0-9]+")
#: More digits than any value this module accepts; longer strings are not converted at all.
_MAX_DIGITS = 18


class KnobError(ValueError):
    """An environment variable holds a value this project cannot use."""


def read_int(name: str, *, minimum: int, maximum: int | None = None) -> int | None:
    """The ASCII integer in the variable ``name`` (surrounding whitespace allowed), or None when
    unset or empty; a :class:`KnobError` naming the variable when it is not one from ``minimum``
    to ``maximum``."""
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


def read_path(name: str) -> Path | None:
    """The path in the variable ``name`` (``~`` expanded), or None when unset or empty; a
    :class:`KnobError` naming the variable when ``~user`` names an unknown user (or there is no
    home directory)."""
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        return Path(raw).expanduser()
    except RuntimeError as exc:  # "~user/..." of an unknown user, or no home directory at all
        raise KnobError(f"Unable to use {name}={raw!r}: {exc} (expected a path)") from None


def cache_home() -> Path:
    """``$XDG_CACHE_HOME`` (or ``~/.cache``)/offload-autotune: the default home of our files."""
    try:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base).expanduser() / "offload-autotune"
    except RuntimeError as exc:  # "~user/..." of an unknown user, or no home directory at all
        value = os.environ.get("XDG_CACHE_HOME", "")
        raise KnobError(f"Unable to use XDG_CACHE_HOME={value!r}: {exc} (expected a path)") from None


def cache_path() -> Path:
    """``OFFLOAD_AUTOTUNE_CACHE``, else ``$XDG_CACHE_HOME`` (or ``~/.cache``)/offload-autotune/cache.json."""
    return read_path(CACHE_VAR) or cache_home() / "cache.json"


def local_world_size() -> int | None:
    """``LOCAL_WORLD_SIZE`` as set by torchrun: ranks on this node, or None outside a launcher."""
    return read_int("LOCAL_WORLD_SIZE", minimum=1)


def local_rank() -> int | None:
    """``LOCAL_RANK`` as set by torchrun, or None outside a launcher."""
    return read_int("LOCAL_RANK", minimum=0)


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


#: Prefixes of environment variables that change how a step runs (OpenMP's threads, spinning and
#: binding; Intel's and GNU's OpenMP runtimes; glibc's allocator): a setting tuned under one value
#: is not the optimum under another, so they are part of the tuning cache key.
STEP_ENV_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MALLOC_")


def step_environment() -> dict[str, str]:
    """The set variables of :data:`STEP_ENV_PREFIXES`, by name (read as they are, never parsed)."""
    return {k: os.environ[k] for k in sorted(os.environ) if k.startswith(STEP_ENV_PREFIXES)}
