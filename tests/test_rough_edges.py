"""Issue 17's first-run rough edges that are not about the CLI or the kernel build."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autotune import AutotuneConfig


def test_config_accepts_path_objects_and_stores_str(tmp_path: Path) -> None:
    config = AutotuneConfig(cache_path=tmp_path / "c.json", trace_dir=tmp_path / "trace")
    assert config.cache_path == str(tmp_path / "c.json") and isinstance(config.cache_path, str)
    assert config.trace_dir == str(tmp_path / "trace") and isinstance(config.trace_dir, str)
    assert config == AutotuneConfig(cache_path=str(tmp_path / "c.json"), trace_dir=str(tmp_path / "trace"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache_path = "other.json"  # type: ignore[misc]
    assert dataclasses.replace(config, trace_dir=Path("t")).trace_dir == "t"


@pytest.mark.parametrize("bad", ["", b"c.json", 3])
def test_config_refuses_other_paths(bad: object) -> None:
    with pytest.raises(ValueError, match="AutotuneConfig.cache_path=.*os.PathLike"):
        AutotuneConfig(cache_path=bad)  # type: ignore[arg-type]
