"""An :class:`~autotune.agree._agree.Agreement` whose ranks are threads of one process.

For simulations and tests: several tuners (or anything else that takes an agreement, such as
``offload.plan_cpu_threads(agreement=...)``) run in threads of one process and agree as local
ranks on a node would. The collectives are those of ``GlooAgreement`` (all-gather, broadcast, max)
with its semantics: every object is pickled by its sender and unpickled by each receiver, as
gloo's object collectives do, so no rank ever holds another rank's object, and a value that does
not pickle fails here as it would over gloo. A barrier stands in for the network.

Why threads: on a 2-core machine eight gloo processes spend most of a minute starting and about
2 s per tuning session in socket round trips, against about 0.1 s per session in threads.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

from autotune.agree._agree import AgreementTimeout, where

__all__ = ["InProcessAgreement"]

#: Seconds a collective waits for the other ranks before it raises :class:`AgreementTimeout`.
DEFAULT_TIMEOUT_S = 60.0


class _Hub:
    """What the ranks of one group share: a barrier, one slot per rank, a count of collectives."""

    def __init__(self, world_size: int, timeout_s: float, owner: str) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.owner = owner
        self.barrier = threading.Barrier(world_size)
        self.slots: list[bytes | None] = [None] * world_size
        self.calls = 0

    def exchange(self, rank: int, payload: bytes, *, step: int | None, what: str) -> list[bytes | None]:
        self.slots[rank] = payload
        self._wait(step, what)
        out = list(self.slots)
        if rank == 0:
            self.calls += 1
        self._wait(step, what)  # nobody overwrites a slot before every rank read it
        return out

    def _wait(self, step: int | None, what: str) -> None:
        try:
            self.barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError as exc:
            raise AgreementTimeout(
                f"{self.owner}: {where(step, what)}: another rank failed or did not arrive "
                f"within {self.timeout_s:g} s",
                step=step,
            ) from exc


class InProcessAgreement:
    """One rank of a group of agreements over threads of this process.

    Make the whole group with :meth:`group` and use each member from its own thread; every member
    must enter every collective, in the same order (as over gloo).
    """

    def __init__(self, hub: _Hub, rank: int) -> None:
        self._hub = hub
        self.rank = rank
        self.world_size = hub.world_size

    @classmethod
    def group(cls, world_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
              owner: str = "InProcessAgreement") -> list[InProcessAgreement]:
        """``world_size`` agreements, one per rank, in rank order; collectives that wait longer
        than ``timeout_s`` for the others raise :class:`AgreementTimeout` naming ``owner`` and the step."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"InProcessAgreement.group: world_size={world_size!r}: expected an int >= 1")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"InProcessAgreement.group: timeout_s={timeout_s!r}: expected a number of seconds > 0")
        hub = _Hub(world_size, float(timeout_s), owner)
        return [cls(hub, r) for r in range(world_size)]

    @property
    def collectives(self) -> int:
        """Collectives the group has completed (the same on every member)."""
        return self._hub.calls

    def all_gather(self, obj: Any, *, step: int | None, what: str) -> list[Any]:
        rows = self._hub.exchange(self.rank, pickle.dumps(obj), step=step, what=what)
        return [pickle.loads(row) for row in rows]  # type: ignore[arg-type]

    def broadcast(self, obj: Any, *, step: int | None, what: str) -> Any:
        payload = pickle.dumps(obj if self.rank == 0 else None)
        rows = self._hub.exchange(self.rank, payload, step=step, what=what)
        return pickle.loads(rows[0])  # type: ignore[arg-type]

    def max_float(self, value: float, *, step: int | None, what: str) -> float:
        return max(float(v) for v in self.all_gather(float(value), step=step, what=what))

    def close(self) -> None:
        """Nothing to release (the group lives as long as its members)."""

    def abort(self) -> None:
        """Break the group's barrier: every rank waiting in, or later entering, a collective raises
        :class:`AgreementTimeout` at once (call it from a rank that failed, so the others stop)."""
        self._hub.barrier.abort()

    def __repr__(self) -> str:
        return f"InProcessAgreement(rank={self.rank}, world_size={self.world_size})"
