"""Run a test function in N real processes joined by a gloo default group.

Usage from a test (the target must be a module-level function of an importable test module)::

    from _dist_util import run_workers

    def _worker(rank: int, world_size: int, *, steps: int) -> dict:
        ...                                   # torch.distributed is initialised (gloo)
        return {"anything": "JSON-able"}

    def test_something():
        results = run_workers(_worker, world_size=2, kwargs={"steps": 10}, timeout_s=60)
        assert all(r.ok for r in results), [r.describe() for r in results]

Each worker is a process with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``OMP_NUM_THREADS=1``) on a free port of
127.0.0.1, forked from a process that has imported torch once (:class:`_Zygote`, one per pytest
process): about 1.5 s of CPU saved per rank, most of a small test's cost. A fork starts with the
test's environment and one intra-op thread, as a fresh ``python tests/_dist_util.py SPEC RANK``
would; ``fresh=True`` starts that instead, for a test of what happens at import. Its return value (or exception) comes back in a :class:`WorkerResult`; its
stderr (logging goes there) too. Workers still running at ``timeout_s``, or once every rank of
``wait_ranks`` has finished, are killed, so a test never hangs.

A test that runs torchrun itself uses :func:`run_torchrun` (``subprocess.run`` that, on a timeout,
stops torchrun's workers too, which a SIGKILL of torchrun would leave running).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent

__all__ = ["COSTS", "WorkerResult", "costed_tuning", "free_port", "run_torchrun", "run_workers"]


#: Step cost by thread count on two local ranks that disagree (rank 0 is fastest at 2 threads,
#: rank 1 at 4): the ranks must still agree on one setting.
COSTS = ({1: 3.0, 2: 1.0, 4: 2.0}, {1: 2.0, 2: 1.5, 4: 1.0})


def costed_tuning(rank: int, world_size: int, *, cache_path: str, trace_dir: str) -> tuple[Any, Any, Callable[[], float]]:
    """What a rank's tuner gets in the multi-rank tuning tests: a plan of 4 threads on 2 cpus, a
    short probe (``AutotuneConfig``) and a clock that advances by ``COSTS[rank]`` of the thread
    count in force at each read."""
    import torch

    from autotune import AutotuneConfig
    from offload import ThreadPlan

    plan = ThreadPlan(threads=4, reason="test plan", source="plan", cpus=frozenset({0, 1}),
                      local_world_size=world_size, local_rank=rank, planned_threads=4,
                      local_threads=(4,) * world_size)
    config = AutotuneConfig(probe_steps=26, warmup_steps=1, measure_steps=2, finalists=2, final_rounds=1,
                            timeout_s=60.0, cache_path=cache_path, trace_dir=trace_dir)
    t = 0.0

    def clock() -> float:
        nonlocal t
        t += COSTS[rank][torch.get_num_threads()]
        return t

    return plan, config, clock


@dataclass
class WorkerResult:
    rank: int
    returncode: int | None
    """Exit status; None if the worker was killed (timeout or ``wait_ranks``)."""
    ok: bool
    """The target returned normally."""
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None
    stderr: str = ""
    killed: bool = False

    def describe(self) -> str:
        head = f"rank {self.rank}: returncode={self.returncode} ok={self.ok} killed={self.killed}"
        if self.error:
            head += f"\n  {self.error_type}: {self.error}"
        return f"{head}\n  --- stderr (tail) ---\n{self.stderr[-3000:]}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_torchrun(cmd: Sequence[str], *, timeout_s: float, **popen_kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, **popen_kwargs)``
    that, on a timeout or any exception (re-raised), SIGTERMs torchrun, waits 15 s, then SIGKILLs
    every process it had started and torchrun. One implementation, the suite's: bench/train/_dist.py."""
    from bench.train._dist import run_torchrun as run  # here, not at import: workers run this file too

    return run(cmd, timeout_s=timeout_s, **popen_kwargs)


def _launch(target: str, world_size: int, kwargs: dict[str, Any], timeout_s: float,
            wait_ranks: Sequence[int] | None, log_level: str, workdir: Path, fresh: bool) -> list[WorkerResult]:
    port = free_port()
    spec = {"target": target, "world_size": world_size, "kwargs": kwargs, "log_level": log_level,
            "workdir": str(workdir)}
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    procs: list[subprocess.Popen | _ForkedRank] = []
    killed = set()
    try:
        for rank in range(world_size):
            env = dict(os.environ)
            env.update(
                RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            )
            if fresh:
                with open(workdir / f"stderr.{rank}", "wb") as stderr:
                    procs.append(subprocess.Popen(
                        [sys.executable, str(Path(__file__).resolve()), str(spec_path), str(rank)],
                        cwd=REPO_ROOT, env=env, stdout=stderr, stderr=subprocess.STDOUT, start_new_session=True,
                    ))
            else:
                procs.append(_zygote().spawn(spec_path, rank, env, workdir / f"stderr.{rank}"))
        deadline = time.monotonic() + timeout_s
        waited = range(world_size) if wait_ranks is None else wait_ranks
        while time.monotonic() < deadline and any(procs[r].poll() is None for r in waited):
            time.sleep(0.05)
    finally:  # on every exit path (Ctrl-C, an exception): the workers are in their own sessions
        for rank, proc in enumerate(procs):
            if proc.poll() is None:
                killed.add(rank)
                os.killpg(proc.pid, signal.SIGKILL)  # an unreaped leader keeps its group
            proc.wait()
    results = []
    for rank, proc in enumerate(procs):
        out = workdir / f"result.{rank}.json"
        data = json.loads(out.read_text()) if out.exists() else {}
        results.append(WorkerResult(
            rank=rank,
            returncode=None if rank in killed else proc.returncode,
            ok=bool(data.get("ok")),
            value=data.get("value"),
            error_type=data.get("error_type"),
            error=data.get("error"),
            traceback=data.get("traceback"),
            stderr=(workdir / f"stderr.{rank}").read_text(errors="replace"),
            killed=rank in killed,
        ))
    return results


