"""Host waits on device events: polled with a short sleep, bounded by a timeout.

``torch.cuda.Event.synchronize()`` has no timeout, and under CUDA's default scheduling (fewer
active contexts than CPUs) the waiting thread spins its core at 100 %: during an overlapped
backward the worker would take a core from the trainer, and a peer rank that died (an NCCL
collective that never ends, so the gradients' ready event never completes) would hang ``step()``
forever. So every host wait of the CUDA transport polls ``event.query()`` and sleeps between two
polls: 50 us at first, doubling up to 1 ms. A wait whose event is done costs one query; a longer
one oversleeps its event by at most the time it already waited plus 50 us (the sleeps double),
and never by more than 1 ms, against a chunk kernel of milliseconds (4 Mi elements at 28 bytes
each take ~10 ms at 12 GB/s); a thread that waits long wakes at most ~1000 times a second for a
query of microseconds. After ``timeout_s`` it raises :class:`DeviceWaitTimeout`, one line naming
what it waited for, the event's label and the timeout: the step fails (the optimizer's rule for
failed steps then applies: whole or refused) instead of hanging.

The timeout is ``CPUOffloadAdamW(device_timeout_s=)``: by default the tuner's ``timeout_s`` where
the optimizer is tuned, else :data:`DEVICE_TIMEOUT_S`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["DEVICE_TIMEOUT_S", "FIRST_SLEEP_S", "LONGEST_SLEEP_S", "DeviceWaitTimeout", "EventWait", "check_timeout"]

#: Default bound of one host wait on a device event, in seconds: ``AutotuneConfig.timeout_s``'s
#: default, the time the tuner's collectives give a peer before they fail.
DEVICE_TIMEOUT_S = 300.0
#: The first sleep between two polls of an event that is not done yet.
FIRST_SLEEP_S = 50e-6
#: The longest sleep between two polls (the sleeps double up to it).
LONGEST_SLEEP_S = 1e-3


def check_timeout(timeout_s: Any) -> float:
    """``timeout_s`` (``device_timeout_s``) as a float; ``ValueError`` unless a finite number > 0."""
    t = timeout_s
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
        raise ValueError(f"device_timeout_s={t!r}: expected a finite number of seconds > 0")
    return float(t)


class DeviceWaitTimeout(RuntimeError):
    """A device event the host waited for did not complete within the timeout."""


@dataclass(frozen=True, slots=True)
class EventWait:
    """Waits on the host for device events (anything with ``query() -> bool``): polled with
    sleeps, at most :attr:`timeout_s` each (see the module doc)."""

    timeout_s: float = DEVICE_TIMEOUT_S
    """Seconds one wait may take before it raises :class:`DeviceWaitTimeout`."""
    clock: Callable[[], float] = time.monotonic
    """Seconds, monotonic (tests pass a fake)."""
    sleep: Callable[[float], None] = time.sleep
    """Sleeps that many seconds, releasing the GIL (tests pass a fake)."""

    def __post_init__(self) -> None:
        check_timeout(self.timeout_s)

    def __call__(self, event: Any, label: Any, what: str) -> None:
        """Return once ``event`` completed; ``label``: the event's (``("d2h", chunk, "end")``),
        ``what``: what it guards (``"chunk 3's gradients"``), both for the error."""
        if event.query():
            return
        deadline = self.clock() + self.timeout_s
        pause = FIRST_SLEEP_S
        while True:
            self.sleep(pause)
            if event.query():
                return
            if self.clock() >= deadline:
                raise DeviceWaitTimeout(
                    f"{what}: device event {label} not complete after {self.timeout_s:g} s (device_timeout_s); "
                    "expected it within the timeout: a peer rank that died or hangs in a collective, or a hung "
                    "device, leaves it pending")
            pause = min(pause * 2, LONGEST_SLEEP_S)
