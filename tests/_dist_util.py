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
127.0.0.1: ``python tests/_dist_util.py SPEC RANK`` forked from a process that has imported torch
once (``_forked.py``); ``fresh=True`` starts a new interpreter instead, for a test of what happens
at import. Its return value (or exception) comes back in a :class:`WorkerResult`; its
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
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from _forked import ForkedProcess, start_python

REPO_ROOT = Path(__file__).resolve().parent.parent

__all__ = ["COSTS", "WorkerResult", "costed_tuning", "free_port", "run_ranks", "run_torchrun", "run_workers",
           "start_ranks"]


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


def start_ranks(argv: Sequence[str], *, nproc: int, env: dict[str, str], cwd: str | Path, out_dir: Path,
                port: int, nnodes: int = 1, node_rank: int = 0) -> list[ForkedProcess]:
    """Node ``node_rank``'s ranks of ``torchrun --nnodes NNODES --nproc-per-node NPROC ARGV`` on this
    host, without the launcher: each rank ``python ARGV`` forked (``_forked.py``) with the
    environment torchrun gives its workers (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, the world
    sizes, ``MASTER_ADDR``/``MASTER_PORT`` of rank 0's store, ``OMP_NUM_THREADS=1`` unless set),
    its stdout and stderr in ``out_dir``/``stdout.RANK`` and ``stderr.RANK``."""
    procs = []
    for local in range(nproc):
        rank = node_rank * nproc + local
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(local), "GROUP_RANK": str(node_rank),
                    "ROLE_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nnodes * nproc),
                    "GROUP_WORLD_SIZE": str(nnodes), "ROLE_WORLD_SIZE": str(nnodes * nproc),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        rank_env.setdefault("OMP_NUM_THREADS", "1")
        procs.append(start_python(argv, env=rank_env, cwd=cwd, stdout=out_dir / f"stdout.{rank}",
                                  stderr=out_dir / f"stderr.{rank}"))
    return procs


def run_ranks(cmd: Sequence[str], *, cwd: str | Path, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """What ``run_torchrun(cmd, cwd=, env=, timeout_s=)`` gives for a torchrun command
    (``python -m torch.distributed.run --standalone --nproc-per-node N ARGV``) on one host, with the
    ranks forked by :func:`start_ranks` instead of started by the launcher: about 2 s of CPU less
    per rank and 2 s for the launcher. The result's stdout and stderr are the ranks' in rank order;
    its returncode the first failing rank's, or 0. Like torchrun, a failing rank ends the others
    (after 5 s here, so that their own error lines are written); a run past ``timeout_s`` is killed
    and raises ``subprocess.TimeoutExpired``. Real torchrun runs in ``test_run_torchrun.py`` and
    starts the trainer in ``test_threads_dist.py``, ``test_suite.py`` and ``test_overlap_bench.py``."""
    args = list(cmd)
    start = args.index("torch.distributed.run") + 1
    nproc, i = 1, start
    while i < len(args) and args[i].startswith("--"):
        if args[i] in ("--nproc-per-node", "--nproc_per_node"):
            nproc, i = int(args[i + 1]), i + 2
        elif args[i] == "--standalone":
            i += 1
        else:
            raise ValueError(f"run_ranks: torchrun option {args[i]!r} is not emulated; expected --standalone "
                             "and --nproc-per-node N")
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        out_dir = Path(tmp)
        procs = start_ranks(args[i:], nproc=nproc, env=env, cwd=cwd, out_dir=out_dir, port=free_port())
        deadline, failed_at, timed_out = time.monotonic() + timeout_s, None, False
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.poll() for p in procs):
                    failed_at = now
                timed_out = now >= deadline
                if timed_out or (failed_at is not None and now - failed_at > 5.0):
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        read = lambda name: "".join((out_dir / f"{name}.{r}").read_text(errors="replace")  # noqa: E731
                                    for r in range(nproc) if (out_dir / f"{name}.{r}").exists())
        stdout, stderr = read("stdout"), read("stderr")
    if timed_out and failed_at is None:
        raise subprocess.TimeoutExpired(args, timeout_s, output=stdout, stderr=stderr)
    returncode = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess(args, returncode, stdout, stderr)


def _launch(target: str, world_size: int, kwargs: dict[str, Any], timeout_s: float,
            wait_ranks: Sequence[int] | None, log_level: str, workdir: Path, fresh: bool) -> list[WorkerResult]:
    port = free_port()
    spec = {"target": target, "world_size": world_size, "kwargs": kwargs, "log_level": log_level,
            "workdir": str(workdir)}
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    procs: list[subprocess.Popen | ForkedProcess] = []
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
                procs.append(start_python([str(Path(__file__).resolve()), str(spec_path), str(rank)], env=env,
                                          cwd=REPO_ROOT, stdout=workdir / f"stderr.{rank}"))
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
    _worker_main(sys.argv[1], sys.argv[2])
