"""Command-line value parsers, the help formatter and the result directory shared by the benchmarks.

Results go to a new ``runs/bench/<name>-N`` (under the current directory) unless ``--out-dir``
names a folder: the committed results in ``bench/results`` are replaced only on purpose
(``--out-dir bench/results``), never by a quick try of a README command.

Output paths given on a command line (``--out-dir``, ``--trace-dir``, ``--summary-json``, ...)
are checked as they are parsed (:func:`output_dir`, :func:`output_file`): missing folders are
created below the current directory (``runs/demo`` in a fresh checkout), elsewhere only the last
one, so a mistyped absolute path is one usage line instead of a new folder tree under ``/``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from offload._settings import MAX_THREADS

__all__ = ["OUT_DIR_HELP", "PATH_RULE", "RUNS_ROOT", "HelpFormatter", "int_list", "new_result_dir",
           "output_dir", "output_file", "resolve_out_dir", "thread_list"]

#: Where results go without --out-dir: one new numbered folder per run below it.
RUNS_ROOT = Path("runs") / "bench"
#: How output paths are created (see the module docstring), for --help texts.
PATH_RULE = "missing folders are made below the current directory; elsewhere its parent must exist"
OUT_DIR_HELP = ("where the result files go (default: a new runs/bench/<name>-N; the committed results "
                f"are replaced only with --out-dir bench/results; {PATH_RULE})")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` once: only where the help text does not already say its default
    (flags whose default depends on others, such as ``--quick``, write it by hand) and where the
    default means something (not None, a flag's False or an empty string)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default == "" \
                or default is argparse.SUPPRESS or action.help is argparse.SUPPRESS:
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


def _check_creatable(path: Path, text: str) -> None:
    """Refuse ``path`` when making it would make folders outside the current directory above
    its last component (see the module docstring)."""
    absolute = Path(os.path.abspath(path))
    if absolute.parent.is_dir() or absolute.is_dir():
        return
    cwd = Path(os.path.abspath(os.getcwd()))
    if absolute.is_relative_to(cwd):
        return
    raise argparse.ArgumentTypeError(
        f"{text!r}: {absolute.parent} does not exist (missing folders are made only below the current "
        "directory; elsewhere only the last one): create it first or choose another path")


def output_dir(text: str) -> Path:
    """A folder the command will create or write into (see the module docstring)."""
    path = Path(text)
    _check_creatable(path, text)
    return path


def output_file(text: str) -> Path:
    """A file the command will write: its folder as for :func:`output_dir`."""
    path = Path(text)
    if text.endswith(("/", os.sep)) or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: is a folder; expected a file path")
    _check_creatable(path.parent if str(path.parent) else Path("."), text)
    return path


def new_result_dir(name: str, root: Path = RUNS_ROOT) -> Path:
    """Create and return the first free ``<root>/<name>-N`` (N from 1)."""
    root.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        candidate = root / f"{name}-{n}"
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            n += 1


def resolve_out_dir(args: argparse.Namespace, name: str) -> Path:
    """``args.out_dir`` if given, else a new :func:`new_result_dir` (stored back into ``args``)."""
    if args.out_dir is None:
        args.out_dir = new_result_dir(name)
    return args.out_dir


def int_list(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``: comma-separated positive (ASCII) integers."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1 or not text.isascii():
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers")
    return values


def thread_list(text: str) -> list[int]:
    """Thread counts: :func:`int_list` values up to ``offload._settings.MAX_THREADS`` (larger ones
    would reach ``torch.set_num_threads``, which crashes the process on absurd values)."""
    values = int_list(text)
    if max(values) > MAX_THREADS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: thread count {max(values)} is above {MAX_THREADS}: expected 1 to {MAX_THREADS}"
        )
    return values
