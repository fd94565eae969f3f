"""The pipeline's worker thread: runs each queued job's d2h, adam_kernel and materialize in order.

All CPU work of the worker runs under ``thread_limit(job.threads)`` (or the count
``Pipeline.set_threads`` gave the step's jobs not begun yet), entered when a job needs a
different count and left at the end of each step (the barrier). torch's intra-op thread count is
per OS thread (OpenMP ICVs are per thread). Checked on torch 2.13 CPU (OpenMP backend):
``torch.set_num_threads(n)`` called in the worker makes the worker's kernels use n threads (1 or 2
busy threads seen in /proc per-thread CPU time) and leaves the main thread's count unchanged, but
it also sets the default that threads created later start with, hence the restore.

The worker runs with grad mode off for good, increments each parameter's step inside the kernel
call (once per step, in the first chunk holding it that runs), and calls the kernel calls made at
submit as they are (see :mod:`offload.pipeline._pipeline` for why the hot path is this lean); a
job without them gets them from the pipeline's ``CallBuilder`` after d2h. With an asynchronous
transport (``lookahead > 0``) it issues the next queued jobs' d2h before the current kernel.

A job is a description the worker only reads; what it learns (its kernel began, ran, its weights
are being or were written, the speculation's checksum places) goes into the job's
``JobProgress``, which only the worker and the transport write.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from offload.pipeline._calls import CallBuilder
from offload.pipeline._jobs import ChunkJob, DrainResult, StageRecord
from offload.state._items import KIND_TORCH
from offload.pipeline._signals import StepInterrupted
from offload.state._slabs import HostSlabs
from offload.threads._plan import thread_limit
from offload.pipeline._transport import Transport

logger = logging.getLogger(__name__)

__all__ = ["STOP", "Barrier", "OnWorker", "Worker", "worker_main", "write_weights"]


@dataclass(slots=True)
class Barrier:
    """A drain's marker in the queue: the worker ends the step there and hands back its result."""

    done: threading.Event = field(default_factory=threading.Event)
    """Set when :attr:`result` is there."""
    result: DrainResult | None = None
    """The step's records and first error."""


#: The queue entry that ends the worker thread.
STOP = object()


@dataclass(slots=True)
class OnWorker:
    """A function to run on the worker thread (see :meth:`Pipeline.on_worker`)."""

    fn: Any
    """Called with no arguments."""
    threads: int
    """Intra-op threads it runs with."""
    event: threading.Event = field(default_factory=threading.Event)
    """Set when it returned or raised."""
    error: BaseException | None = None
    """What it raised."""


def write_weights(transport: Transport, job: ChunkJob, slabs: HostSlabs, records: list[StageRecord]) -> None:
    """The materialize stage of ``job``: on the worker, or on the thread calling ``step()`` for a
    committed early chunk (``Pipeline.write_committed``); its progress says it began and ended."""
    progress = job.progress
    progress.writing = True
    transport.materialize(job, slabs, records)
    progress.materialized = True


