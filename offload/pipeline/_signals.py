"""Signals that arrive while ``step()`` changes the state wait until the step is done.

A Python signal handler runs on the main thread between two bytecodes, wherever that thread is:
a SIGALRM watchdog or Ctrl-C whose handler raises would leave ``step()`` while the worker thread
still updates chunks, and the loop that catches the exception and goes on would train on
parameters whose weights, moments and step counters come from different steps (issue 38). So
while ``step()`` runs, every signal that has a Python handler is held: the handler is swapped
for one that notes the signal, and when the step is done the original handlers are put back and
each noted signal is raised again (``signal.raise_signal``), so the user's handler runs then,
once, with the state consistent (if it raises, the signals noted after it are dropped). A
watchdog that saves a checkpoint sees a finished step.

The same signal arriving a second time while held (Ctrl-C pressed again) cuts the step short:
:attr:`DeferredSignals.on_repeat` (the step's cancel, :meth:`Pipeline.cancel`) makes the worker
skip the chunks it has not started, the step ends with :class:`StepInterrupted`, and the user's
handler runs as above. Where that leaves a parameter part-stepped the optimizer refuses to go on
until a state dict is loaded. The user's handler never runs inside the step: code there that
catches ``Exception`` (ours or torch's) would swallow what it raises.

Only the main thread can install handlers; a ``step()`` on another thread is never interrupted by
a Python signal handler (they run on the main thread), so nothing is held there. Signals without
a Python handler (the default action, ignored, or a C handler) are left alone.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["DeferredSignals", "StepInterrupted"]


@functools.cache
def _signals() -> tuple[int, ...]:
    """The signals a handler may be installed for (``valid_signals`` costs ~50 us a call)."""
    fixed = {getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name)}
    return tuple(sorted(set(signal.valid_signals()) - fixed))


class StepInterrupted(Exception):
    """The step was cut short: a held signal arrived again (see the module doc)."""


class DeferredSignals:
    """Context manager: hold the signals that have Python handlers until it exits (see module doc)."""

    __slots__ = ("_saved", "pending", "repeated", "on_repeat")

    def __init__(self) -> None:
        self._saved: dict[int, Any] = {}
        self.pending: list[int] = []
        """The signals held, in arrival order (each once)."""
        self.repeated: int | None = None
        """A held signal that arrived again."""
        self.on_repeat: Callable[[], None] | None = None
        """Called (on the main thread, from the handler) when a held signal arrives again."""

    def __enter__(self) -> DeferredSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in _signals():
            try:
                handler = signal.getsignal(sig)
            except (OSError, ValueError):  # pragma: no cover - a signal number the platform lacks
                continue
            if callable(handler):
                self._saved[sig] = handler
                signal.signal(sig, self._hold)
        return self

    def _hold(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if sig not in self.pending:
            self.pending.append(sig)
            logger.warning("CPUOffloadAdamW: %s arrived during step(); its handler runs when the step is done "
                           "(send it again to cut the step short)", name)
            return
        if self.repeated is None:
            self.repeated = sig
            if self.on_repeat is not None:
                self.on_repeat()
            logger.warning("CPUOffloadAdamW: %s again: the step is cut short after the chunks already "
                           "started; its handler runs then", name)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        saved, self._saved = self._saved, {}
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        pending, self.pending = self.pending, []
        for sig in pending:  # the user's handler runs now; what it raises leaves step()
            signal.raise_signal(sig)
