"""A controlled background load for :mod:`bench.tuner_load`: worker processes that compete with
the measured process for the CPUs while it tunes and is scored.

    with BackgroundLoad(LoadSpec(kind="threads", procs=2, threads=2, seed=0)) as load:
        ...  # every worker is running (it reported ready) until the block exits
    # here every worker is dead and reaped, also after an exception or Ctrl-C

Kinds (each worker is ``python -m bench.tuner_load._load`` started with ``sys.executable``):

* ``threads``: a torch loop with ``torch.set_num_threads(threads)`` that never pauses: a 512 x 512
  matmul (1 MiB operands) and elementwise updates of two 1 Mi-element vectors (4 MiB each), so the
  worker holds an OpenMP team that competes for cores and memory bandwidth, as another rank's
  optimizer step or a data loader's transforms would.
* ``bursts``: the same work, busy for uniform(30, 150) ms then idle for uniform(10, 60) ms, drawn
  from ``random.Random(seed + worker index)``: a load that changes faster than a tuning session.
* ``busy``: plain Python arithmetic in a loop (one thread, no torch, no thread team).
* ``none``: no worker.

Every worker runs with this process's environment less ``OMP_WAIT_POLICY`` (OpenMP's default
wait policy, as other jobs have), so a measured process's own policy never changes the load.

Stopping: SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`, and ``wait()`` so no zombie is left.
Ctrl-C reaches the workers too (same process group); they exit quietly. While the load runs, a
SIGTERM to the measuring process raises ``KeyboardInterrupt`` there (the previous handler is
restored on exit), so its ``finally`` blocks stop the workers. A worker whose parent died anyway
(SIGKILL) notices that its parent pid changed and exits within one iteration.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from types import FrameType
from typing import Callable, Literal, Sequence

logger = logging.getLogger(__name__)

__all__ = ["KINDS", "STOP_GRACE_S", "BackgroundLoad", "LoadSpec", "add_load_arguments"]

LoadKind = Literal["none", "threads", "bursts", "busy"]
KINDS: tuple[str, ...] = ("none", "threads", "bursts", "busy")


def add_load_arguments(p: argparse.ArgumentParser, *, default: str) -> None:
    """A benchmark's ``--load``, ``--load-procs`` and ``--load-threads`` (a :class:`LoadSpec`)."""
    p.add_argument("--load", choices=KINDS, default=default, help="background load (see bench.tuner_load._load)")
    p.add_argument("--load-procs", type=int, default=2, help="background load processes")
    p.add_argument("--load-threads", type=int, default=2, help="torch threads per load process (threads, bursts)")
#: Seconds a worker has to report ready (torch's import takes a few on a loaded 2-core VM).
READY_TIMEOUT_S = 120.0
#: Seconds between SIGTERM and SIGKILL when stopping.
STOP_GRACE_S = 5.0
#: Burst and idle lengths of the ``bursts`` kind, in seconds (uniform).
BURST_S, IDLE_S = (0.030, 0.150), (0.010, 0.060)
#: Slice of plain-Python work between parent checks of the ``busy`` kind.
BUSY_SLICE_S = 0.02


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoadSpec:
    """What :class:`BackgroundLoad` starts."""

    kind: LoadKind = "none"
    """One of :data:`KINDS` (see the module doc)."""
    procs: int = 2
    """Worker processes (ignored for ``none``)."""
    threads: int = 2
    """torch intra-op threads per worker of ``threads`` and ``bursts``."""
    seed: int = 0
    """Seed of the ``bursts`` draws (worker ``i`` uses ``seed + i``)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"LoadSpec.kind={self.kind!r}: expected one of {KINDS}")
        for name in ("procs", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LoadSpec.{name}={value!r}: expected an int >= 1")

    def describe(self) -> str:
        if self.kind == "none":
            return "no background load"
        what = {"threads": f"a constant {self.threads}-thread torch loop",
                "bursts": f"a {self.threads}-thread torch loop busy {BURST_S[0] * 1e3:.0f}-{BURST_S[1] * 1e3:.0f} ms, "
                          f"idle {IDLE_S[0] * 1e3:.0f}-{IDLE_S[1] * 1e3:.0f} ms (uniform, seed {self.seed})",
                "busy": "a plain Python busy loop (one thread)"}[self.kind]
        return f"{self.procs} processes, each {what}"


def _worker_env() -> dict[str, str]:
    """This environment without ``OMP_WAIT_POLICY``: the load stands for other jobs, which keep
    OpenMP's default, whatever policy the measured process runs with (bench.tuner_load.wait_policy)."""
    return {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}


