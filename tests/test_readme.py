"""The README's examples run: every ```python block executes, and every shell command it shows
parses with the real command-line parsers (the full 2-rank run is exercised by test_train.py)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).absolute().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_example_runs(index: int, tmp_path: Path, kernel_build_dir: Path) -> None:
    code = _blocks("python")[index]
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
                                            "XDG_CACHE_HOME": str(tmp_path / "xdg"),
                                            "TORCH_EXTENSIONS_DIR": str(kernel_build_dir)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Each example prints what its comments promise.
    if "opt.tuner.state" in code:
        assert proc.stdout.split()[0] == "locked", proc.stdout
    else:
        assert "OffloadSettings(threads=" in proc.stdout and "True" in proc.stdout.splitlines()[-1]


def test_readme_has_both_commands_and_ci_runs_the_test_one() -> None:
    bash = _blocks("bash")
    assert any("torchrun" in b and "--autotune" in b for b in bash)
    assert any(b.strip() == "bash .ci/run" for b in bash)
    ci = (REPO / ".ci" / "run").read_text()
    assert "python -m pytest -q" in ci and "torch==2.13.0" in ci


def test_shown_commands_parse() -> None:
    from autotune._cli import _parser as build_parser  # noqa: PLC0415
    from bench import train  # noqa: PLC0415

    seen = 0
    for block in _blocks("bash"):
        for line in block.splitlines():
            for part in line.split("&&"):
                argv = shlex.split(part, comments=True)
                if "bench.train" in argv:
                    train.build_parser().parse_args(argv[argv.index("bench.train") + 1 :])
                    seen += 1
                elif argv[:3] == ["python", "-m", "autotune"]:
                    build_parser().parse_args(argv[3:])
                    seen += 1
    assert seen >= 5
