"""Where the native kernel is built (``TORCH_EXTENSIONS_DIR``, else under ``XDG_CACHE_HOME``, never
beside the tuning cache), when it needs a build, the one line a first build logs, and the build key:
it hashes the source and every header it includes."""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from autotune import knobs
from offload._settings import extensions_dir
from offload.testing import KernelLoader
from offload.kernels._build import (
    SOURCE,
    build_spec,
    needs_build,
    pip_ninja_on_path,
    source_digest,
    source_files,
)


@pytest.mark.parametrize("cache", ["/dev/null", "c.json", "/somewhere/else/cache.json"])
def test_the_build_directory_ignores_the_cache_path(tmp_path: Path, monkeypatch, cache: str) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("OFFLOAD_AUTOTUNE_CACHE", cache)
    assert extensions_dir() == tmp_path / "xdg" / "offload-autotune" / "ext"
    assert build_spec().build_dir.parent == tmp_path / "xdg" / "offload-autotune" / "ext"


def test_torch_extensions_dir_wins(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("OFFLOAD_AUTOTUNE_CACHE", "/dev/null")
    assert extensions_dir() == tmp_path / "ext"
    assert build_spec().build_dir.parent == tmp_path / "ext"


def test_a_bad_xdg_cache_home_names_the_variable(monkeypatch) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "~no-such-user-xyz/cache")
    with pytest.raises(knobs.KnobError, match="XDG_CACHE_HOME='~no-such-user-xyz/cache'"):
        extensions_dir()


def test_needs_build_until_the_library_is_there(tmp_path: Path) -> None:
    source = tmp_path / "k.cpp"
    source.write_text("// k\n")
    spec = build_spec(source, tmp_path)
    assert needs_build(spec)
    spec.build_dir.mkdir(parents=True)
    (spec.build_dir / f"{spec.name}.so").write_bytes(b"")
    assert not needs_build(spec)


def test_a_build_says_so_before_compiling(tmp_path: Path, caplog) -> None:
    broken = tmp_path / "fused_mp_adamw.cpp"
    broken.write_text('#error "deliberately broken kernel source"\n')
    with caplog.at_level(logging.INFO, logger="offload.kernels._build"):
        module, _ = KernelLoader(broken, tmp_path / "cache").get()
    assert module is None
    lines = [r for r in caplog.records if "building the native AdamW kernel" in r.getMessage()]
    # A warning: a script that configured no logging prints it through the last-resort handler.
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "(first use on this machine, about 30 s; later runs reuse it)" in lines[0].getMessage()
    lines = [r.getMessage() for r in lines]
    assert str(tmp_path / "cache" / "ext") in lines[0]


def test_build_key_tracks_every_header_the_source_includes(tmp_path: Path) -> None:
    """The key hashes the source and, transitively, every header a quoted include names: an edit
    to any of them is a new build, never a stale one reused; a file nothing includes is not read."""
    (tmp_path / "sub").mkdir()
    source = tmp_path / "k.cpp"
    source.write_text('#include "a.h"\n#include <vector>\n')
    (tmp_path / "a.h").write_text('#pragma once\n#if 0\n#include "sub/b.h"\n#endif\n')
    (tmp_path / "sub" / "b.h").write_text('#include "../a.h"\n')  # a loop, read once
    (tmp_path / "unused.h").write_text("// not included\n")
    assert source_files(source) == (source, tmp_path / "a.h", tmp_path / "sub" / "b.h")
    names = {build_spec(source, tmp_path).name}
    digests = {source_digest(source)}
    for path in (source, tmp_path / "a.h", tmp_path / "sub" / "b.h"):
        path.write_text(path.read_text() + "// edited\n")
        names.add(build_spec(source, tmp_path).name)
        digests.add(source_digest(source))
    assert len(names) == 4 and len(digests) == 4, "an edited header kept the key"
    (tmp_path / "unused.h").write_text("// edited\n")
    assert build_spec(source, tmp_path).name in names


def test_build_key_covers_every_file_of_the_kernel(tmp_path: Path) -> None:
    """The real kernel: the key reads every file of ``csrc/`` (so an edit to any header changes
    it, checked one by one on a copy), and the tuning cache's digest does not depend on where the
    checkout is."""
    assert set(source_files(SOURCE)) == set(SOURCE.parent.iterdir()), (
        "a file in csrc/ that the module does not include (or a stray file)")
    copy = tmp_path / "csrc"
    shutil.copytree(SOURCE.parent, copy)
    source = copy / SOURCE.name
    assert source_digest(source) == source_digest(SOURCE)
    first = build_spec(source, tmp_path).name
    for path in sorted(copy.iterdir()):
        before = path.read_bytes()
        path.write_bytes(before + b"// edited\n")
        assert build_spec(source, tmp_path).name != first, f"editing {path.name} kept the key"
        path.write_bytes(before)
    assert build_spec(source, tmp_path).name == first


def test_the_package_data_ships_every_kernel_file() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    data = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["offload"]
    package = SOURCE.parents[2]
    shipped = {p for g in globs for p in package.glob(g)}
    assert set(source_files(SOURCE)) <= shipped, "a kernel file the wheel would not ship"


def test_the_compiler_read_no_file_of_ours_the_key_misses(kernel) -> None:
    """What the build actually read (ninja's record of the compiler's dependencies): every file
    of the package among them is one the key hashes."""
    spec = build_spec()
    if not (spec.build_dir / ".ninja_deps").is_file():
        pytest.skip(f"no ninja dependency log in {spec.build_dir}")
    with pip_ninja_on_path():
        ninja = shutil.which("ninja")
        assert ninja is not None
        out = subprocess.run([ninja, "-C", str(spec.build_dir), "-t", "deps"], capture_output=True,
                             text=True, timeout=60, check=True).stdout
    ours = SOURCE.parents[2]
    read = {Path(line.strip()).resolve() for line in out.splitlines()
            if line.startswith((" ", "\t")) and line.strip()}
    read_of_ours = {p for p in read if ours in p.parents}
    assert read_of_ours, out
    assert read_of_ours <= set(source_files(SOURCE)), read_of_ours - set(source_files(SOURCE))
