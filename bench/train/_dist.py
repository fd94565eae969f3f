"""torch.distributed plumbing for the reference trainer: setup, gradient averaging, gathers.

Why a manual all-reduce and not ``DistributedDataParallel``: the offloaded optimizer can start a
chunk's update during backward (``--overlap-backward``) from its own gradient hooks. Under DDP
those hooks would see each rank's local, not yet averaged gradients. Averaging all gradients in
one flat bucket after backward keeps "every rank's optimizer sees identical gradients" true by
construction, keeps communication out of the optimizer's measured step, and costs only the
overlap of communication with backward, which this benchmark trainer does not need.

Faults: the default group's timeout is ``--dist-timeout`` (default: the tuner's own
``AutotuneConfig.timeout_s``), not gloo's 600 s, so a frozen rank stops the run within the same
bound as the tuner's collectives. Ranks exchange their pids at setup; a failed collective becomes
one :class:`DistFailure` naming the step, what was being exchanged, whether it timed out or failed
early, and which rank on this host exited or is stopped (ranks on other hosts cannot be seen).

Launching: :func:`run_torchrun` runs a launcher (``torchrun``) and, when it must be stopped, stops
its workers too. torch's launcher starts each worker with ``start_new_session=True``, so a SIGKILL
of torchrun alone (what ``subprocess.run(timeout=)`` and ``Popen.kill()`` send) leaves the workers
running, reparented to init; a SIGTERM lets torchrun stop them itself.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import logging
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import psutil
import torch
import torch.distributed as dist

from autotune import AutotuneConfig, knobs
from autotune.agree._peers import ProcessInfo, describe_state, me, peer_states

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_TIMEOUT_S", "DistFailure", "DistInfo", "setup", "teardown", "average_gradients",
           "average_scalar", "gather_objects", "param_checksum", "run_torchrun", "stop_torchrun"]

#: The tuner's default collective timeout: generous (a tiny CPU run on a loaded 2-core machine can
#: leave one rank far behind), yet one bound for every collective of the run.
DEFAULT_TIMEOUT_S = AutotuneConfig().timeout_s
#: A collective that failed after this fraction of the timeout timed out; earlier, a peer is gone.
_TIMED_OUT_FRACTION = 0.9
#: How long :func:`stop_torchrun` lets torchrun stop its workers after a SIGTERM before killing them.
STOP_GRACE_S = 15.0


class DistFailure(RuntimeError):
    """A collective of the trainer failed; the message names the step and, where knowable, the rank."""

    def __init__(self, message: str, *, step: int | None, ranks: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = tuple(ranks)


@dataclass(frozen=True, kw_only=True, slots=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str | None
    """None when running as a single process without torch.distributed."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Timeout of every collective of the default group."""
    peers: tuple[ProcessInfo | None, ...] = ()
    """Every rank's process (pid, host), by global rank."""

    @property
    def enabled(self) -> bool:
        return self.backend is not None


def setup(device: torch.device, *, timeout_s: float = DEFAULT_TIMEOUT_S, group: bool = False) -> DistInfo:
    """Join the process group when launched by torchrun (``LOCAL_WORLD_SIZE`` set), else single process.

    The backend is gloo on CPU and nccl on CUDA; on CUDA each rank uses device ``LOCAL_RANK``.
    Every collective of the group times out after ``timeout_s``. ``group``: a single process still
    gets a default group (world size 1, in-process store), which FSDP2's ``fully_shard`` needs.
    """
    local_world = knobs.local_world_size()
    if local_world is None:
        if not group:
            return DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, backend=None,
                            timeout_s=timeout_s)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1, timeout=_dt.timedelta(seconds=timeout_s))
        return DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1,
                        backend=dist.get_backend(), timeout_s=timeout_s)
    local_rank = knobs.node_local_rank()  # LOCAL_RANK=5 with LOCAL_WORLD_SIZE=2: one line, not torch's traceback
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=_dt.timedelta(seconds=timeout_s))
    info = DistInfo(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
        local_world_size=local_world, backend=dist.get_backend(), timeout_s=timeout_s,
    )
    peers = gather_objects(me().to_dict(), info, what="exchange of process ids")
    return DistInfo(
        rank=info.rank, world_size=info.world_size, local_rank=local_rank, local_world_size=local_world,
        backend=info.backend, timeout_s=timeout_s, peers=tuple(ProcessInfo.from_dict(p) for p in peers),
    )


