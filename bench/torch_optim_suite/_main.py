"""PyTorch's own optimizer tests (``test/test_optim.py``, the AdamW cases, CPU) against CPUOffloadAdamW.

    python -m bench.torch_optim_suite --test-optim /tmp/test_optim.py
    python -m bench.torch_optim_suite --test-optim /tmp/test_optim.py --runs offload   # ours only

torch's test file is torch's code and is not in the wheel: download the ``test/test_optim.py`` of
the torch you run (its ``optim_db`` comes from the installed ``torch.testing._internal``, which
needs ``expecttest``) and pass its path. It is run where it lies, as torch's tests are run:
``python -m pytest <file> -k AdamW`` with ``PYTORCH_TESTING_DEVICE_ONLY_FOR=cpu``, plus
``-p bench.torch_optim_suite._plugin`` (which puts the optimizer under test into ``optim_db``),
``--noconftest`` (torch's CI conftest is not needed) and stand-ins for the three sibling modules
it imports classes from (``optim.test_lrscheduler``, ``optim.test_optim``, ``optim.test_swa_utils``:
other test classes, none of them AdamW cases) unless those lie beside it.

Each of ``--runs`` is one pytest process: ``torch`` (optim_db unchanged: what torch passes),
``torch-filtered`` (torch.optim.AdamW through our filter: the filter alone must fail nothing) and
``offload`` (CPUOffloadAdamW through the filter). The filter, what CPUOffloadAdamW refuses by
design and where that is documented, is written down in ``bench/torch_optim_suite/_filter.py``; a test
skipped by it says which entry and what CPUOffloadAdamW raised. The table has one row per test
torch runs: ``passed``, ``FAILED`` (with the reason), ``skipped-by-filter``, ``skipped`` (torch's
own skip: CUDA only, memory) or ``not-instantiated`` (the filter's OptimizerInfo leaves it out).
Results go to ``<out-dir>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from bench._args import OUT_DIR_HELP, HelpFormatter, output_dir
from bench._cli import bench_entry
from bench._stats import machine_info
from bench.torch_optim_suite._filter import not_instantiated_reason
from bench.torch_optim_suite._plugin import OPTIMIZERS

__all__ = ["build_parser", "main", "render_markdown", "rows", "run"]

logger = logging.getLogger("bench.torch_optim_suite")

REPO = Path(__file__).resolve().parents[1]
#: The sibling modules test_optim.py imports a class from, and the class.
SIBLINGS = {"test_lrscheduler": "TestLRScheduler", "test_optim": "TestDifferentiableOptimizer",
            "test_swa_utils": "TestSWAUtils"}
#: One pytest run's limit (each took 5-15 s on 2 cores).
RUN_TIMEOUT_S = 1800


def _runs(text: str) -> list[str]:
    runs = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in runs if r not in OPTIMIZERS]
    if not runs or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset of {','.join(OPTIMIZERS)}")
    return runs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.torch_optim_suite", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--test-optim", type=Path, required=True, help="path of a downloaded torch test/test_optim.py")
    p.add_argument("--test-optim-source", default="",
                   help="where that file came from (repository@commit), stored with the results")
    p.add_argument("--runs", type=_runs, default=list(OPTIMIZERS), help="which optimizers to run it with")
    p.add_argument("-k", dest="keyword", default="AdamW", help="pytest -k expression")
    p.add_argument("--out-dir", type=output_dir, default=None, help=OUT_DIR_HELP)
    p.add_argument("--name", default="torch_optim_suite", help="result file stem")
    return p


def _resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.test_optim.is_file():
        p.error(f"--test-optim {args.test_optim}: no such file (download torch's test/test_optim.py)")


def _stubs(root: Path, test_file: Path) -> None:
    """Stand-in ``optim`` package under ``root`` unless the real one lies beside ``test_file``."""
    if (test_file.parent / "optim" / "test_lrscheduler.py").is_file():
        return
    pkg = root / "optim"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for module, cls in SIBLINGS.items():
        (pkg / f"{module}.py").write_text(f'"""Stand-in: no AdamW case lives here."""\n\n\nclass {cls}:\n    pass\n')


def _run_pytest(which: str, test_file: Path, keyword: str, tmp: Path) -> dict[str, Any]:
    report = tmp / f"{which}.json"
    (tmp / "pytest.ini").write_text("[pytest]\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
           "-c", str(tmp / "pytest.ini"), "--rootdir", str(tmp), "-p", "bench.torch_optim_suite._plugin",
           "--optim-suite-optimizer", which, "--optim-suite-report", str(report), "-k", keyword, str(test_file)]
    env = {**os.environ, "PYTORCH_TESTING_DEVICE_ONLY_FOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
           "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp), str(REPO), os.environ.get("PYTHONPATH")]))}
    logger.info("%s: %s", which, " ".join(cmd))
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    wall_s = time.perf_counter() - start
    if not report.is_file():
        raise RuntimeError(f"pytest ({which}) wrote no report (exit {proc.returncode}):\n{proc.stdout[-4000:]}"
                           f"\n{proc.stderr[-4000:]}")
    outcomes = json.loads(report.read_text())
    logger.info("%s: exit %d in %.1f s, %d tests", which, proc.returncode, wall_s, len(outcomes))
    return {"command": cmd, "returncode": proc.returncode, "wall_s": wall_s, "outcomes": outcomes,
            "summary": (proc.stdout.strip().splitlines() or [""])[-1]}


def _status(outcome: dict[str, str] | None, test: str) -> tuple[str, str]:
    if outcome is None:
        return "not-instantiated", not_instantiated_reason(test)
    if outcome["outcome"] == "skipped":
        label = "skipped-by-filter" if outcome["reason"].startswith("filtered:") else "skipped"
        return label, outcome["reason"]
    return ("FAILED" if outcome["outcome"] == "failed" else outcome["outcome"]), outcome["reason"]


def _base(test: str, keyword: str) -> str:
    """The test's name without the optimizer/device/dtype suffix (how rows match across runs)."""
    return test.split(f"_{keyword}_", 1)[0] if f"_{keyword}_" in test else test


