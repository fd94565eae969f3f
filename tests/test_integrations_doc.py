"""docs/integrations.md's examples run: every ```python block executes in a fresh interpreter and
prints "ok" last (``sh`` blocks are install commands)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from _client_util import require
from _dist_util import free_port
from _forked import run_python

REPO = Path(__file__).absolute().parents[1]
DOC = (REPO / "docs" / "integrations.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```python\n(.*?)```", DOC, flags=re.S)
CLIENTS = ("transformers", "accelerate", "lightning", "torchtitan", "deepspeed")


@pytest.mark.slow  # a fresh interpreter per block, each reusing the kernel the session built
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_example_runs(index: int, tmp_path: Path, kernel_build_dir: Path) -> None:
    code = BLOCKS[index]
    for name in CLIENTS:
        if re.search(rf"^(import|from) {name}\b", code, flags=re.M):
            require(name)
    # This process's PATH first (the ninja that built the session's kernel: another version
    # rebuilds it), then the venv's bin, so DeepSpeed's JIT builds find a ninja in any case.
    path = os.pathsep.join([os.environ.get("PATH", "/usr/bin:/bin"), str(Path(sys.executable).parent)])
    env = {"PYTHONPATH": str(REPO), "PATH": path,
           "XDG_CACHE_HOME": str(tmp_path / "xdg"),
           "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "TORCH_EXTENSIONS_DIR": str(kernel_build_dir),
           # An example that sets up its own world of one takes this port (os.environ.setdefault):
           # its shown default, a fixed port, can be taken on a shared machine.
           "MASTER_PORT": str(free_port())}
    proc = run_python(["-c", code], cwd=tmp_path, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "ok", proc.stdout[-2000:]


def test_every_client_has_a_section() -> None:
    assert len(BLOCKS) == 7
    for title in ("## HF Trainer", "## accelerate", "## Lightning", "## torchtitan", "## prime-rl",
                  "## An in-house offload optimizer, tuned", "## DeepSpeed ZeRO-Offload",
                  "## What is tuned, per stack"):
        assert title in DOC
