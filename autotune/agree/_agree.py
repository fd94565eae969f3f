"""Agreement between the local ranks of one node: a dedicated gloo group and a few collectives.

The tuner's collectives run on their own gloo group (made here over this node's ranks), never on
the default group, so they work whether the training uses gloo or NCCL and never interleave with
NCCL work. Every collective has a timeout. When one fails (a peer exited, hung or diverged), the
survivors find out which local rank is missing from a small side channel: a private
``torch.distributed.TCPStore`` hosted by local rank 0, where each rank records the sequence number
and step of the last collective it entered (one ~10 us store write per collective). The error then
names the owner ("OnlineTuner"), the step, the collective and the missing rank(s).

Every read of that store runs under a deadline (:func:`autotune.agree._peers.call_with_deadline`):
``TCPStore.check``/``get`` wait forever for a reply when rank 0's process is stopped, so an
unbounded read would turn one frozen rank into a hung node. Local ranks also exchange their pids
at setup, so the error says what happened to a missing rank (exited, stopped, or running but
silent) and whether the collective timed out or failed early (a peer that exits closes its
connections: the collective fails at once, not after ``timeout_s``).

Single-process runs use :class:`LocalAgreement`, which needs no ``torch.distributed`` at all.
"""

from __future__ import annotations

import datetime
import logging
import socket
import sys
import time
from typing import Any, Protocol, Sequence, runtime_checkable

from autotune.agree._peers import (
    ProcessInfo,
    StoreUnresponsive,
    call_with_deadline,
    describe_state,
    me,
    peer_states,
)

logger = logging.getLogger(__name__)

__all__ = [
    "Agreement",
    "AgreementError",
    "AgreementMismatch",
    "AgreementTimeout",
    "GlooAgreement",
    "LocalAgreement",
    "make_agreement",
]

#: Longest wait, after a collective failed, for peers that entered it to report their own failure.
DIAGNOSIS_GRACE_S = 2.0
#: Extra time a diagnosis's store reads may take beyond the grace before the store counts as
#: unresponsive (its process, local rank 0, is stopped or hung).
STORE_READ_GRACE_S = 1.0
#: A collective that failed after this fraction of ``timeout_s`` timed out; earlier, a peer
#: closed its connection (it exited) or the collective failed for another reason.
_TIMED_OUT_FRACTION = 0.9


def where(step: int | None, what: str) -> str:
    """``"step 12 (gather of step times)"`` or ``"start (check of the search space)"``."""
    return f"{'start' if step is None else f'step {step}'} ({what})"


