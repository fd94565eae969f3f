"""Device operations for the CUDA transport without a GPU (``offload.pipeline._cuda_transport.DeviceOps``).

Streams are threads that run their operations in order, like a CUDA stream on a copy engine;
events complete when their stream reaches them. Gates (``gate=True``) make every copy that should
overlap a kernel wait for that kernel to start (see ``test_cuda_schedule.py``). The ops count what
a GPU would make costly: pinned blocks (registrations, bytes held) and host waits on events, by
thread (the transport's polled waits count once each, when their ``query`` finds the event done;
``synchronize`` is the fake streams' device-side wait, and a test's own).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from offload.kernels._adamw import Hyper
from offload.state._slabs import HostSlabs

#: bf16 parameters of uneven sizes (chunks of different staging sizes: the ring grows in the first
#: step), and fp32 ones where a case asks for them.
SIZES = [700, 1500, 64, 2100, 333, 900]
HYPER = Hyper(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8)


def stepped_case(seed: int, fp32: Callable[[int], bool]) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                                torch.optim.AdamW, HostSlabs]:
    """Random parameters of :data:`SIZES` (fp32 where ``fp32(index)``, bf16 elsewhere), their fp32
    masters, torch's fused AdamW on those masters (the reference) and host slabs that hold them."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen).to(torch.float32 if fp32(i) else torch.bfloat16)
              for i, n in enumerate(SIZES)]
    masters = [p.float().clone().requires_grad_(True) for p in params]
    ref = torch.optim.AdamW(masters, lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                            weight_decay=HYPER.weight_decay, fused=True)
    slabs = HostSlabs([[p.shape for p in params]], speculable=None)
    for i, p in enumerate(params):
        slabs.flat("master", i).copy_(p.float())
    return params, masters, ref, slabs


class CallRecorder(TorchFunctionMode):
    """Records the names of the torch calls on this thread that :meth:`records` picks (modes are
    per thread: a worker's calls are not seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def records(self, name: str, args: tuple, kwargs: dict) -> bool:
        raise NotImplementedError

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if self.records(name, args, kwargs):
            self.calls.append(name)
        return func(*args, **kwargs)


class Log:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.entries: list[tuple[str, int, str]] = []
        self.violations: list[str] = []
        self._cond = threading.Condition()

    def add(self, entry: tuple[str, int, str]) -> None:
        with self._cond:
            self.entries.append(entry)
            self._cond.notify_all()

    def wait_for(self, entry: tuple[str, int, str], who: str) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: entry in self.entries, timeout=self.timeout_s):
                self.violations.append(f"{who} waited in vain for {entry}")

    def index(self, entry: tuple[str, int, str]) -> int:
        return self.entries.index(entry)


class FakeEvent:
    def __init__(self, label: Any, waits: list[tuple[str, Any]] | None = None) -> None:
        self.label = label
        self.done = threading.Event()
        self._waits = waits

    def synchronize(self) -> None:
        if self._waits is not None:  # a host wait: which thread waited, for what
            self._waits.append((threading.current_thread().name, self.label))
        assert self.done.wait(30), f"event {self.label} never completed"

    def query(self) -> bool:
        done = self.done.is_set()
        if done and self._waits is not None:  # the end of a polled host wait (one per wait)
            self._waits.append((threading.current_thread().name, self.label))
        return done

    def elapsed_time(self, end: FakeEvent) -> float:
        return 0.0


class FakeStream:
    """Runs its operations in order on its own thread, like a CUDA stream on a copy engine."""

    def __init__(self) -> None:
        self.q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (op := self.q.get()) is not None:
            op()


class FakeOps:
    """Device ops whose copies run asynchronously on fake streams; gates on transfer starts."""

    def __init__(self, log: Log, num_chunks: int, *, gate: bool = True) -> None:
        self.log, self.n, self.gate = log, num_chunks, gate
        self.streams: list[FakeStream] = []
        self.pinned: dict[int, int] = {}
        """data_ptr -> bytes of every block pinned and not given back."""
        self.registrations = 0
        """Blocks pinned so far."""
        self.host_waits: list[tuple[str, Any]] = []
        """(thread name, event label) of every ``synchronize`` of an event these ops made."""
        self.copy_calls: list[int] = []
        """Per call of :meth:`copies`: how many copies it queued."""
        self.caller = FakeStream()
        """What :meth:`current_stream` returns: the stream of the thread that calls ``step()``."""
        self.caller_waits: list[Any] = []
        """The labels of the events :attr:`caller` was made to wait for, in order."""

    def stream(self) -> FakeStream:
        s = FakeStream()
        self.streams.append(s)
        return s

    def event(self, label: tuple[str, int, str]) -> FakeEvent:
        return FakeEvent(label, self.host_waits)

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        def reached() -> None:
            kind, chunk, phase = event.label
            if phase == "start" and self.gate:  # the gate: the kernel this copy should overlap has started
                kernel = chunk - 1 if kind == "d2h" else chunk + 1
                if 0 <= kernel < self.n:
                    self.log.wait_for(("kernel", kernel, "start"), f"{kind} of chunk {chunk}")
            self.log.add(event.label)
            event.done.set()

        stream.q.put(reached)

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        if stream is self.caller:
            self.caller_waits.append(event.label)
        stream.q.put(event.synchronize)

    def current_stream(self) -> FakeStream:
        return self.caller

    def copies(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: FakeStream, *,
               spans: list[tuple[int, int]] | None = None) -> None:
        self.copy_calls.append(len(dsts))

        def run() -> None:  # in stream order, as on a device: a span is taken after the stream's waits
            for i, (dst, src) in enumerate(zip(dsts, srcs)):
                dst.copy_(src if spans is None else src.reshape(-1)[spans[i][0]:spans[i][1]])

        stream.q.put(run)

    def pin(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.registrations += 1
        self.pinned[buf.data_ptr()] = nbytes
        return buf

    def unpin(self, buf: torch.Tensor) -> None:
        assert buf.data_ptr() in self.pinned, "unpin of a tensor pin() did not return"
        del self.pinned[buf.data_ptr()]

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def close(self) -> None:
        for s in (*self.streams, self.caller):
            s.q.put(None)