def run_workers(
    target: Callable[..., Any],
    world_size: int = 2,
    *,
    kwargs: dict[str, Any] | None = None,
    timeout_s: float = 60.0,
    wait_ranks: Sequence[int] | None = None,
    log_level: str = "INFO",
    fresh: bool = False,
) -> list[WorkerResult]:
    """Run ``target(rank=, world_size=, **kwargs)`` in ``world_size`` processes; results by rank.

    ``kwargs`` must be JSON-able. ``wait_ranks``: stop waiting (and kill the rest) once these ranks
    have exited, e.g. when another rank is meant to hang. ``fresh``: each rank a new interpreter
    (not forked). Retries once on a port collision.
    """
    name = f"{target.__module__}:{target.__qualname__}"
    for attempt in range(2):
        with tempfile.TemporaryDirectory(prefix="dist-test-") as tmp:
            results = _launch(name, world_size, dict(kwargs or {}), timeout_s, wait_ranks, log_level, Path(tmp),
                              fresh)
        collided = any("address already in use" in (r.stderr + (r.error or "")).lower() for r in results)
        if not collided or attempt == 1:
            return results
    raise AssertionError("unreachable")


class _ForkedRank:
    """A rank forked by the zygote: the part of ``subprocess.Popen`` that :func:`_launch` uses.
    It leads its own session, so ``os.killpg(pid, ...)`` reaches it and what it started."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self._zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.call(op="poll", pid=self.pid)["returncode"]
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.call(op="wait", pid=self.pid)["returncode"]
        return self.returncode


class _Zygote:
    """``python tests/_dist_util.py --zygote``: imports torch (and this project) once, then forks
    a rank per request on its stdin and reaps it (replies on its stdout, one JSON line each). It
    never runs an OpenMP region or starts a thread of its own, so its forks start clean; it exits
    when this process closes its stdin."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
        self._proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--zygote"], cwd=REPO_ROOT,
                                      env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
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
            raise RuntimeError(f"the rank zygote exited (returncode {self._proc.poll()})")
        return json.loads(line)

    def spawn(self, spec_path: Path, rank: int, env: dict[str, str], output: Path) -> _ForkedRank:
        reply = self.call(op="spawn", spec=str(spec_path), rank=rank, env=env, output=str(output), cwd=str(REPO_ROOT))
        return _ForkedRank(self, reply["pid"])


_ZYGOTE: _Zygote | None = None


def _zygote() -> _Zygote:
    global _ZYGOTE
    if _ZYGOTE is None or not _ZYGOTE.alive():
        _ZYGOTE = _Zygote()
    return _ZYGOTE


def _become_rank(request: dict[str, Any]) -> None:
    """In a fork of the zygote: become what a fresh ``python tests/_dist_util.py SPEC RANK`` with
    ``request``'s environment would be, then run the rank (which ends the process)."""
    import torch

    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(1, entry)
    os.chdir(request["cwd"])
    # OpenMP read OMP_NUM_THREADS when the zygote loaded it; a fresh process would read the rank's.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    _worker_main(request["spec"], str(request["rank"]))


def _zygote_main() -> None:
    import torch  # noqa: F401  (the import every rank would repeat)
    import torch.distributed  # noqa: F401

    import autotune  # noqa: F401
    import offload  # noqa: F401

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
                    _become_rank(request)
                finally:
                    os._exit(70)
            reply: dict[str, Any] = {"pid": pid}
        else:
            reply = {"returncode": reap(request["pid"], block=request["op"] == "wait")}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def _worker_main(spec_path: str, rank_text: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rank, world_size = int(rank_text), int(spec["world_size"])
    workdir = Path(spec["workdir"])
    logging.basicConfig(level=spec["log_level"], stream=sys.stderr,
                        format=f"[worker {rank}] %(levelname)s %(name)s: %(message)s")
    result: dict[str, Any]
    try:
        import datetime

        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
        module_name, _, qualname = spec["target"].partition(":")
        fn: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        value = fn(rank=rank, world_size=world_size, **spec["kwargs"])
        result = {"ok": True, "value": value}
    except BaseException as exc:  # report everything, including SystemExit from the target
        result = {"ok": False, "error_type": type(exc).__name__, "error": str(exc),
                  "traceback": traceback.format_exc()}
    tmp = workdir / f"result.{rank}.json.tmp"
    tmp.write_text(json.dumps(result, default=repr))
    tmp.replace(workdir / f"result.{rank}.json")
    sys.stderr.flush()
    # Skip interpreter teardown: a peer may be gone, and destroying its process groups could block.
    os._exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        _zygote_main()
    else:
        _worker_main(sys.argv[1], sys.argv[2])