def rows(runs: dict[str, dict[str, Any]], keyword: str = "AdamW") -> list[dict[str, str]]:
    """One row per test any run ran: each run's status, and the last run's reason."""
    by_run = {which: {o["test"]: o for o in r["outcomes"]} for which, r in runs.items()}
    names = sorted({t for outcomes in by_run.values() for t in outcomes})
    out = []
    for test in names:
        row = {"test": test}
        for which, outcomes in by_run.items():
            row[which], row[f"{which}_reason"] = _status(outcomes.get(test), _base(test, keyword))
        out.append(row)
    return out


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    test_file = args.test_optim.resolve()
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="torch_optim_suite-") as tmp:
        _stubs(Path(tmp), test_file)
        for which in args.runs:
            runs[which] = _run_pytest(which, test_file, args.keyword, Path(tmp))
    table = rows(runs, args.keyword)
    counts = {which: dict(Counter(row[which] for row in table)) for which in args.runs}
    return {"command": "python -m bench.torch_optim_suite " + " ".join(argv),
            "test_optim": str(test_file), "test_optim_sha256": hashlib.sha256(test_file.read_bytes()).hexdigest(),
            "test_optim_source": args.test_optim_source, "torch": torch.__version__,
            "machine": machine_info(), "keyword": args.keyword, "runs": runs, "counts": counts, "rows": table}


def render_markdown(result: dict[str, Any]) -> str:
    runs = list(result["counts"])
    last = "offload" if "offload" in runs else runs[-1]  # whose reasons the table shows
    lines = [f"# torch's test_optim.py (-k {result['keyword']}, CPU) against CPUOffloadAdamW", "",
             f"`{result['command']}`", "",
             f"- test file: `{result['test_optim']}` (sha256 {result['test_optim_sha256'][:16]}...)"
             + (f", from {result['test_optim_source']}" if result["test_optim_source"] else ""),
             f"- torch {result['torch']}; the filter: `bench/torch_optim_suite/_filter.py`", ""]
    for which in runs:
        counts = ", ".join(f"{n} {status}" for status, n in sorted(result["counts"][which].items()))
        lines.append(f"- **{which}**: {counts} ({result['runs'][which]['wall_s']:.0f} s)")
    lines += ["", "| test | " + " | ".join(runs) + f" | reason ({last}) |",
              "|---|" + "---|" * len(runs) + "---|"]
    for row in result["rows"]:
        reason = row[f"{last}_reason"].replace("|", "\\|").replace("\n", " ")
        reason = reason if len(reason) <= 300 else reason[:297] + "..."
        lines.append(f"| `{row['test']}` | " + " | ".join(row[w] for w in runs) + f" | {reason} |")
    return "\n".join(lines) + "\n"


main = bench_entry(build_parser=build_parser, run=run, resolve=_resolve, render_markdown=render_markdown)