class AgreementError(RuntimeError):
    """Local ranks could not agree: a collective failed, timed out, or ranks disagree."""

    def __init__(self, message: str, *, step: int | None = None, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = tuple(ranks)


class AgreementTimeout(AgreementError):
    """A collective failed because local rank(s) :attr:`ranks` stopped answering."""


class AgreementMismatch(AgreementError):
    """Local ranks answered but hold different values where they must agree."""


@runtime_checkable
class Agreement(Protocol):
    """The collectives the tuner needs, over this node's ranks. ``step`` and ``what`` label errors."""

    rank: int
    world_size: int

    def broadcast(self, obj: Any, *, step: int | None, what: str) -> Any:
        """``obj`` of local rank 0 on every rank."""
        ...

    def all_gather(self, obj: Any, *, step: int | None, what: str) -> list[Any]:
        """Every rank's ``obj``, indexed by local rank, on every rank."""
        ...

    def max_float(self, value: float, *, step: int | None, what: str) -> float:
        """Maximum of ``value`` over local ranks, on every rank."""
        ...

    def close(self) -> None: ...


class LocalAgreement:
    """One process, no collectives."""

    rank = 0
    world_size = 1

    def broadcast(self, obj: Any, *, step: int | None, what: str) -> Any:
        return obj

    def all_gather(self, obj: Any, *, step: int | None, what: str) -> list[Any]:
        return [obj]

    def max_float(self, value: float, *, step: int | None, what: str) -> float:
        return float(value)

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return "LocalAgreement()"


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _progress_text(step: str) -> str:
    if step == "nothing":
        return "before its first collective"
    if step == "start":
        return "at start"
    return f"at step {step}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class GlooAgreement:
    """Collectives on a gloo process group, with a timeout and named missing ranks on failure.

    Build it with :meth:`for_local_ranks` (every rank of the default group must call it, in the
    same order as other group creations), or wrap an existing gloo ``ProcessGroup`` whose members
    all run on this host.
    """

    def __init__(self, group: Any, *, timeout_s: float, owner: str = "OnlineTuner") -> None:
        dist = _dist()
        backend = str(dist.get_backend(group)).lower()
        if backend != "gloo":
            raise ValueError(
                f"{owner}: the agreement group has backend {backend!r}: expected a 'gloo' group "
                "(pass group=None to let the tuner make one)"
            )
        self._group = group
        self._owner = owner
        self.timeout_s = float(timeout_s)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._global_ranks = [dist.get_global_rank(group, r) for r in range(self.world_size)]
        self._seq = 0
        self._store: Any = None
        self._me = me()
        self._procs: list[ProcessInfo | None] = []
        self._setup_store()

    @classmethod
    def for_local_ranks(
        cls, *, timeout_s: float, local_world_size: int | None = None, owner: str = "OnlineTuner"
    ) -> GlooAgreement | LocalAgreement:
        """A gloo group per node of ``local_world_size`` consecutive ranks (torchrun's layout).

        ``local_world_size`` defaults to ``LOCAL_WORLD_SIZE``, else the whole world (one node).
        Returns a :class:`LocalAgreement` when each node runs a single rank.
        """
        from autotune import knobs

        dist = _dist()
        world, rank = dist.get_world_size(), dist.get_rank()
        local = local_world_size or knobs.local_world_size() or world
        if local < 1 or world % local != 0:
            raise ValueError(
                f"{owner}: local_world_size={local} does not divide the world size {world}: "
                "expected the same number of ranks on every node"
            )
        if local == 1:
            return LocalAgreement()
        timeout = datetime.timedelta(seconds=timeout_s)
        mine = None
        try:
            for node in range(world // local):
                ranks = list(range(node * local, (node + 1) * local))
                group = dist.new_group(ranks, timeout=timeout, backend="gloo")
                if rank in ranks:
                    mine = group
        except RuntimeError as exc:
            raise AgreementTimeout(
                f"{owner}: {where(None, 'creation of the gloo group')}: not every rank of the job joined "
                f"within {timeout_s:g} s (every rank must start its tuner together): {_first_line(exc)}"
            ) from exc
        agreement = cls(mine, timeout_s=timeout_s, owner=owner)
        hosts = agreement.all_gather(socket.gethostname(), step=None, what="check of the hosts")
        if len(set(hosts)) != 1:
            raise AgreementMismatch(
                f"{owner}: the local ranks {agreement._global_ranks} span several hosts {hosts}: "
                "expected LOCAL_WORLD_SIZE consecutive ranks per node (torchrun's layout)",
                ranks=range(local),
            )
        return agreement

    # -- side channel ---------------------------------------------------------------------------

    def _setup_store(self) -> None:
        dist = _dist()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        port = None
        if self.rank == 0:
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout, wait_for_workers=False)
            port = self._store.port
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, {"port": port, "process": self._me.to_dict()}, group=self._group)
        except RuntimeError as exc:
            raise AgreementTimeout(
                f"{self._owner}: {where(None, 'creation of the agreement group')}: not every local rank "
                f"joined within {self.timeout_s:g} s: {_first_line(exc)}"
            ) from exc
        self._procs = [ProcessInfo.from_dict(item.get("process")) if isinstance(item, dict) else None
                       for item in out]
        if self.rank != 0:
            self._store = dist.TCPStore("127.0.0.1", int(out[0]["port"]), is_master=False, timeout=timeout)
        self._store.set(f"seq/{self.rank}", "0:start")

    def _describe_ranks(self, ranks: Sequence[int]) -> str:
        local = ", ".join(str(r) for r in ranks)
        glob = ", ".join(str(self._global_ranks[r]) for r in ranks)
        return f"local rank(s) {local} (global rank(s) {glob})"

    def _mark(self, step: int | None, what: str) -> None:
        if self._store is None:
            raise RuntimeError(f"{self._owner}: {where(step, what)}: the agreement was closed")
        self._seq += 1
        try:
            self._store.set(f"seq/{self.rank}", f"{self._seq}:{'start' if step is None else step}")
        except RuntimeError as exc:
            raise AgreementTimeout(
                f"{self._owner}: {where(step, what)}: {self._describe_ranks([0])} did not answer: "
                f"the tuner's store on local rank 0 is unreachable ({_first_line(exc)})",
                step=step,
                ranks=(0,),
            ) from exc

    def _read_progress(self, rank: int) -> tuple[int, str]:
        key = f"seq/{rank}"
        if not self._store.check([key]):
            return 0, "nothing"
        seq, _, step = self._store.get(key).decode().partition(":")
        return int(seq), step

    def _poll_progress(self, seq: int, others: list[int]) -> tuple[list[int], list[int], dict[int, str]]:
        """Ranks behind ``seq``, ranks at ``seq`` that have not reported a failure, last steps seen.

        Waits up to :data:`DIAGNOSIS_GRACE_S` for peers in the same collective to report theirs.
        Blocks while the store's process is stopped: run it under a deadline.
        """
        self._store.set(f"fail/{self.rank}", str(seq))
        deadline = time.monotonic() + min(DIAGNOSIS_GRACE_S, self.timeout_s)
        while True:
            behind, pending, seen = [], [], {}
            for r in others:
                r_seq, r_step = self._read_progress(r)
                seen[r] = r_step
                if r_seq < seq:
                    behind.append(r)
                elif r_seq == seq:
                    failed = self._store.check([f"fail/{r}"]) and int(self._store.get(f"fail/{r}")) >= seq
                    if not failed:
                        pending.append(r)
            if not pending or time.monotonic() >= deadline:
                return behind, pending, seen
            time.sleep(0.05)

    def _diagnose(self, exc: BaseException, step: int | None, what: str, elapsed_s: float) -> AgreementError:
        others = [r for r in range(self.world_size) if r != self.rank]
        store_note = ""
        try:
            if self._store is None:
                raise RuntimeError("the agreement was closed")
            behind, pending, seen = call_with_deadline(
                lambda: self._poll_progress(self._seq, others),
                min(DIAGNOSIS_GRACE_S, self.timeout_s) + STORE_READ_GRACE_S,
                "a read of the tuner's store on local rank 0",
            )
        except (RuntimeError, StoreUnresponsive) as store_exc:
            # The store lives in local rank 0's process: unreachable or silent means rank 0 is;
            # any other rank whose process is gone or stopped is named too.
            behind, pending, seen = [0] if self.rank != 0 else others, [], {}
            if self.rank != 0:
                store_note = f"; its store is unreachable ({_first_line(store_exc)})"
            suspects = others
        else:
            suspects = sorted(set(behind) | set(pending))
        states = self._states(settle=suspects)
        gone = [r for r in others if states.get(r) in ("exited", "stopped")]
        missing = sorted(set(behind) | set(pending) | set(gone))
        if not missing:
            return AgreementError(
                f"{self._owner}: {where(step, what)} failed although every local rank reached it: "
                f"{_first_line(exc)}",
                step=step,
            )
        details = []
        for r in missing:
            proc = self._procs[r] if r < len(self._procs) else None
            state = states.get(r, "unknown")
            parts = []
            if proc is not None and state != "unknown":
                parts.append(describe_state(proc.pid, state))
            if r in pending:
                parts.append("entered it but did not complete it")
            elif r in seen:
                parts.append(f"last seen {_progress_text(seen[r])}")
            details.append(f"local rank {r} {', '.join(parts) or 'did not answer'}{store_note if r == 0 else ''}")
        if elapsed_s >= _TIMED_OUT_FRACTION * self.timeout_s:
            verdict = f"did not answer within {self.timeout_s:g} s"
        else:
            verdict = f"made it fail after {elapsed_s:.1f} s (before the {self.timeout_s:g} s timeout)"
        return AgreementTimeout(
            f"{self._owner}: {where(step, what)}: {self._describe_ranks(missing)} {verdict} "
            f"({'; '.join(details)}); collective error: {_first_line(exc)}",
            step=step,
            ranks=missing,
        )

    def _states(self, settle: Sequence[int] = ()) -> dict[int, str]:
        return dict(peer_states(self._procs, self._me, settle=settle)) if self._procs else {}

    def _run(self, step: int | None, what: str, fn: Any) -> Any:
        self._mark(step, what)
        began = time.monotonic()
        try:
            return fn()
        except RuntimeError as exc:
            raise self._diagnose(exc, step, what, time.monotonic() - began) from exc

    # -- collectives ----------------------------------------------------------------------------

    def broadcast(self, obj: Any, *, step: int | None, what: str) -> Any:
        dist = _dist()
        box = [obj]

        def run() -> Any:
            dist.broadcast_object_list(box, src=self._global_ranks[0], group=self._group)
            return box[0]

        return self._run(step, what, run)

    def all_gather(self, obj: Any, *, step: int | None, what: str) -> list[Any]:
        dist = _dist()
        out: list[Any] = [None] * self.world_size

        def run() -> list[Any]:
            dist.all_gather_object(out, obj, group=self._group)
            return out

        return self._run(step, what, run)

    def max_float(self, value: float, *, step: int | None, what: str) -> float:
        import torch

        dist = _dist()
        tensor = torch.tensor([float(value)], dtype=torch.float64)

        def run() -> float:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group)
            return float(tensor.item())

        return self._run(step, what, run)

    def close(self) -> None:
        """Drop the side-channel store (the gloo group lives until the default group is destroyed)."""
        self._store = None

    def __repr__(self) -> str:
        return f"GlooAgreement(rank={self.rank}, world_size={self.world_size}, timeout_s={self.timeout_s:g})"


def make_agreement(group: Any, *, timeout_s: float, owner: str = "OnlineTuner") -> Agreement:
    """The agreement a tuner uses for ``group``.

    ``None``: a gloo group over this node's ranks when ``torch.distributed`` is initialised with
    more than one rank, else :class:`LocalAgreement` (``torch`` is not even imported when the
    program has not imported it). An :class:`Agreement` is used as is; a ``ProcessGroup`` must be
    a gloo group of ranks on this host.
    """
    if group is None:
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return LocalAgreement()
        return GlooAgreement.for_local_ranks(timeout_s=timeout_s, owner=owner)
    if isinstance(group, Agreement):
        return group
    dist = _dist()
    if isinstance(group, dist.ProcessGroup):
        if dist.get_world_size(group) == 1:
            return LocalAgreement()
        return GlooAgreement(group, timeout_s=timeout_s, owner=owner)
    raise ValueError(
        f"{owner}: group={group!r} is a {type(group).__name__}: expected None, a gloo ProcessGroup or an Agreement"
    )