class Worker:
    """State owned by the worker thread (never touched by other threads while it runs), except
    :attr:`calls`, which the submitting thread shares (its ``SlabListCache``), and the two
    fields other threads set (:attr:`cancel_at`, :attr:`threads_at`)."""

    def __init__(self, q: queue.Queue[Any], slabs: HostSlabs, transport: Transport, calls: CallBuilder) -> None:
        self.q = q
        self.slabs = slabs
        self.transport = transport
        self.records: list[StageRecord] = []
        self.error: BaseException | None = None
        self.stepped: set[int] = set()
        self.device: torch.device | None = transport.device
        self._threads: int | None = None
        self._limit = contextlib.ExitStack()
        self.calls = calls
        self.steps = 0
        """Barriers processed: the step the queued jobs belong to (:meth:`Pipeline.cancel`)."""
        self.cancel_at = -1
        """Skip the jobs of this step (set by another thread: read once per job)."""
        self.threads_at: tuple[int, int] = (-1, 0)
        """(step, threads): the jobs of that step not begun yet run with these threads instead of
        their own (``Pipeline.set_threads``; set by another thread: read once per job)."""

    def _use_threads(self, threads: int) -> None:
        if threads != self._threads:
            self._limit.close()
            self._limit.enter_context(thread_limit(threads))
            self._threads = threads

    def _release_threads(self) -> None:
        self._limit.close()
        self._threads = None

    def run(self) -> None:
        # Grad mode is per thread; nothing this thread runs is differentiated.
        torch.set_grad_enabled(False)
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        pending: collections.deque[Any] = collections.deque()
        while True:
            item = pending.popleft() if pending else self.q.get()
            if item is STOP:
                self._release_threads()
                return
            if isinstance(item, Barrier):
                self._barrier(item)
                continue
            if isinstance(item, OnWorker):
                try:
                    self._use_threads(item.threads)
                    item.fn()
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    item.error = exc
                finally:
                    self._release_threads()
                    item.event.set()
                continue
            job: ChunkJob = item
            try:
                # read per job: a new ring depth (between steps) holds from the next step on
                self._run_job(job, pending, self.transport.lookahead)
            finally:
                if job.done is not None:
                    job.done.set()

    def _run_job(self, job: ChunkJob, pending: collections.deque[Any], lookahead: int) -> None:
        """One queued job (see :meth:`run`); an error is kept for the step's drain."""
        if self.error is None and self.cancel_at == self.steps:
            self.error = StepInterrupted("the step was cut short before this chunk")
        if self.error is not None:
            return  # a failed or cut step: leave the remaining chunks untouched
        try:
            if job.update and job.progress.transfer is None:
                self.transport.issue_d2h(job)
            # Async transports: issue the gradient copies of the next queued jobs before this
            # job's kernel, so they run while it computes (never past a barrier).
            while job.update and len(pending) < lookahead and (
                not pending or isinstance(pending[-1], ChunkJob)
            ):
                try:
                    nxt = self.q.get_nowait()
                except queue.Empty:
                    break
                pending.append(nxt)
                if isinstance(nxt, ChunkJob) and nxt.update and nxt.progress.transfer is None:
                    self.transport.issue_d2h(nxt)
            self._process(job)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of step()
            logger.debug("chunk %d failed", job.chunk, exc_info=True)
            self.error = exc

    def _process(self, job: ChunkJob) -> None:
        at, threads = self.threads_at
        self._use_threads(threads if at == self.steps else job.threads)
        if job.update:
            if job.before_kernel is not None:
                # Before finish_d2h: the host transport reads (upcasts) gradients there, and the
                # checksum must come before any read of them (offload.overlap._speculation).
                job.progress.speculate = job.before_kernel(job)
            self.transport.finish_d2h(job, self.slabs, self.records)
            self._kernel(job)
        if job.materialize:
            write_weights(self.transport, job, self.slabs, self.records)

    def _kernel(self, job: ChunkJob) -> None:
        stepped = self.stepped
        t0 = time.perf_counter()
        progress = job.progress
        made = progress.calls
        if made is None:
            assert progress.grads is not None  # set by finish_d2h
            transport = self.transport
            made = self.calls.build(job, progress.grads, lambda it: transport.lowp_out(job, it),
                                    lambda it: transport.f32_out(job, it), host_weights=transport.host_weights)
        # Each parameter's step goes up once per optimizer step, in the first chunk holding it
        # that runs (set.add returns None: the test adds the slot as it goes).
        hyper, speculate = job.hyper, progress.speculate
        progress.kernel_started = True
        for (kind, fn, args), (slots, steps) in zip(made.calls, made.steps):
            new = [st for slot, st in zip(slots, steps) if slot not in stepped and not stepped.add(slot)]
            if progress.coef_in_grads and kind == KIND_TORCH:  # the operands are the products already
                hyper = replace(job.hyper, grad_coef=None)
            if speculate is not None and kind in speculate:  # checksums in the kernel's pass
                fn(*args, steps_to_increment=new, hyper=hyper, checksums=speculate[kind])
            else:
                fn(*args, steps_to_increment=new, hyper=hyper)
            hyper = job.hyper
        progress.calls = None
        progress.grads = None
        progress.speculate = None
        self._record_kernel(job, t0)

    def _record_kernel(self, job: ChunkJob, t0: float) -> None:
        t1 = time.perf_counter()
        job.progress.kernel_ran = True
        self.records.append(StageRecord(job.chunk, "adam_kernel", t0, t1, t1 - t0))

    def _barrier(self, barrier: Barrier) -> None:
        self._release_threads()
        last = None
        try:
            last = self.transport.flush()  # (first: the caller is ordered after it even if settle raises)
            self.transport.settle()
        except BaseException as exc:  # noqa: BLE001
            if self.error is None:
                self.error = exc
        pinned, registered = self.transport.pinned_stats()
        barrier.result = DrainResult(records=self.records, error=self.error, last_h2d_event=last,
                                     pinned_bytes=pinned, pinned_registrations=registered)
        self.records, self.error = [], None
        self.stepped = set()
        self.steps += 1
        barrier.done.set()


def worker_main(worker: Worker) -> None:
    try:
        worker.run()
    except BaseException:  # pragma: no cover - run() catches per job; this is a last resort
        logger.exception("offload worker thread died")
        raise
