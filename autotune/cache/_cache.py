"""``TuningCache``: a locked, atomic, merging JSON cache of tuning results.

File format (JSON only, never pickle)::

    {"schema": 1, "entries": {"<fingerprint key>": {<entry>}, ...}}

An entry is what the tuner locked in for one fingerprint, a :class:`CacheEntry`
(:mod:`autotune.cache._entry`, which alone spells its JSON form and checks its values).

Guarantees (the file primitives live in :mod:`autotune.cache._cachefile`):

- Reads take no lock: writers only ever ``os.replace`` a complete, fsynced temp file.
- Writes take an exclusive ``fcntl.flock`` on the sidecar ``<path>.lock`` (polled, with a timeout:
  on timeout the write is skipped with a warning, never a deadlock), re-read the file, merge, and
  replace it: entries written meanwhile by other processes survive. A writer killed mid-write
  leaves the old file intact; the next writer removes its half-written temp file.
- Bad input is a warning and a miss, never a crash. A corrupt file is renamed aside
  (``cache.json.bad-<ts>``); when some entries are bad, a copy is kept aside and the valid ones
  rewritten. A file with a newer schema is never overwritten, read or written.
- An unusable location (unwritable, a path below a regular file) warns and continues without
  persisting; a path that is not a regular file is a miss, never written, renamed or locked
  beside; a symlink is written through (the rename happens in the target's directory).

Entries are checked for type only here (``validate_entry``); whether a cached setting belongs to
the search space and is allowed on this machine is checked by the tuner, which knows the space.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from autotune import knobs
from autotune.cache._cachefile import atomic_write_bytes, bad_path, exclusive_lock, kind, read_regular
from autotune.cache._entry import CacheEntry, CacheEntryError, validate_entry

__all__ = ["CacheEntry", "TuningCache", "CacheEntryError", "CacheWriteError", "SCHEMA_VERSION", "validate_entry"]

logger = logging.getLogger(__name__)

#: Version of the file layout this module reads and writes.
SCHEMA_VERSION = 1
#: Seconds a writer waits for the file lock before it gives up (and skips persisting).
DEFAULT_LOCK_TIMEOUT_S = 10.0
#: Files larger than this are not parsed (a cache holds a few KiB per machine and workload).
MAX_FILE_BYTES = 32 << 20

_State = Literal["missing", "ok", "partial", "corrupt", "newer", "unreadable", "special"]


# --------------------------------------------------------------------------------------------
# Reading


@dataclass
class _Snapshot:
    """What one read of the cache file found."""

    state: _State
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    schema: int | None = None


def _parse(raw: bytes) -> _Snapshot:
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError covers bad JSON and integers beyond Python's str->int digit limit.
        return _Snapshot("corrupt", problems=[f"not valid UTF-8 JSON ({type(exc).__name__}: {exc})"])
    if not isinstance(doc, dict):
        return _Snapshot("corrupt", problems=[f"top level is a {type(doc).__name__}, expected an object"])
    schema = doc.get("schema")
    if isinstance(schema, bool) or not isinstance(schema, int):
        return _Snapshot("corrupt", problems=[f"schema={schema!r}: expected the int {SCHEMA_VERSION}"])
    if schema > SCHEMA_VERSION:
        return _Snapshot("newer", schema=schema)
    if schema != SCHEMA_VERSION:
        return _Snapshot("corrupt", problems=[f"schema={schema!r}: expected {SCHEMA_VERSION}"])
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        return _Snapshot("corrupt", problems=[f"entries is a {type(entries).__name__}, expected an object"])
    snap = _Snapshot("ok", schema=schema)
    for key, entry in entries.items():
        try:
            validate_entry(entry)
        except (CacheEntryError, RecursionError) as exc:
            snap.problems.append(f"entry {key[:16]!r}: {type(exc).__name__}: {exc}")
            continue
        snap.entries[key] = entry
    if snap.problems:
        snap.state = "partial"
    return snap


class CacheWriteError(OSError):
    """A change asked for with ``strict=True`` was not persisted; the message says why."""


class TuningCache:
    """A JSON file of tuning results keyed by fingerprint, safe across processes.

    Args:
        path: the cache file; default ``autotune.knobs.cache_path()`` (``OFFLOAD_AUTOTUNE_CACHE``
            or the user's cache directory).
        lock_timeout_s: how long a write waits for the file lock before skipping persistence.
        source: where ``path`` came from, named in the warning about a path that cannot be a
            cache (default: the ``TuningCache`` argument, or ``OFFLOAD_AUTOTUNE_CACHE``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
        source: str | None = None,
    ) -> None:
        timeout = lock_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ValueError(f"lock_timeout_s={lock_timeout_s!r}: expected a number of seconds >= 0")
        self.path = Path(path).expanduser() if path is not None else knobs.cache_path()
        if "\0" in str(self.path):
            raise ValueError(f"TuningCache path={str(self.path)!r}: a path cannot contain a NUL byte")
        self.lock_timeout_s = float(lock_timeout_s)
        self._failure: str | None = None  # why the latest _mutate did not persist
        self._quiet = False  # strict callers get the failure raised, not logged
        if source is None:
            source = "the TuningCache path" if path is not None else knobs.CACHE_VAR
        self.source = source
        """Where :attr:`path` came from (named in warnings)."""
        self._warned_special = False  # a path that cannot be a cache is said once

    def __repr__(self) -> str:
        return f"TuningCache({str(self.path)!r})"

    @property
    def target(self) -> Path:
        """The file the cache reads and replaces: :attr:`path` with symlinks resolved (now)."""
        return Path(os.path.realpath(self.path))

    @property
    def lock_path(self) -> Path:
        target = self.target
        return target.with_name(target.name + ".lock")

    def file_problem(self) -> str | None:
        """Why :attr:`path` holds no cache file: ``"does not exist"``, ``"is a FIFO, not a
        regular file"``, ...; None when it is a regular file. Never opens the path."""
        try:
            mode = os.stat(self.path).st_mode
        except FileNotFoundError:
            return "does not exist" if not os.path.islink(self.path) else "is a dangling symlink"
        except OSError as exc:
            return f"cannot be examined ({exc.strerror or exc})"
        if stat.S_ISREG(mode):
            return None
        return f"is {kind(mode)}, not a regular file"

    # -- public API ----------------------------------------------------------------------------

    def get(self, key: str) -> dict[str, Any] | None:
        """The entry stored under ``key`` (a deep copy), or None on a miss or bad input."""
        _check_key(key)
        snap = self._read_checked()
        entry = snap.entries.get(key)
        return copy.deepcopy(entry) if entry is not None else None

    def entries(self, *, repair: bool = True) -> dict[str, dict[str, Any]]:
        """All valid entries, keyed by fingerprint key (deep copies).

        ``repair=False`` (inspection, ``python -m autotune show``) only reads and warns: a corrupt
        file or bad entries are not set aside, no file is changed.
        """
        return copy.deepcopy(self._read_checked(repair=repair).entries)

    def records(self, *, repair: bool = True) -> dict[str, CacheEntry]:
        """All valid entries as :class:`CacheEntry` records, keyed by fingerprint key; bad input
        is warned about and left out (and ``repair``-ed) exactly as by :meth:`entries`."""
        return {key: CacheEntry.from_json(entry) for key, entry in self._read_checked(repair=repair).entries.items()}

    def put(self, key: str, entry: Mapping[str, Any] | CacheEntry) -> bool:
        """Store ``entry`` under ``key``, merging with entries other processes wrote meanwhile.

        Returns True when persisted; False (after a warning) when the location is unusable, the
        lock timed out or the file has a newer schema. Raises :class:`CacheEntryError` when
        ``entry`` lacks the documented structure: that is a bug in the caller, not bad input.
        """
        _check_key(key)
        value = entry.to_json() if isinstance(entry, CacheEntry) else copy.deepcopy(dict(entry))
        validate_entry(value)

        def store(entries: dict[str, dict[str, Any]]) -> bool:
            entries[key] = value
            return True

        return self._mutate(store, f"store entry {key[:16]!r}")

    def delete(self, key: str, *, strict: bool = False) -> bool:
        """Remove ``key``; True when it was present and the file was rewritten.

        ``strict=True``: raise :class:`CacheWriteError` (instead of warning) when the file could
        not be rewritten.
        """
        _check_key(key)
        found: list[bool] = []

        def drop(entries: dict[str, dict[str, Any]]) -> bool:
            found.append(entries.pop(key, None) is not None)
            return found[-1]

        return self._strictly(strict, drop, f"delete entry {key[:16]!r}") and found == [True]

    def clear(self, *, strict: bool = False) -> int:
        """Remove every entry; returns how many were removed (0 also when nothing could be written).

        ``strict=True``: raise :class:`CacheWriteError` (instead of warning and returning 0) when
        nothing could be written, e.g. a read-only cache.
        """
        removed: list[int] = []

        def wipe(entries: dict[str, dict[str, Any]]) -> bool:
            removed.append(len(entries))
            entries.clear()
            return True

        if not self._strictly(strict, wipe, "clear the cache"):
            return 0
        return removed[0] if removed else 0

    def _strictly(self, strict: bool, change: Callable[[dict[str, dict[str, Any]]], bool], action: str) -> bool:
        """:meth:`_mutate`, raising CacheWriteError with the reason instead of warning when ``strict``."""
        self._quiet = strict
        try:
            done = self._mutate(change, action)
        finally:
            self._quiet = False
        if strict and not done:
            reason = (self._failure or f"Cannot {action}: {self.path} was not written")
            raise CacheWriteError(reason.removesuffix("; continuing without persisting"))
        return done

    def _cannot(self, message: str, *args: Any) -> None:
        """Record (and, unless a strict caller raises it, log) why a change was not persisted."""
        self._failure = message % args
        if not self._quiet:
            logger.warning("%s", self._failure)

    def bad_files(self) -> list[Path]:
        """Files kept aside because they were corrupt, oldest first."""
        target = self.target
        with contextlib.suppress(OSError):
            return sorted(target.parent.glob(target.name + ".bad-*"))
        return []

    # -- reading -------------------------------------------------------------------------------

    def _read(self) -> _Snapshot:
        raw = read_regular(self.target, max_bytes=MAX_FILE_BYTES)
        if raw.state == "ok":
            return _parse(raw.data)
        state: _State = "corrupt" if raw.state == "too_large" else raw.state
        return _Snapshot(state, problems=[raw.problem] if raw.problem is not None else [])

    def _read_checked(self, *, repair: bool = True) -> _Snapshot:
        """Read, warn about bad input and (``repair``) set bad files aside (best effort, under the lock)."""
        snap = self._read()
        if snap.state == "newer":
            logger.warning(
                "Tuning cache %s has schema %s, newer than this version's %s: ignoring it (not "
                "overwritten; upgrade the package or point OFFLOAD_AUTOTUNE_CACHE elsewhere)",
                self.path, snap.schema, SCHEMA_VERSION,
            )
        elif snap.state == "unreadable":
            logger.warning("Tuning cache %s cannot be read, treating it as empty: %s", self.path, snap.problems[0])
        elif snap.state == "special":
            self._warn_special(snap.problems[0])
        elif snap.state in ("corrupt", "partial"):
            self._warn_bad(snap)
            if repair:
                self._mutate(None, "set the bad cache file aside")
        return snap

    def _warn_special(self, problem: str) -> None:
        if self._warned_special:
            return
        self._warned_special = True
        logger.warning(
            "Tuning cache %s: %s; never read, written or renamed: every lookup is a miss and nothing "
            "is persisted (point %s at a regular file)",
            self.path, problem, self.source,
        )

    def _warn_bad(self, snap: _Snapshot) -> None:
        what = "is corrupt" if snap.state == "corrupt" else f"has {len(snap.problems)} bad entries"
        logger.warning(
            "Tuning cache %s %s; treating the bad part as a miss: %s",
            self.path, what, "; ".join(snap.problems[:3]),
        )

    # -- writing -------------------------------------------------------------------------------

    def _mutate(self, change: Callable[[dict[str, dict[str, Any]]], bool] | None, action: str) -> bool:
        """Lock, re-read, set bad input aside, apply ``change`` and write; False if not persisted.

        ``change`` edits the entries in place and returns whether it changed anything;
        ``change=None`` only repairs (sets bad input aside and rewrites the valid entries).
        """
        self._failure = None
        problem = self.file_problem()
        if problem is not None and problem.endswith("not a regular file"):
            self._failure = f"cannot {action}: {self.path} {problem}"
            if not self._quiet:
                self._warn_special(f"it {problem}")  # no lock file beside it either
            return False
        target = self.target
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._cannot("Cannot %s: tuning cache %s is unusable: its directory %s cannot be created (%s); "
                         "continuing without persisting", action, self.path, target.parent, exc.strerror or exc)
            return False
        with self._locked(action) as locked:
            if not locked:
                return False
            self._remove_stale_temp_files()
            snap = self._read()
            if snap.state == "special":  # became one since the check above
                self._failure = f"cannot {action}: {self.path}: {snap.problems[0]}"
                if not self._quiet:
                    self._warn_special(snap.problems[0])
                return False
            if snap.state == "newer":
                self._cannot("Cannot %s: %s has schema %s, newer than %s; leaving it untouched",
                               action, self.path, snap.schema, SCHEMA_VERSION)
                return False
            if snap.state == "unreadable":
                self._cannot("Cannot %s: %s is unreadable (%s)", action, self.path, snap.problems[0])
                return False
            rewrite = False
            if snap.state == "corrupt":
                # Renamed away: no file is a valid empty cache, so only a change needs a write.
                if not self._set_aside(rename=True):
                    return False
            elif snap.state == "partial":
                if not self._set_aside(rename=False):
                    return False
                rewrite = True  # drop the bad entries from the live file
            entries = snap.entries
            if change is not None and change(entries):
                rewrite = True
            return self._write(entries, action) if rewrite else True

    @contextlib.contextmanager
    def _locked(self, action: str) -> Iterator[bool]:
        with exclusive_lock(self.lock_path, timeout_s=self.lock_timeout_s) as problem:
            if problem is not None:
                self._cannot("Cannot %s: tuning cache %s %s; continuing without persisting", action, self.path, problem)
            yield problem is None

    def _temp_prefix(self) -> str:
        return f".{self.target.name}.tmp-"

    def _remove_stale_temp_files(self) -> None:
        # Only the lock holder creates temp files, so any found now belong to a dead writer.
        with contextlib.suppress(OSError):
            for stale in self.target.parent.glob(self._temp_prefix() + "*"):
                with contextlib.suppress(OSError):
                    stale.unlink()
                    logger.info("Removed %s left by a writer that died mid-write", stale)

    def _set_aside(self, *, rename: bool) -> bool:
        """Keep the current (bad) file as ``<name>.bad-<ts>``: renamed, or copied when ``rename`` is False."""
        target = bad_path(self.target)
        source = self.target
        try:
            if not stat.S_ISREG(os.lstat(source).st_mode):  # only a regular file is ever moved
                raise OSError(f"{source} is no longer a regular file")
            if rename:
                os.replace(source, target)
            else:
                with open(source, "rb") as src:
                    raw = src.read(MAX_FILE_BYTES + 1)
                atomic_write_bytes(target, raw, temp_prefix=self._temp_prefix())
        except OSError as exc:
            self._cannot("Could not keep the bad cache file %s aside as %s (%s); leaving it in place",
                         self.path, target, exc)
            return False
        logger.warning("Kept the bad cache file aside as %s", target)
        return True

    def _write(self, entries: dict[str, dict[str, Any]], action: str) -> bool:
        doc = {"schema": SCHEMA_VERSION, "entries": entries}
        data = (json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")
        try:
            atomic_write_bytes(self.target, data, temp_prefix=self._temp_prefix())
        except OSError as exc:
            self._cannot("Cannot %s: writing %s failed (%s); continuing without persisting", action, self.path, exc)
            return False
        return True

def _check_key(key: Any) -> None:
    if not isinstance(key, str) or not key:
        raise TypeError(f"cache key={key!r}: expected a non-empty str (a fingerprint key)")
