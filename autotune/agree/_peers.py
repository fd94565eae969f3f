"""What happened to a peer process, and store reads that cannot hang.

When a collective fails, "did not answer within 30 s" is only a guess: the peer may have exited
1.6 s earlier (its connections closed), been stopped (SIGSTOP, a debugger: it holds its sockets
open and answers nothing), or still be running but slow. Local ranks share one host, so a
survivor can look at the peer's process directly (``/proc/<pid>/stat`` on Linux, ``kill(pid, 0)``
elsewhere) and say which.

Why a deadline thread around store reads: ``TCPStore.check`` and ``get`` wait for the server's
reply without any timeout (``TCPStore(timeout=)`` bounds only waiting for keys). The tuner's store
lives in local rank 0's process; when that process is stopped, the kernel still accepts the
request and the reply never comes (measured: ``check`` blocked > 500 s with ``timeout=30 s``).
``set`` does not wait for a reply, so the per-collective progress marks never block.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

__all__ = [
    "ProcessInfo",
    "StoreUnresponsive",
    "call_with_deadline",
    "describe_state",
    "me",
    "peer_states",
    "process_state",
]

ProcessState = Literal["running", "stopped", "exited", "unknown"]


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """A rank's process, as exchanged between ranks at setup (JSON-able fields only)."""

    pid: int
    host: str
    pid_ns: str
    """``/proc/self/ns/pid`` link text: pids mean the same process only within one pid namespace."""

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "host": self.host, "pid_ns": self.pid_ns}

    @classmethod
    def from_dict(cls, data: Any) -> ProcessInfo | None:
        if not isinstance(data, dict):
            return None
        try:
            return cls(int(data["pid"]), str(data["host"]), str(data["pid_ns"]))
        except (KeyError, TypeError, ValueError):
            return None

    def visible_from(self, other: ProcessInfo) -> bool:
        """Whether ``other`` (this process, usually) can look at this process by its pid."""
        return self.host == other.host and self.pid_ns == other.pid_ns and bool(self.pid_ns)


def me() -> ProcessInfo:
    """This process."""
    import socket

    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return ProcessInfo(os.getpid(), socket.gethostname(), ns)


def process_state(pid: int) -> ProcessState:
    """``"stopped"`` (SIGSTOP, a debugger), ``"exited"`` (gone or a zombie), ``"running"``
    (running or sleeping) or ``"unknown"``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096)
    except FileNotFoundError:
        return "exited"
    except OSError:
        raw = b""
    if raw:
        # "pid (comm) S ...": comm may hold spaces and parentheses, so split at the last ")".
        fields = raw[raw.rfind(b")") + 1 :].split()
        if fields:
            state = fields[0].decode(errors="replace")
            if state in ("T", "t"):
                return "stopped"
            if state in ("Z", "X", "x"):
                return "exited"
            return "running"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "exited"
    except OSError:
        return "unknown"
    return "running"


def describe_state(pid: int, state: ProcessState) -> str:
    """A phrase for an error message: ``"exited (process 123 is gone)"``."""
    if state == "exited":
        return f"exited (process {pid} is gone)"
    if state == "stopped":
        return f"is stopped (process {pid} is frozen by SIGSTOP or a debugger)"
    if state == "running":
        return f"is running (process {pid}) but did not answer"
    return f"is in an unknown state (process {pid})"


#: How long :func:`peer_states` watches a suspect that still looks alive before calling it running.
SETTLE_S = 0.5


def peer_states(peers: Sequence[ProcessInfo | None], mine: ProcessInfo, *,
                settle: Sequence[int] = (), settle_s: float = SETTLE_S) -> dict[int, ProcessState]:
    """The state of each peer's process by index; ``"unknown"`` where it is not visible from here.

    Peers in ``settle`` seen running are looked at again for up to ``settle_s``: a killed process
    closes its sockets before the kernel marks it gone, so a collective can fail a moment before
    the process looks exited.
    """
    deadline = time.monotonic() + settle_s
    while True:
        states: dict[int, ProcessState] = {}
        for i, peer in enumerate(peers):
            states[i] = "unknown" if peer is None or not peer.visible_from(mine) else process_state(peer.pid)
        if time.monotonic() >= deadline or all(states.get(i) != "running" for i in settle):
            return states
        time.sleep(0.05)


class StoreUnresponsive(TimeoutError):
    """A store read did not return within its deadline (the store's process is stopped or hung)."""


def call_with_deadline(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """``fn()`` on a daemon thread; its result, its exception, or :class:`StoreUnresponsive`.

    On timeout the thread is abandoned, blocked in a read that will never return; it holds no
    lock of ours and, being a daemon, does not keep the process alive.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"autotune-deadline:{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise StoreUnresponsive(f"{what} did not return within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")
