"""One subdirectory per run under a trace folder, so a second run never overwrites the first.

A trainer given ``--trace-dir runs/demo`` writes its run into ``runs/demo/run-1``, the next run
into ``runs/demo/run-2``, and so on; ``runs/demo/latest`` is a symbolic link to the newest (where
the file system allows links). ``python -m autotune show --run`` / ``export --run`` / ``plot``
accept either a run directory or the folder above it, which means its newest run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path

from autotune.report._trace import SUMMARY_JSON, TRACE_JSONL

__all__ = ["LATEST", "RUN_PREFIX", "new_run_dir", "resolve_run_dir", "runs_in"]

logger = logging.getLogger(__name__)

RUN_PREFIX = "run-"
LATEST = "latest"
_RUN_NAME = re.compile(rf"^{re.escape(RUN_PREFIX)}(\d+)$")


class RunDirError(OSError):
    """The trace folder cannot hold runs (a regular file, no permission, ...)."""


def runs_in(parent: str | os.PathLike[str]) -> list[Path]:
    """The ``run-N`` subdirectories of ``parent``, oldest (lowest N) first."""
    parent = Path(parent)
    try:
        entries = list(parent.iterdir())
    except OSError:
        return []
    numbered = []
    for entry in entries:
        m = _RUN_NAME.match(entry.name)
        if m and entry.is_dir() and not entry.is_symlink():
            numbered.append((int(m.group(1)), entry))
    return [path for _, path in sorted(numbered)]


def new_run_dir(parent: str | os.PathLike[str]) -> Path:
    """Create the next ``run-N`` under ``parent`` (created if needed) and point ``latest`` at it.

    Raises :class:`RunDirError` naming ``parent`` when it is not a usable directory.
    """
    parent = Path(parent).expanduser()
    if parent.exists() and not parent.is_dir():
        raise RunDirError(f"{parent} exists and is not a directory: expected a folder for the run traces")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        runs = runs_in(parent)
        n = int(_RUN_NAME.match(runs[-1].name).group(1)) + 1 if runs else 1  # type: ignore[union-attr]
        while True:
            path = parent / f"{RUN_PREFIX}{n}"
            try:
                path.mkdir()
                break
            except FileExistsError:  # another run started at the same time, or a stray file
                n += 1
    except OSError as exc:
        raise RunDirError(f"cannot create a run directory under {parent}: {exc.strerror or exc}") from None
    _point_latest(parent, path.name)
    return path


def _point_latest(parent: Path, name: str) -> None:
    """``parent/latest`` -> ``name``, replaced atomically; skipped where links are not allowed."""
    link = parent / LATEST
    if link.exists() and not link.is_symlink():
        logger.debug("%s is not a link; leaving it", link)
        return
    tmp = parent / f".{LATEST}.{os.getpid()}"
    try:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        os.symlink(name, tmp, target_is_directory=True)
        os.replace(tmp, link)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        logger.debug("cannot point %s at %s: %s", link, name, exc)


def resolve_run_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` if it holds a run (``trace.jsonl`` or ``summary.json``), else its newest ``run-N``
    (else ``path`` unchanged, for the caller to report)."""
    path = Path(path).expanduser()
    if (path / TRACE_JSONL).exists() or (path / SUMMARY_JSON).exists():
        return path
    runs = runs_in(path)
    return runs[-1] if runs else path
