"""The ``main()`` the benchmarks share: parse, resolve the defaults that depend on other flags,
pick the result folder, configure logging, run, and write ``<name>.json`` and ``<name>.md``.

A benchmark supplies its parser, its ``run(args, argv)`` and, where it writes a report, the
function that renders it; its ``main`` is one call of :func:`bench_main`. Value errors found
after parsing go through ``parser.error`` in the ``resolve`` hook, before any folder is made,
so every benchmark refuses a bad value the same way (one usage line, exit status 2).
"""

from __future__ import annotations

import argparse
import importlib
import logging
from types import ModuleType
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from bench._args import resolve_out_dir
from bench._stats import atomic_write_json, atomic_write_text

__all__ = ["LOG_FORMAT", "bench_main", "command_module", "write_results"]

#: The benchmarks' log line (stderr; stdout carries the report).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

Result = dict[str, Any]


def command_module(name: str) -> ModuleType:
    """The module whose ``main`` ``python -m <name>`` runs: ``<name>`` itself, or a command package's
    ``_main`` (``bench.simulate`` -> ``bench.simulate._main``)."""
    module = importlib.import_module(name)
    return importlib.import_module(f"{name}._main") if hasattr(module, "__path__") else module


def write_results(out_dir: Path, name: str, result: Result, markdown: str) -> tuple[Path, Path]:
    """Write ``<out_dir>/<name>.json`` and ``.md`` atomically, print the report and both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = atomic_write_json(out_dir / f"{name}.json", result)
    md_path = atomic_write_text(out_dir / f"{name}.md", markdown)
    print(markdown, end="" if markdown.endswith("\n") else "\n", flush=True)
    print(f"wrote {json_path} and {md_path}", flush=True)
    return json_path, md_path


def bench_entry(*, build_parser: Callable[[], argparse.ArgumentParser],
                run: Callable[[argparse.Namespace, list[str]], Result],
                resolve: Callable[[argparse.ArgumentParser, argparse.Namespace], object] | None = None,
                render_markdown: Callable[[Result], str] | None = None,
                log_level: str = "INFO") -> Callable[[Sequence[str] | None], int]:
    """A benchmark module's ``main(argv=None) -> 0``: :func:`bench_main` with these parts."""

    def main(argv: Sequence[str] | None = None) -> int:
        bench_main(argv, build_parser=build_parser, run=run, resolve=resolve, render_markdown=render_markdown,
                   log_level=log_level)
        return 0

    return main


def bench_main(argv: Sequence[str] | None, *, build_parser: Callable[[], argparse.ArgumentParser],
               run: Callable[[argparse.Namespace, list[str]], Result],
               resolve: Callable[[argparse.ArgumentParser, argparse.Namespace], object] | None = None,
               render_markdown: Callable[[Result], str] | None = None,
               log_level: str = "INFO") -> Result:
    """One benchmark run from its command line (``sys.argv[1:]`` when ``argv`` is None).

    ``resolve(parser, args)`` fills in defaults and refuses bad values (``parser.error``);
    ``args.out_dir`` is then ``--out-dir`` or a new ``runs/bench/<args.name>-N``. Logging goes to
    stderr at ``args.log_level`` where the benchmark has that flag, else ``log_level``. With
    ``render_markdown``, the result is written next to its report (:func:`write_results`);
    without it, ``run`` writes its own files. Returns ``run``'s result.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if resolve is not None:
        resolve(parser, args)
    resolve_out_dir(args, args.name)
    logging.basicConfig(level=getattr(args, "log_level", log_level), format=LOG_FORMAT, stream=sys.stderr)
    result = run(args, argv)
    if render_markdown is not None:
        write_results(args.out_dir, args.name, result, render_markdown(result))
    return result
