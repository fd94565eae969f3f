"""Where the native kernel is built (``TORCH_EXTENSIONS_DIR``, else under ``XDG_CACHE_HOME``, never
beside the tuning cache), when it needs a build, and the one line a first build logs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from autotune import knobs
from offload._settings import extensions_dir
from offload.testing import KernelLoader
from offload.kernels._build import build_spec, needs_build


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