class BackgroundLoad:
    """Context manager: starts the workers of ``spec`` on entry (returns once each reported ready)
    and stops them on exit. ``pids`` lists the workers started (kept after they stopped)."""

    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        self.pids: list[int] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._old_sigterm: object = None
        self._sigterm_set = False

    def __enter__(self) -> BackgroundLoad:
        if self.spec.kind == "none":
            return self
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _interrupt)
            self._sigterm_set = True
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        s = self.spec
        for i in range(s.procs):
            cmd = [sys.executable, "-m", "bench.tuner_load._load", "--kind", s.kind, "--threads", str(s.threads),
                   "--seed", str(s.seed + i), "--parent", str(os.getpid())]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=_worker_env())
            self._procs.append(proc)
            self.pids.append(proc.pid)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for proc in self._procs:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = proc.stdout.readline() if ready else b""
            if line.strip() != b"ready":
                raise RuntimeError(f"load worker {proc.pid} ({s.kind}) did not report ready within "
                                   f"{READY_TIMEOUT_S:.0f} s (exit status {proc.poll()}): expected a line 'ready'")
        logger.info("background load on: %s (pids %s)", s.describe(), self.pids)

    def stop(self) -> None:
        """Terminate, then kill, and reap every worker (idempotent)."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if self._procs:
            logger.info("background load off (pids %s stopped)", self.pids)
        self._procs = []
        if self._sigterm_set:
            signal.signal(signal.SIGTERM, self._old_sigterm or signal.SIG_DFL)  # type: ignore[arg-type]
            self._sigterm_set = False


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# ------------------------------------------------------------------------------------ worker
def _torch_work(threads: int) -> Callable[[], None]:
    import torch

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g)
    c = torch.empty(512, 512)
    x, y, z = torch.randn(1 << 20, generator=g), torch.randn(1 << 20, generator=g), torch.empty(1 << 20)

    def one() -> None:  # a few ms on one core; values stay bounded (x tends to 2y)
        torch.mm(a, b, out=c)
        x.mul_(0.5).add_(y)
        torch.mul(x, y, out=z)

    return one


def _busy_python(seconds: float) -> None:
    end = time.perf_counter() + seconds
    acc = 1.0
    while time.perf_counter() < end:
        for _ in range(1000):
            acc = (acc * 1.0000001) % 7.0


def worker(kind: str, threads: int, seed: int, parent: int) -> None:
    """The loop of one worker process; returns when its parent is gone."""
    rng = random.Random(seed)
    one: Callable[[], None] = lambda: None
    if kind in ("threads", "bursts"):
        one = _torch_work(threads)
        one()
    print("ready", flush=True)
    while os.getppid() == parent:
        if kind == "busy":
            _busy_python(BUSY_SLICE_S)
        elif kind == "threads":
            one()
        else:
            end = time.perf_counter() + rng.uniform(*BURST_S)
            while time.perf_counter() < end:
                one()
            time.sleep(rng.uniform(*IDLE_S))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tuner_load._load", description="one background load worker")
    p.add_argument("--kind", choices=[k for k in KINDS if k != "none"], required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parent", type=int, required=True, help="exit when this is no longer the parent pid")
    args = p.parse_args(argv)
    try:
        worker(args.kind, args.threads, args.seed, args.parent)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
