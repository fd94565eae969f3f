"""The README's and docs' examples run: every ```python block of README.md and docs/*.md executes
(docs/integrations.md's in test_integrations_doc.py, with its clients), every command they show
parses with the real command-line parsers (the runs themselves are exercised by test_train.py and
the benchmark tests), and their relative links point at files and headings that exist."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
from _forked import run_python

REPO = Path(__file__).absolute().parents[1]
README = REPO / "README.md"
#: Docs whose python blocks run elsewhere or are not programs.
NOT_HERE = {
    "integrations.md": "test_integrations_doc.py runs its blocks (they need the framework clients)",
    "architecture.md": "its one python block is an interface sketch with elided arguments",
}
DOCS = sorted(p for p in (REPO / "docs").glob("*.md") if p.name not in NOT_HERE)
#: Every file whose commands and links are checked here.
CHECKED = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "results" / "README.md"]
#: Linked files another change is still writing: their links are checked once they exist.
PENDING = {REPO / "tests" / "README.md": "tests/README.md is being written (issue 22)"}


def _blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


EXAMPLES = [(path, i) for path in (README, *DOCS) for i in range(len(_blocks(path, "python")))]


@pytest.mark.slow  # a fresh interpreter per block, each reusing the kernel the session built
@pytest.mark.parametrize(("path", "index"), EXAMPLES, ids=[f"{p.relative_to(REPO)}-{i}" for p, i in EXAMPLES])
def test_python_example_runs(path: Path, index: int, tmp_path: Path, kernel_build_dir: Path) -> None:
    code = _blocks(path, "python")[index]
    # This process's PATH: the ninja that built the session's kernel (another ninja version, as
    # /usr/bin's 1.11 beside the venv's 1.13, finds its log foreign and rebuilds it, ~30 s).
    env = {"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "XDG_CACHE_HOME": str(tmp_path / "xdg"), "TORCH_EXTENSIONS_DIR": str(kernel_build_dir)}
    proc = run_python(["-c", code], cwd=tmp_path, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Each example prints what its comments promise.
    if "opt.tuner.state" in code or "TuningSession(" in code:
        assert proc.stdout.split()[0] == "locked", proc.stdout
    else:
        assert "OffloadSettings(threads=" in proc.stdout and "True" in proc.stdout.splitlines()[-1]


def test_every_doc_example_is_run_somewhere() -> None:
    for path in (REPO / "docs").glob("*.md"):
        if _blocks(path, "python"):
            assert path in DOCS or path.name in NOT_HERE, path


def test_readme_installs_pinned_torch_first_and_shows_the_trainer_and_the_ci_command() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200, "README.md is the onboarding page: at most 200 lines"
    bash = _blocks(README, "bash")
    assert bash[0].splitlines() == [
        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
        'pip install -c constraints.txt -e ".[plot]"',
    ]
    assert text.index("```bash") < len("\n".join(text.splitlines()[:40])), "install in the first screen"
    assert sum("-m bench.train" in line and "--autotune" in line and "--cache" in line
               for line in "".join(bash).splitlines()) >= 2  # the trainer, twice on one cache
    assert any(b.strip() == "bash .ci/run" for b in bash)
    ci = (REPO / ".ci" / "run").read_text()
    assert "python -m pytest -q" in ci and "torch==2.13.0" in ci
    for path in CHECKED:  # torch is pinned wherever it is installed
        for line in re.findall(r"pip install[^`\n]*", path.read_text(encoding="utf-8")):
            if re.search(r"\btorch\b(?!titan)", line):
                assert "torch==2.13.0" in line, (path.name, line)


def _commands(path: Path) -> list[str]:
    """The commands a file shows: each line of its bash blocks (split at ``&&``) and every inline
    ``python -m ...`` / ``torchrun ...`` code span, except spans in usage notation (``a|b``,
    ``[--flag]``, ``...``)."""
    text = path.read_text(encoding="utf-8")
    found = [part for block in _blocks(path, "bash") for line in block.splitlines() for part in line.split("&&")]
    prose = re.sub(r"```.*?```", "", text, flags=re.S).replace("\n", " ")
    spans = re.findall(r"`((?:python3? -m|torchrun) [^`]+)`", prose)
    return found + [s for s in spans if not re.search(r"\||\[|\.\.\.", s)]


def _parse(argv: list[str]) -> bool:
    """Parse ``argv`` with the parser of the module it runs; False if it runs none of ours."""
    if "-m" not in argv:
        return False
    module, rest = argv[argv.index("-m") + 1], argv[argv.index("-m") + 2 :]
    if not re.fullmatch(r"[\w.]+", module) or not rest:  # output ("python -m bench.train: ..."), a name
        return False
    if module == "autotune":
        from autotune.report._cli import _parser  # noqa: PLC0415

        _parser().parse_args(rest)
        return True
    if module == "bench.train":
        from bench.train import _main as train  # noqa: PLC0415
        from bench.train._args import check_args  # noqa: PLC0415

        parser = train.build_parser()
        args = parser.parse_args(rest)
        if args.device != "cuda":  # check_args refuses --device cuda on a machine without one
            check_args(parser, args)
        return True
    if module == "bench" or module.startswith("bench."):
        from bench._cli import command_module  # noqa: PLC0415

        mod = command_module("bench.suite" if module == "bench" else module)
        build = getattr(mod, "build_parser", None)
        if build is None:  # parses inside main() only
            return False
        build().parse_args(rest)
        return True
    return False


@pytest.mark.parametrize("path", CHECKED, ids=[str(p.relative_to(REPO)) for p in CHECKED])
def test_shown_commands_parse(path: Path) -> None:
    seen = 0
    for command in _commands(path):
        argv = shlex.split(command, comments=True)
        try:
            seen += _parse(argv)
        except SystemExit as exc:  # argparse's exit: 0 after --help, 2 on an error
            if exc.code != 0:
                raise AssertionError(f"{path.name}: {command!r} does not parse") from exc
            seen += 1
    if path == README:
        assert seen >= 4


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("path", CHECKED, ids=[str(p.relative_to(REPO)) for p in CHECKED])
def test_relative_links_resolve(path: Path) -> None:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    pending = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if dest in PENDING and not dest.exists():
            pending.append(PENDING[dest])
            continue
        assert dest.exists(), f"{path.name}: link to {target} (no such file)"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{path.name}: link to {target} (no such heading)"
    if pending:
        pytest.skip("; ".join(sorted(set(pending))))
