"""A fake CUDA device for the CPU dry run of ``bench.device_checks``: the CUDA transport's streams,
events and copies (``CPUOffloadAdamW(device_ops=)``) over bf16/fp16 CPU parameters, with the order
a GPU would give them checked.

Each stream is a thread that runs its operations in order (a copy engine); the stream of the
thread that calls ``step()`` (:meth:`FakeDevice.current_stream`) stands for the trainer's compute
stream. What makes this fake able to fail is a model of *device* order, kept when operations are
queued, independent of how fast the threads run: the caller's stream counts the work queued on it
(:meth:`FakeDevice.produce`, called by a post-accumulate-grad hook before the optimizer's own, for
each gradient backward writes there), an event recorded on a stream carries how much of that work
the stream is ordered after, and ``wait(stream, event)`` orders the waiting stream after it. Then:

* a copy that reads a gradient (d2h) must be ordered after the work that produced it, which only
  its wait on the job's ``ready_event`` gives; one that is not reads unfinished memory, modelled as
  NaN (the check then differs from its independent reference) and recorded as a violation;
* a copy that writes a parameter (h2d) must be ordered after all the work the caller queued before
  it (backward may still read the weight), which only its wait on the job's ``write_event`` gives
  by the device; one that is not is recorded as a violation. (On a GPU today such a copy is also
  ordered by host waits: the chunk's d2h end, or the device checksums ``step()`` reads; the fake
  does not count them, so the transport's own wait is what is checked.)

``drop=`` ("ready" or "write") makes the fake ignore those waits, as a transport that forgot them
would: the seam ``tests/test_device_checks.py`` uses to prove the dry run fails then. Host waits
on events poll ``query()`` (``offload.pipeline._waits``); pinned blocks are plain host memory.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Callable

import torch
from torch import Tensor, nn

__all__ = ["DROPS", "FakeDevice"]

#: What :class:`FakeDevice` can drop: the d2h stream's wait on a job's ready event, or the h2d
#: stream's wait on its write event (the same event, recorded when ``step()`` began).
DROPS = ("ready", "write")

_WAIT_S = 60.0  # a stream's device wait on an event that never completes: a fake hung, said so


class FakeEvent:
    def __init__(self, label: tuple[str, int, str]) -> None:
        self.label = label
        self.done = threading.Event()
        self.pos = 0
        """The caller's work this event is ordered after (set when recorded)."""

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        if not self.done.wait(_WAIT_S):
            raise RuntimeError(f"fake event {self.label} never completed")

    def elapsed_time(self, end: FakeEvent) -> float:
        return 0.0


class FakeStream:
    """Operations in order on a thread of its own; :attr:`seen`: the caller's work it is ordered after."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.seen = 0
        self._q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"fake-{role}-stream", daemon=True)
        self.errors: list[str] = []
        """What an operation raised on this stream (a device wait that never ended)."""
        self._thread.start()

    def put(self, op: Callable[[], None]) -> None:
        self._q.put(op)

    def _run(self) -> None:
        while (op := self._q.get()) is not None:
            try:
                op()
            except Exception as exc:  # noqa: BLE001 - kept for the check, the stream goes on
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self._q.put(None)


class FakeDevice:
    """``DeviceOps`` whose streams are threads and whose device order is checked (module doc)."""

    def __init__(self, *, drop: str | None = None) -> None:
        if drop is not None and drop not in DROPS:
            raise ValueError(f"drop={drop!r}: expected None or one of {DROPS}")
        self.drop = drop
        self.violations: list[str] = []
        """One line per copy a GPU would not have ordered (see the module doc)."""
        self.dropped = 0
        """Waits ignored because of :attr:`drop`."""
        self.produced = 0
        """Gradients :meth:`produce` was told of."""
        self._lock = threading.Lock()
        self._pos = 0  # work queued on the caller's stream so far
        self._written: dict[int, int] = {}  # storage address -> the caller's work that wrote it
        self._streams: list[FakeStream] = []
        self._caller = FakeStream("caller")

    # -------------------------------------------------------------- what the model does
    def produce(self, grad: Tensor) -> None:
        """Backward wrote ``grad`` on the caller's stream (one unit of its work)."""
        with self._lock:
            self._pos += 1
            self._written[grad.untyped_storage().data_ptr()] = self._pos
            self.produced += 1
        self._caller.put(lambda: None)

    def producing(self, model: nn.Module) -> None:
        """:meth:`produce` for every gradient of ``model``, from a post-accumulate-grad hook
        registered now: before the optimizer's (build the optimizer after), so each gradient is
        produced before the hook that may start its chunk records the chunk's ready event."""
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p: self.produce(p.grad))

    def sync(self) -> None:
        """The host waits until the caller's stream ran everything queued on it (what it waits
        for included): where the next forward's kernels would start."""
        done = threading.Event()
        self._caller.put(done.set)
        if not done.wait(_WAIT_S):
            raise RuntimeError("the fake caller stream never drained")

    # -------------------------------------------------------------- DeviceOps
    def stream(self) -> FakeStream:
        # A CudaTransport makes its d2h stream, then its h2d stream (one pair per transport).
        s = FakeStream(("d2h", "h2d")[len(self._streams) % 2])
        self._streams.append(s)
        return s

    def event(self, label: tuple[str, int, str]) -> FakeEvent:
        return FakeEvent(label)

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        with self._lock:
            event.pos = self._pos if stream is self._caller else stream.seen
        stream.put(event.done.set)

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        if self.drop is not None and event.label[0] == "ready" and stream.role == ("d2h" if self.drop == "ready" else "h2d"):
            self.dropped += 1
            return
        with self._lock:
            stream.seen = max(stream.seen, event.pos)
        stream.put(event.synchronize)

    def current_stream(self) -> FakeStream:
        return self._caller

    def copies(self, dsts: list[Tensor], srcs: list[Tensor], stream: FakeStream, *,
               spans: list[tuple[int, int]] | None = None) -> None:
        unfinished = False
        with self._lock:
            if stream.role == "d2h":
                need = max((self._written.get(s.untyped_storage().data_ptr(), 0) for s in srcs), default=0)
                if stream.seen < need:
                    unfinished = True
                    self.violations.append(f"a gradient copy ordered after {stream.seen} of the {need} pieces of "
                                           "work that produced what it reads (no wait on its ready event)")
            elif stream.role == "h2d" and stream.seen < self._pos:
                self.violations.append(f"a weight copy ordered after {stream.seen} of the {self._pos} pieces of "
                                       "work queued before it, which may still read the weights (no wait on its "
                                       "write event)")

        def run() -> None:  # in stream order; a span is taken on the stream, after its waits
            for i, (dst, src) in enumerate(zip(dsts, srcs)):
                if unfinished:  # what a copy that ran ahead of the producer would read
                    dst.fill_(float("nan"))
                else:
                    dst.copy_(src if spans is None else src.reshape(-1)[spans[i][0]:spans[i][1]])

        stream.put(run)

    def pin(self, nbytes: int) -> Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def unpin(self, buf: Tensor) -> None:
        pass

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def errors(self) -> list[str]:
        """What the streams' operations raised (a device wait on an event that never completed)."""
        return [e for s in (*self._streams, self._caller) for e in s.errors]

    def close(self) -> None:
        for s in (*self._streams, self._caller):
            s.stop()
