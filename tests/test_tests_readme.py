"""tests/README.md is the index of the tests: it names every test file and helper module here, and
every file it names exists (a new file goes into its table, a renamed one is renamed there)."""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).absolute().parent
TEXT = (HERE / "README.md").read_text(encoding="utf-8")


def test_every_test_file_and_helper_is_named() -> None:
    named = set(re.findall(r"`(\w+\.py)`", TEXT))
    files = {p.name for p in HERE.glob("*.py") if p.name.startswith(("test_", "_", "conftest"))}
    files.discard("__init__.py")
    assert not files - named, f"tests/README.md does not name {sorted(files - named)}: add each where it belongs"
    assert not named - files, f"tests/README.md names missing files {sorted(named - files)}"
