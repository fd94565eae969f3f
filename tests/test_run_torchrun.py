"""``run_torchrun`` (tests/_dist_util.py, bench/train/_dist.py): a torchrun that times out or is
interrupted leaves no worker behind. torch's launcher starts every worker in its own session, so
``subprocess.run(timeout=)``'s SIGKILL of torchrun alone would leave them running for good."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from _dist_util import run_torchrun

RANKS = 2
WORKER = """
import os, sys, time
from pathlib import Path
Path(sys.argv[1], f"pid.{os.environ['RANK']}").write_text(str(os.getpid()))
time.sleep(600)
"""

pytestmark = [pytest.mark.slow,  # every test launches torchrun and its workers (~6 s to start)
              pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed")]


def _command(tmp_path: Path) -> list[str]:
    script = tmp_path / "sleeper.py"
    script.write_text(WORKER)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
            str(script), str(tmp_path)]


def _pids(tmp_path: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(tmp_path.glob("pid.*")) if p.read_text()]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_all_gone(pids: list[int], within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], f"workers {pids}: still alive {within_s:g} s after run_torchrun"


def test_a_timed_out_torchrun_leaves_no_worker_alive(tmp_path: Path) -> None:
    # 20 s: torchrun starts its workers in ~6 s on this 2-core machine; they must be up to be orphaned.
    with pytest.raises(subprocess.TimeoutExpired) as info:
        run_torchrun(_command(tmp_path), timeout_s=20, cwd=tmp_path)
    pids = _pids(tmp_path)
    assert len(pids) == RANKS, f"the workers had not started within the timeout: {info.value.stderr}"
    _assert_all_gone(pids)


def test_an_interrupted_torchrun_leaves_no_worker_alive(tmp_path: Path) -> None:
    """Ctrl-C (a KeyboardInterrupt in the test's thread) once every worker runs."""
    assert threading.current_thread() is threading.main_thread()  # where SIGINT raises
    finished = threading.Event()

    def interrupt_once_started() -> None:
        deadline = time.monotonic() + 120
        while len(_pids(tmp_path)) < RANKS and not finished.is_set() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not finished.is_set():
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    watcher = threading.Thread(target=interrupt_once_started, daemon=True)
    watcher.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_torchrun(_command(tmp_path), timeout_s=150, cwd=tmp_path)
    finally:
        finished.set()
        watcher.join()
    pids = _pids(tmp_path)
    assert len(pids) == RANKS
    _assert_all_gone(pids)


STUBBORN = """
import signal, subprocess, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a launcher that does not stop its workers
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
Path(sys.argv[1], "pid.0").write_text(str(child.pid))
time.sleep(600)
"""


def test_a_launcher_that_ignores_sigterm_is_killed_with_its_workers(tmp_path: Path) -> None:
    from bench.train._dist import stop_torchrun

    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _pids(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _pids(tmp_path), "the stub launcher did not start its worker"
    finally:
        stop_torchrun(proc, grace_s=1)
    assert proc.returncode == -signal.SIGKILL
    _assert_all_gone(_pids(tmp_path))


DYING = """
import subprocess, sys, time
from pathlib import Path
print("launcher up", flush=True)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
Path(sys.argv[1], "pid.0").write_text(str(child.pid))
time.sleep(2)
sys.exit(1)  # the agent dies (a crash, the OOM killer) with its worker running, holding stdout
"""


def test_a_launcher_that_died_before_the_timeout_leaves_no_worker_alive(tmp_path: Path) -> None:
    """review: torchrun gone, its worker (own session) still holding the pipe: communicate() times
    out, stop_torchrun sees the launcher exited and returns (None, None) without killing anything."""
    script = tmp_path / "dying.py"
    script.write_text(DYING)
    with pytest.raises(subprocess.TimeoutExpired) as info:
        run_torchrun([sys.executable, str(script), str(tmp_path)], timeout_s=8, cwd=tmp_path)
    pids = _pids(tmp_path)
    try:
        out = info.value.stdout
        assert "launcher up" in (out.decode() if isinstance(out, bytes) else out or ""), out
        _assert_all_gone(pids, within_s=5)
    finally:
        for pid in pids:
            if _alive(pid):
                psutil.Process(pid).kill()
