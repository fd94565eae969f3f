"""The chunked step: a persistent worker thread running d2h / adam_kernel / materialize per chunk.

One worker thread per optimizer (:mod:`offload.pipeline._worker`) takes :class:`ChunkJob` s from a FIFO
queue. A job runs, in order, some of: ``d2h`` (gradients to where the kernel reads them: nothing on
the CPU unless a torch-kernel gradient needs an upcast into the chunk-sized scratch buffer),
``adam_kernel`` (AdamW on the chunk's slab views, with the functions of the pipeline's
:class:`KernelSet`) and ``materialize`` (the new weights into the model's parameters).
:meth:`Pipeline.drain` waits until every job submitted so far is done and returns their stage
records and the first error.

Transports (:class:`offload.pipeline._transport.Transport`): ``offload.pipeline._host_transport.HostTransport``
(parameters on the CPU: in place where the kernel allows, else copies through a chunk-sized scratch
buffer) and ``offload.pipeline._cuda_transport.CudaTransport`` (a pinned ring per direction, d2h and h2d on
side streams with events; the worker issues the next chunks' d2h before running the current
chunk's kernel).

Kernel "fused-mp" (items of kind MP: bf16/fp16 parameters): no upcast and no downcast pass. On the
CPU the kernel reads the gradient itself and writes the low-precision weight straight into the
parameter (a chunk started during backward writes a host buffer instead, see the host transport);
on CUDA it reads the pinned low-precision staging and writes the weight into the h2d ring.

Per-chunk Python. A memory-bound step keeps the memory bus busy only while a kernel runs; the
worker's Python between two kernel calls leaves it idle, and right after a kernel has streamed
~100 MB through the caches that Python runs slowly. Measured on a 2-core VM, 125M bf16 model,
4 Mi-element chunks: 0.2-0.45 ms between kernel calls, 8-15% of the step, with a plain hot path.
So it is kept short: the slab views of a chunk are made once and reused (``SlabListCache``), a whole
parameter goes to the fused-mp kernel as it is (no view, ``offload.pipeline._operands.param_operand``), the
step counters are incremented inside the kernel call, the worker thread runs with grad mode off for
good, and on the CPU a step's fused-mp job gets its kernel calls on the submitting thread
(``HostTransport.prepare``), made while the worker runs the previous kernel.

Who writes what: a :class:`ChunkJob` is frozen once its maker (``offload.pipeline._step``, the
launcher of ``offload.overlap``) made it; what running it learns goes into its ``JobProgress``,
written only by the worker and the transport; every kernel call is made by the pipeline's
:class:`~offload.pipeline._calls.CallBuilder` (at submit for the host's in-place jobs, else on
the worker after d2h).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from offload.pipeline._buffers import SlabListCache
from offload.pipeline._calls import CallBuilder
from offload.pipeline._jobs import ChunkJob, DrainResult, StageRecord
from offload.kernels._adamw import DEFAULT_KERNELS, KernelSet
from offload.state._slabs import Chunk, HostSlabs
from offload.pipeline._transport import Transport
from offload.pipeline._worker import STOP, Barrier, OnWorker, Worker, worker_main, write_weights

logger = logging.getLogger(__name__)

__all__ = ["Pipeline"]

#: How often a waiting ``drain`` checks that the worker thread is still alive, in seconds.
_LIVENESS_POLL_S = 1.0


def _shutdown(q: queue.Queue[Any], thread: threading.Thread, transport: Transport) -> None:
    if thread.is_alive():
        q.put(STOP)
        thread.join(timeout=10.0)
    if thread.is_alive():  # still in a job: its pinned memory may be in use
        logger.warning("the optimizer's worker thread did not stop within 10 s; its pinned memory is kept")
        return
    try:
        transport.close()
    except Exception:  # noqa: BLE001 - closing must not raise out of close() or a finalizer
        logger.warning("releasing the transport's pinned memory failed", exc_info=True)


class Pipeline:
    """Owns the worker thread and its queue. Thread-safe ``submit``; ``drain`` from one thread.

    ``kernels``: the kernel functions every job of this pipeline calls (tests pass spies).
    """

    def __init__(
        self, slabs: HostSlabs, transport: Transport, *, name: str,
        kernels: KernelSet = DEFAULT_KERNELS,
    ) -> None:
        self._q: queue.Queue[Any] = queue.Queue()
        self._lists = SlabListCache(slabs)
        self._prepare_failed = False
        self.kernels = kernels
        self.calls = CallBuilder(self._lists, kernels)
        """Makes every kernel call of the pipeline's jobs (its templates are read by tests)."""
        self._worker = Worker(self._q, slabs, transport, self.calls)
        self._thread = threading.Thread(
            target=worker_main, args=(self._worker,), name=name, daemon=True
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._q, self._thread, transport)
        self.transport = transport
        self._caller_records: list[StageRecord] = []  # stages write_committed ran on the caller

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: ChunkJob) -> None:
        """Queue ``job``; first the transport may have its kernel calls made on this thread (a
        raise there leaves ``job`` as it was: the worker makes them)."""
        if not self._finalizer.alive:
            raise RuntimeError("the optimizer's pipeline is closed")
        try:
            self.transport.prepare(job, self.calls)
        except Exception:  # noqa: BLE001 - the worker meets the same problem and reports it
            if not self._prepare_failed:  # the worker's path still works, but slower: say so once
                self._prepare_failed = True
                logger.warning("preparing chunk %d's kernel call at submit failed; the worker "
                               "prepares it instead (slower)", job.chunk, exc_info=True)
        self._q.put(job)

    def on_worker(self, fn: Any, *, threads: int) -> None:
        """Run ``fn()`` on the worker thread with ``threads`` intra-op threads and wait for it
        (the NUMA first touch of the slabs: the pages land where the kernels will run)."""
        done = OnWorker(fn, threads)
        self._q.put(done)
        while not done.event.wait(_LIVENESS_POLL_S):
            if not self._thread.is_alive():
                raise RuntimeError("the optimizer's worker thread died; see the log")
        if done.error is not None:
            raise done.error

    def write_committed(self, job: ChunkJob) -> None:
        """The weight writes of a committed early chunk (``update=False``): on this thread, now,
        where the transport allows it (``caller_writes``: the thread calling ``step()`` waits
        anyway, while the worker runs the last early kernels), else queued. Their stage records
        join the next drain's."""
        if not self.transport.caller_writes:
            self.submit(job)
            return
        records: list[StageRecord] = []
        write_weights(self.transport, job, self._worker.slabs, records)
        self._caller_records.extend(records)

    @property
    def step_index(self) -> int:
        """The step the jobs queued now belong to (the drains so far); see :meth:`cancel`."""
        return self._worker.steps

    def set_threads(self, threads: int) -> None:
        """The jobs of the current step the worker has not begun yet run with ``threads`` intra-op
        threads instead of their own (``step()``: the early jobs of a backward that is over; the
        step's own jobs are made with ``threads``). A job begun keeps its count: either is exact."""
        self._worker.threads_at = (self._worker.steps, threads)

    def cancel(self, step_index: int) -> None:
        """Cut step ``step_index`` short (from any thread): the worker skips its jobs not started
        and its drain reports ``StepInterrupted``; a later step is never affected."""
        self._worker.cancel_at = step_index

    def wait_for(self, job: ChunkJob) -> None:
        """Wait until the worker processed (or skipped) ``job`` (its ``done`` event)."""
        while not job.done.wait(_LIVENESS_POLL_S):
            if not self._thread.is_alive():
                raise RuntimeError("the optimizer's worker thread died; see the log")

    def forget_layout(self) -> None:
        """Drop the cached kernel argument lists of the old chunk layout (call between steps)."""
        self._lists.clear()
        self.calls.forget()
        self.transport.forget()

    def resize_rings(self, slots: int) -> None:
        """A new staging ring depth (``OffloadSettings.ring_slots``; call between steps): the
        transport's rings are re-made by the worker at the next :meth:`reserve`, as for a new
        layout (:meth:`forget_layout`); ignored by the host transport."""
        self.transport.resize_rings(slots)

    def reserve(self, chunks: Sequence[Chunk], dtypes: Sequence[torch.dtype],
                places: Mapping[int, tuple[int, torch.dtype]]) -> None:
        """Between steps (the worker idle): the transport makes what this chunk layout stages
        through, on the worker, and this thread waits for it (``Transport.reserve``)."""
        self.on_worker(functools.partial(self.transport.reserve, chunks, dtypes, places), threads=1)

    def drain(self) -> DrainResult:
        """Wait until every submitted job is done; return their records and the first error.
        On CUDA the weight copies of the jobs may still run: the calling thread's current stream
        is made to wait for them on the device (``Transport.order_caller``), so its next work
        (a forward) reads the new weights, whatever the caller does with an error."""
        if not self._finalizer.alive:
            raise RuntimeError("the optimizer's pipeline is closed")
        barrier = Barrier()
        t0 = time.perf_counter()
        self._q.put(barrier)
        while not barrier.done.wait(_LIVENESS_POLL_S):
            if not self._thread.is_alive():
                raise RuntimeError("the optimizer's worker thread died; see the log")
        result = barrier.result
        assert result is not None
        if self._caller_records:
            result.records.extend(self._caller_records)
            self._caller_records = []
        result.wait_s = time.perf_counter() - t0
        if result.last_h2d_event is not None:  # (CUDA) before anything can raise: see order_caller
            self.transport.order_caller(result.last_h2d_event)
        return result

    def close(self) -> None:
        self._finalizer()
