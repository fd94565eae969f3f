"""Python processes forked from one that has already imported torch: ``python ARGV`` for tests
that start many of them (ranks, trainer runs), without each paying torch's import again.

:func:`start_python` is ``subprocess.Popen([sys.executable, *argv], ...)`` with the output in
files; what it returns has the part of ``Popen`` that tests use (``pid``, ``poll``, ``wait``,
``returncode``). The process is a fork of the *zygote*: ``python tests/_forked.py``, one per
pytest process, which imports torch, ``torch.distributed``, ``offload`` and ``autotune`` once and
then forks a child per request (about 1.5 s of CPU saved per process on the 2-core CI machine,
most of what a small multi-rank test costs). The zygote never runs an OpenMP region or starts a
thread of its own, so its forks start clean.

A fork becomes what ``python ARGV`` would be: the given environment, working directory and
``sys.argv``; ``-m MODULE``, ``-c CODE`` or a script run as ``__main__``; stdout and stderr
unbuffered into their files (as ``python -u``); at the end, non-daemon threads joined and
``atexit`` handlers run, as at interpreter exit. Two differences remain, so a test of either keeps
a real interpreter: modules the zygote imported are not imported again (an environment variable
read at their import is the zygote's), and OpenMP read its variables when the zygote loaded it:
the fork sets torch's thread count from ``OMP_NUM_THREADS`` instead (what torch reports), and
keeps the zygote's ``OMP_WAIT_POLICY`` (that of the pytest worker: ``PASSIVE``, conftest.py).
Each fork leads its own session: ``os.killpg(pid, ...)`` reaches it and what it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["ForkedProcess", "run_python", "start_python"]


class ForkedProcess:
    """A fork of the zygote, as much of ``subprocess.Popen`` as the tests use."""

    def __init__(self, zygote: _Zygote, pid: int, args: list[str]) -> None:
        self._zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.call(op="poll", pid=self.pid)["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            if self.returncode is None:
                self.returncode = self._zygote.call(op="wait", pid=self.pid)["returncode"]
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]


class _Zygote:
    def __init__(self) -> None:
        # Without OMP_NUM_THREADS, so that torch's default thread count is the one a fork without
        # the variable gets.
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        self._proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._lock = threading.Lock()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def call(self, **request: Any) -> dict[str, Any]:
        with self._lock:
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote that forks test processes exited (returncode {self._proc.poll()})")
        return json.loads(line)


_ZYGOTE: _Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def start_python(argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 stdout: str | Path, stderr: str | Path | None = None) -> ForkedProcess:
    """``python *argv`` (``-m MODULE ...``, ``-c CODE ...`` or ``SCRIPT ...``; a leading ``-u`` is
    accepted) with ``env`` (default: this process's) in ``cwd`` (default: this one's), writing
    stdout to the file ``stdout`` and stderr to ``stderr`` (default: the same file)."""
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or not _ZYGOTE.alive():
            _ZYGOTE = _Zygote()
        zygote = _ZYGOTE
    argv = [str(a) for a in argv]
    for path in (stdout, stderr):  # there once this returns, as Popen's would be
        if path is not None:
            Path(path).touch()
    reply = zygote.call(op="spawn", argv=argv, env=dict(os.environ if env is None else env),
                        cwd=str(Path.cwd() if cwd is None else cwd), stdout=str(stdout),
                        stderr=str(stdout if stderr is None else stderr))
    return ForkedProcess(zygote, reply["pid"], [sys.executable, *argv])


def run_python(argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
               timeout: float) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=, cwd=,
    timeout=)`` on a fork (:func:`start_python`); on a timeout its process group is killed."""
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = start_python(argv, env=env, cwd=cwd, stdout=out, stderr=err)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        return subprocess.CompletedProcess(proc.args, returncode, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


# --- in the zygote and its forks -------------------------------------------------------------


def _run_argv(argv: list[str]) -> int:
    """Run what ``python *argv`` runs, in this process; its exit code."""
    import builtins
    import runpy
    import traceback

    if argv[:1] == ["-u"]:
        argv = argv[1:]
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's path first
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  (what the interpreter would print and exit 1 on)
        traceback.print_exc()
        code = 1
    # What interpreter exit does before it ends: join non-daemon threads, run atexit handlers.
    import atexit

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    return code


def _become(request: dict[str, Any], default_threads: int) -> None:
    """In a fork of the zygote: become ``python ARGV`` with the request's environment and files."""
    import torch

    os.setsid()
    fds = {0: os.open(os.devnull, os.O_RDONLY),
           1: os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)}
    fds[2] = fds[1] if request["stderr"] == request["stdout"] else os.open(
        request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for target, fd in fds.items():
        os.dup2(fd, target)
    for fd in set(fds.values()):
        os.close(fd)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(1, entry)
    os.chdir(request["cwd"])
    # OpenMP read OMP_NUM_THREADS when the zygote loaded it; a fresh process reads its own.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or default_threads))
    code = _run_argv(request["argv"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _zygote_main() -> None:
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repository, for offload
    import torch  # the imports every forked process would otherwise repeat
    import torch.distributed  # noqa: F401

    import autotune  # noqa: F401
    import offload  # noqa: F401

    default_threads = torch.get_num_threads()  # what torch picks without OMP_NUM_THREADS
    exits: dict[int, int] = {}

    def reap(pid: int, block: bool) -> int | None:
        if pid not in exits:
            done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
            if done == 0:
                return None
            exits[pid] = os.waitstatus_to_exitcode(status)
        return exits[pid]

    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                try:
                    _become(request, default_threads)
                finally:
                    os._exit(70)
            reply: dict[str, Any] = {"pid": pid}
        else:
            reply = {"returncode": reap(request["pid"], block=request["op"] == "wait")}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _zygote_main()
