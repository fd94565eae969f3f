"""File primitives of the tuning cache, independent of its format: read a regular file without
ever blocking on a special one, replace a file atomically, name a place to keep a bad file aside.

Why these rules: a reader must see the old or the new file, never a torn one (so writers only
``os.replace`` a complete, fsynced temp file); a path that is not a regular file (``/dev/null``, a
FIFO, a socket, a directory) is never opened for writing, and is opened for reading only with
``O_NONBLOCK`` (a FIFO would block a reader forever). Symlinks are resolved by the caller, so the
rename happens in the target's directory and every link to a shared file sees the change.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

try:  # POSIX only; elsewhere writes are atomic but not serialised between processes.
    import fcntl
except ImportError:  # pragma: no cover - not reachable on Linux
    fcntl = None  # type: ignore[assignment]

__all__ = ["RawRead", "atomic_write_bytes", "bad_path", "exclusive_lock", "kind", "read_regular"]

#: Poll interval while waiting for the lock.
LOCK_POLL_S = 0.01

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def kind(mode: int) -> str:
    """``"a FIFO"``, ``"a character device"``, ... for a mode that is not a regular file."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


@dataclass(frozen=True, kw_only=True, slots=True)
class RawRead:
    """What one read of a file found, before any parsing."""

    state: Literal["ok", "missing", "unreadable", "special", "too_large"]
    """``ok``: ``data`` holds the file; otherwise ``problem`` says why not (``missing`` may have none)."""
    data: bytes = b""
    """The file's bytes (``ok`` only)."""
    problem: str | None = None
    """Why the file could not be read, in words."""


def read_regular(path: Path, *, max_bytes: int) -> RawRead:
    """Read ``path`` if it is a regular file of at most ``max_bytes`` bytes."""
    # stat first: a device or FIFO is never even opened. O_NONBLOCK: a FIFO that appears
    # after the stat does not wait for a writer; fstat then tells what was opened.
    with contextlib.suppress(OSError):
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            return RawRead(state="special", problem=f"it is {kind(mode)}, not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return RawRead(state="missing")
    except OSError as exc:  # no permission, a path below a regular file, a symlink loop, ...
        if isinstance(exc, NotADirectoryError):
            return RawRead(state="missing", problem=f"{exc}")
        return RawRead(state="unreadable", problem=f"{type(exc).__name__}: {exc}")
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            return RawRead(state="special", problem=f"it is {kind(mode)}, not a regular file")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        raw = b"".join(chunks)
    except OSError as exc:
        return RawRead(state="unreadable", problem=f"{type(exc).__name__}: {exc}")
    finally:
        os.close(fd)
    if len(raw) > max_bytes:
        return RawRead(state="too_large", problem=f"larger than {max_bytes} bytes")
    return RawRead(state="ok", data=raw)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(target: Path, data: bytes, *, temp_prefix: str) -> None:
    """Replace ``target`` by ``data``: a fsynced temp file ``<temp_prefix><pid>-<ns>`` beside it,
    renamed over it. On any error the temp file is removed and the error raised."""
    tmp = target.parent / f"{temp_prefix}{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)


def bad_path(target: Path) -> Path:
    """A free name beside ``target`` to keep a bad copy of it: ``<name>.bad-<timestamp>[-n]``."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime())
    candidate = target.with_name(f"{target.name}.bad-{stamp}")
    n = 1
    while candidate.exists():
        candidate = target.with_name(f"{target.name}.bad-{stamp}-{n}")
        n += 1
    return candidate


@contextlib.contextmanager
def exclusive_lock(lock_path: Path, *, timeout_s: float) -> Iterator[str | None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if needed), polled for at most
    ``timeout_s``: yields None while held, or why it could not be taken (then nothing is held),
    worded about the file the lock guards, which the caller names: ``"is unusable: its lock file
    ... cannot be opened (...)"``, ``"is busy: its lock file ... stayed locked for 10.0 s"``.
    The kernel releases the lock of a process that dies, so a killed writer never blocks others."""
    if fcntl is None:  # pragma: no cover
        yield None
        return
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        yield f"is unusable: its lock file {lock_path} cannot be opened ({exc.strerror or exc})"
        return
    try:
        problem = _acquire(fd, lock_path, timeout_s)
        try:
            yield problem
        finally:
            if problem is None:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _acquire(fd: int, lock_path: Path, timeout_s: float) -> str | None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            pass
        except OSError as exc:  # e.g. ENOLCK on a file system without flock
            return f"is unusable: locking its lock file {lock_path} failed ({exc.strerror or exc})"
        if time.monotonic() >= deadline:
            return f"is busy: its lock file {lock_path} stayed locked for {timeout_s:.1f} s (another writer holds it)"
        time.sleep(LOCK_POLL_S)