def _diagnose(info: DistInfo, exc: BaseException, step: int | None, what: str,
              elapsed_s: float) -> DistFailure:
    others = [r for r in range(info.world_size) if r != info.rank]
    states = peer_states(info.peers, me(), settle=others) if info.peers else {}
    culprits = [r for r in others if states.get(r) in ("exited", "stopped")]
    if elapsed_s >= _TIMED_OUT_FRACTION * info.timeout_s:
        verdict = f"no answer within {info.timeout_s:g} s"
    else:
        verdict = f"failed after {elapsed_s:.1f} s (before the {info.timeout_s:g} s timeout)"
    if culprits:
        who = "; ".join(f"rank {r} {describe_state(info.peers[r].pid, states[r])}"  # type: ignore[union-attr]
                        for r in culprits)
    else:
        elsewhere = [r for r in others if states.get(r, "unknown") == "unknown"]
        who = "no rank on this host exited or is stopped"
        who += f" (rank(s) {', '.join(map(str, elsewhere))} run elsewhere: see their logs)" if elsewhere else \
            " (a rank may be stuck: see every rank's log)"
    lines = str(exc).strip().splitlines()
    place = "start" if step is None else f"step {step}"
    return DistFailure(
        f"{place} ({what}): {verdict}: {who}; collective error: {lines[0] if lines else type(exc).__name__}",
        step=step, ranks=culprits,
    )


@contextlib.contextmanager
def _collective(info: DistInfo, step: int | None, what: str) -> Iterator[None]:
    """Turn a failed collective into a :class:`DistFailure` naming the step and the rank."""
    began = time.monotonic()
    try:
        yield
    except RuntimeError as exc:  # gloo/nccl errors (DistBackendError is a RuntimeError)
        raise _diagnose(info, exc, step, what, time.monotonic() - began) from exc


def teardown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def average_gradients(params: Iterable[torch.nn.Parameter], info: DistInfo, *, step: int | None = None) -> None:
    """All-reduce every ``.grad`` as one flat bucket per dtype and divide by the world size.

    Ranks reduce the same bytes in the same order, so every rank gets bitwise identical gradients.
    """
    world_size = info.world_size
    if world_size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        with _collective(info, step, "gradient all-reduce"):
            dist.all_reduce(flat)
        flat.div_(world_size)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n


def average_scalar(value: float, info: DistInfo, device: torch.device, *, step: int | None = None) -> float:
    if not info.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    with _collective(info, step, "loss all-reduce"):
        dist.all_reduce(t)
    return float(t.item()) / info.world_size


def gather_objects(obj: Any, info: DistInfo, *, step: int | None = None, what: str = "gather of the rank summaries") -> list[Any]:
    """``all_gather_object`` (every rank gets every rank's object); ``[obj]`` without a group."""
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    with _collective(info, step, what):
        dist.all_gather_object(out, obj)
    return out


def param_checksum(params: Iterable[torch.Tensor]) -> str:
    """SHA-256 over the raw bytes of every tensor (a DTensor's local shard), in order: equal iff bitwise equal."""
    h = hashlib.sha256()
    for p in params:
        t = p.detach()
        if hasattr(t, "to_local"):  # DTensor (FSDP2): this rank's shard
            t = t.to_local()
        t = t.reshape(-1).contiguous().cpu()
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:  # already exited: its workers, if any, were reparented
        return []


def stop_torchrun(proc: subprocess.Popen, *, grace_s: float = STOP_GRACE_S,
                  known: Iterable[psutil.Process] = ()) -> tuple[Any, Any]:
    """Stop a launcher and every process it started; return the rest of its (stdout, stderr).

    Records the descendants first (once torchrun is gone they can no longer be found), sends
    torchrun SIGTERM (it then stops its workers), waits up to ``grace_s``, then SIGKILLs every
    recorded descendant still alive and torchrun. Output is None where it was not piped or could
    not be read (a killed process that was not recorded may still hold the pipe).
    """
    recorded = {p.pid: p for p in known}
    if proc.poll() is not None:
        for p in recorded.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        try:
            return proc.communicate(timeout=5)  # the rest, once the killed workers let go of the pipes
        except subprocess.TimeoutExpired:
            return None, None
    recorded.update((p.pid, p) for p in _descendants(proc))
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=grace_s)  # drains the pipes: a full one would block its shutdown
    except subprocess.TimeoutExpired:
        pass
    recorded.update((p.pid, p) for p in _descendants(proc))  # workers started after the first look
    for p in recorded.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()  # psutil checks the pid still names the recorded process
    proc.kill()
    proc.wait()
    try:
        return proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        return None, None


def run_torchrun(cmd: Sequence[str], *, timeout_s: float, **popen_kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, **popen_kwargs)``
    that stops torchrun's workers too (:func:`stop_torchrun`) on a timeout or any exception.

    The exception is re-raised; a :class:`subprocess.TimeoutExpired` carries the output read so far,
    as ``subprocess.run``'s does.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kwargs)
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while True:  # look at the descendants every second: once torchrun is gone they cannot be found
            seen.update((p.pid, p) for p in _descendants(proc))
            try:
                stdout, stderr = proc.communicate(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired as expired:
                if time.monotonic() >= deadline:
                    expired.timeout = timeout_s
                    raise
    except BaseException as exc:  # KeyboardInterrupt too: the workers are in their own sessions
        out, err = stop_torchrun(proc, known=seen.values())
        if isinstance(exc, subprocess.TimeoutExpired) and (out, err) != (None, None):
            exc.stdout, exc.stderr = out, err
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
