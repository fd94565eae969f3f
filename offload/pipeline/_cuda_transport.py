"""The CUDA transport of the pipeline: a pinned ring per direction, side streams, events.

Schedule (worker thread, chunk ``i`` in the kernel):

* the gradients of the next ``slots - 1`` chunks come down on the d2h stream: the worker issues
  their copies (into ring slots) before it runs chunk ``i``'s kernel, so the copy engine works
  while the CPU computes;
* the weights of chunk ``i - 1`` go up on the h2d stream: ``materialize`` fills a ring slot and
  issues the copies without waiting for them, so they run during chunk ``i``'s kernel;
* a ring slot is reused only after the event of its last copy (``slots`` chunks earlier).

No full-size host gradient slab: the kernels read the pinned copies in the ring where they are
(fused-mp: bf16/fp16; fp32 gradients as they came down); only a low-precision gradient of the torch
kernel is upcast, into the chunk-sized scratch buffer. For a chunk started during backward the
staged gradients of torch's kernel are checksummed first, once their copy ended (the native
kernel sums what it reads in its own pass), so ``step()`` validates what was consumed
(``offload.overlap._speculation``). The native kernel writes a step's new weights (bf16/fp16, or
fp32 besides the master) straight into the h2d ring slot. Host memory is
the state (12 bytes per parameter) plus ``2 x slots`` pinned blocks as large as the largest
chunk's staging; only with ``overlap_backward`` does fused-mp add one pinned block holding a place
of the parameter's dtype per bf16/fp16 parameter (the weights a chunk started during backward
keeps until ``step()``). Pinned memory is a few blocks of exact size (page-rounded), registered
between steps on the idle worker when a layout, ring depth or kernel is set (:meth:`CudaTransport.reserve`),
never during a step (:mod:`offload.pipeline._pinned`); each step reports the bytes held and the
registrations made since the last report (``StepStats.pinned_bytes``, ``pinned_registrations``).
The d2h copies wait on the device for a ``ready_event`` and the weight copies for a ``write_event``,
both made through the device ops (:meth:`CudaTransport.ready_event`), so a fake device sees them
(``bench.device_checks._fake_device`` checks a GPU's order in the CPU dry run of ``bench.device_checks``).
The two copy streams come from torch's shared stream pool (torch 2.13 makes no other kind): their
handles are logged at INFO when a transport is made.

Every device operation goes through a :class:`DeviceOps` (streams, events, asynchronous copies,
pinned blocks). :class:`TorchCudaOps` is the real one; a test passes one whose streams are
threads, so the schedule itself, which copies are in flight while which kernel runs, is checked
on a machine without a GPU (``tests/test_cuda_schedule.py``), and so are the registrations
(``tests/test_cuda_pinned.py``). Every host wait on an event is polled with short sleeps and
bounded (:mod:`offload.pipeline._waits`): a copy that never ends fails the step, naming its chunk,
instead of hanging it. Not measured on a GPU with this ring yet (the H200 figures in
``bench/results/device-cuda-path-h200.md`` predate it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from offload.pipeline._buffers import STAGING_ALIGN, Scratch
from offload.pipeline._calls import CallBuilder
from offload.pipeline._jobs import ChunkJob, StageRecord
from offload.pipeline._cuda_runtime import CudaRuntime
from offload.pipeline._pinned import LowpPlaces, PinnedPool, Ring
from offload.pipeline._waits import DEVICE_TIMEOUT_S, EventWait
from offload.state._items import KIND_MP, KIND_TORCH, Item
from offload.kernels._adamw import ChecksumKernel
from offload.pipeline._operands import torch_grads
from offload.state._slabs import Chunk, HostSlabs, View

logger = logging.getLogger(__name__)

__all__ = ["STAGING_SLOTS", "CudaTransport", "DeviceOps", "TorchCudaOps"]

#: Pinned chunk-sized slots per direction by default (``OffloadSettings.ring_slots=None``). 2 is
#: double buffering: chunk i+1's gradients come down and chunk i-1's weights go up while chunk i
#: is in the kernel; more slots let copies run further ahead of a kernel that is sometimes slower
#: (the reference system uses 4). Unmeasured beyond 2; the tuner's ``ring_slots`` knob probes it.
STAGING_SLOTS = 2


class DeviceOps(Protocol):
    """The device operations the transport uses. Events have ``query() -> bool`` (completed yet;
    the host waits by polling it, :mod:`offload.pipeline._waits`) and ``elapsed_time(end)``."""

    def stream(self) -> Any: ...

    def event(self, label: tuple[str, int, str]) -> Any: ...

    def record(self, event: Any, stream: Any) -> None: ...

    def wait(self, stream: Any, event: Any) -> None: ...

    def current_stream(self) -> Any:
        """The calling thread's current stream on the device."""
        ...

    def copies(self, dsts: list[Tensor], srcs: list[Tensor], stream: Any, *,
               spans: list[tuple[int, int]] | None = None) -> None:
        """``dsts[i].copy_(srcs[i])`` for every ``i``, in order, on ``stream`` (one call per chunk and
        direction); ``spans[i]``: elements ``start:stop`` of ``srcs[i]`` flattened, taken on the
        stream (after its waits), so the dense copy a non-contiguous source needs reads the
        gradient the stream waited for and lives until the copy ran."""
        ...

    def pin(self, nbytes: int) -> Tensor:
        """A page-locked uint8 host tensor of ``nbytes`` bytes: one registration."""
        ...

    def unpin(self, buf: Tensor) -> None:
        """Give back a tensor :meth:`pin` returned; every copy touching it has completed."""
        ...

    def context(self) -> contextlib.AbstractContextManager[Any]: ...


def _unregister_all(blocks: dict[int, tuple[Tensor, bool]], runtime: CudaRuntime) -> None:
    """Backstop of a :class:`TorchCudaOps` collected with blocks still registered (its transport
    was not closed): unregister them before their memory can be freed (the dict holds it until
    then)."""
    try:
        for ptr, (_, registered) in list(blocks.items()):
            if registered and int(runtime.host_unregister(ptr)) != 0:
                runtime.get_last_error()  # (consumed: this thread's next launch must not fail with it)
    except Exception:  # noqa: BLE001 - a finalizer must not raise
        logger.debug("unregistering pinned blocks at collection failed", exc_info=True)
    blocks.clear()


class TorchCudaOps:
    """Real CUDA streams and timing events on one device; pinned blocks of exact size.

    :meth:`pin` takes plain host memory, aligned to a page, and page-locks it with
    ``cudaHostRegister`` (flags 0: with unified addressing, the default on 64-bit Linux, the
    memory is pinned for every device's context): the registration is the block's size rounded up
    to a page, not to a power of two, and is undone by :meth:`unpin` (``cudaHostUnregister``)
    before the memory can be freed. Where registration fails (a platform without it), the block
    comes from torch's pinned allocator instead, with a warning: correct, but rounded up. A failed
    runtime call leaves the thread's last CUDA error set, which torch's next kernel launch on that
    thread would raise: it is consumed at once (``cudaGetLastError``), or, where it cannot be,
    :meth:`pin` raises a ``RuntimeError`` that says so (:mod:`offload.pipeline._cuda_runtime`).

    ``runtime``: the CUDA runtime calls (default :class:`CudaRuntime`: torch's binding plus the
    loaded libcudart's ``cudaGetLastError``); tests pass one that records them.
    """

    def __init__(self, device: torch.device, *, runtime: CudaRuntime | None = None) -> None:
        self.device = device
        self.runtime = runtime if runtime is not None else CudaRuntime()
        self._blocks: dict[int, tuple[Tensor, bool]] = {}  # data_ptr -> (memory, registered by us)
        self._register = True
        finalizer = weakref.finalize(self, _unregister_all, self._blocks, self.runtime)
        finalizer.atexit = False  # at exit the driver releases everything; cudart may be unloading

    def stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def event(self, label: tuple[str, int, str]) -> Any:
        return torch.cuda.Event(enable_timing=label[0] != "ready")  # (the copies' events are timed)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def copies(self, dsts: list[Tensor], srcs: list[Tensor], stream: Any, *,
               spans: list[tuple[int, int]] | None = None) -> None:
        # One stream context per chunk, and the copies from C++ (torch's foreach copy falls back to
        # a loop of copy_ across devices): no Python per copy but the spans' views.
        if not dsts:  # (torch's foreach ops refuse empty lists)
            return
        with torch.cuda.stream(stream):
            if spans is not None:  # made on this stream: ordered after its waits, kept until the copies ran
                srcs = [s.detach().reshape(-1)[a:b] for s, (a, b) in zip(srcs, spans)]
            torch._foreach_copy_(dsts, srcs, non_blocking=True)

    def pin(self, nbytes: int) -> Tensor:
        page = mmap.PAGESIZE
        size = -(-max(nbytes, 1) // page) * page
        if self._register:
            # A page-aligned range of whole pages inside memory of its own: no page is shared with
            # another allocation, whose registration would then overlap this one.
            raw = torch.empty(size + page, dtype=torch.uint8)
            start = -raw.data_ptr() % page
            buf = raw[start : start + size]
            rt = self.runtime
            with self.context():
                err = rt.host_register(buf.data_ptr(), size)
                if int(err) == 0:
                    self._blocks[buf.data_ptr()] = (raw, True)
                    return buf  # all of it: the bytes reported are the bytes registered
                what = f"cudaHostRegister of {size} bytes failed: {rt.error_string(err)} ({int(err)})"
                self._consume_error(what)
            self._register = False
            logger.warning("%s; pinned staging falls back to torch's pinned allocator (each block rounded up to "
                           "a power of two)", what)
        buf = self.runtime.pinned_empty(max(nbytes, 1))
        self._blocks[buf.data_ptr()] = (buf, False)
        return buf

    def _consume_error(self, what: str) -> None:
        """After the failed runtime call ``what`` on this thread: clear the thread's last CUDA error
        it left (else torch's next kernel launch here raises it), or raise saying it cannot."""
        try:
            self.runtime.get_last_error()
        except Exception as exc:  # noqa: BLE001 - named in the error
            raise RuntimeError(f"{what}, and the CUDA error it leaves on this thread could not be cleared "
                               f"({type(exc).__name__}: {exc}): the next kernel launched on this thread would raise "
                               "it; expected cudaGetLastError of the loaded libcudart") from exc

    def unpin(self, buf: Tensor) -> None:
        ptr = buf.data_ptr()
        entry = self._blocks.pop(ptr, None)
        if entry is None:
            raise ValueError(f"unpin of a tensor at {ptr:#x}: expected one that pin() returned")
        if entry[1]:
            rt = self.runtime
            with self.context():
                err = rt.host_unregister(ptr)
                if int(err) != 0:
                    what = (f"cudaHostUnregister of the block at {ptr:#x} failed: {rt.error_string(err)} "
                            f"({int(err)})")
                    self._consume_error(what)
                    raise RuntimeError(f"{what}; expected success")
        # the memory itself is freed when the last view of it is gone (after the registration)

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.device(self.device)


def _staging_layout(items: Sequence[Item | View], dtypes: list[torch.dtype]) -> tuple[list[int], int]:
    """Per item (or view), its byte offset in a staging block; the block's bytes."""
    offsets, off = [], 0
    for it, dtype in zip(items, dtypes):
        offsets.append(off)
        nbytes = (it.numel if isinstance(it, View) else it.view.numel) * dtype.itemsize
        off += -(-nbytes // STAGING_ALIGN) * STAGING_ALIGN
    return offsets, off


def _staged(buf: Tensor, offset: int, numel: int, dtype: torch.dtype) -> Tensor:
    return buf[offset : offset + numel * dtype.itemsize].view(dtype)


def _downcast(dsts: list[Tensor], srcs: list[Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` (masters into the weights' dtype, on the host) in one call."""
    if dsts:  # (torch's foreach ops refuse empty lists)
        torch._foreach_copy_(dsts, srcs)


def _handle(stream: Any) -> str:
    """A stream's CUDA handle and torch's id of it (a fake's repr)."""
    if hasattr(stream, "cuda_stream"):
        return f"{stream.cuda_stream:#x} (stream_id {stream.stream_id})"
    return repr(stream)


class CudaTransport:
    """Parameters on one CUDA device (see the module doc for the schedule).

    d2h: the d2h stream waits on the job's ``ready_event`` (gradients final on the producing
    stream), copies the chunk's gradient views into a ring slot (model dtype) and records an
    event; the worker waits on it when the chunk's kernel is next. materialize: the worker
    writes the updated master (downcast) into a ring slot; the h2d stream waits on the job's
    ``write_event`` (recorded on the caller's stream when ``step()`` began) and copies into the
    parameters asynchronously. The drain makes the caller's stream wait on the last h2d event
    (:meth:`order_caller`), so the next forward sees the new weights without a host sync.
    """

    def __init__(
        self, device: torch.device, *, slots: int = STAGING_SLOTS, ops: DeviceOps | None = None,
        timeout_s: float = DEVICE_TIMEOUT_S,
    ) -> None:
        """``timeout_s``: how long one host wait on a device event may take before the wait raises
        (``CPUOffloadAdamW(device_timeout_s=)``, :mod:`offload.pipeline._waits`)."""
        self.device: torch.device | None = device
        self._wait = EventWait(timeout_s)
        self._ops: DeviceOps = ops if ops is not None else TorchCudaOps(device)
        #: Jobs whose gradient copies the worker issues ahead of the current chunk's kernel.
        self.lookahead = slots - 1
        self.caller_writes = False  # the h2d ring and streams belong to the worker
        self.host_weights = False  # the parameters are on the device (a .data edit is not followed)
        self._d2h_stream = self._ops.stream()
        self._h2d_stream = self._ops.stream()
        # torch 2.13 makes no stream outside its per-device pool (torch.cuda.Stream draws round-robin
        # from it, as NCCL's and DDP's streams do; ExternalStream only wraps one made elsewhere): the
        # copies may share a stream with a collective and wait for it. The handles say if they do.
        logger.info("CUDA transport on %s: copy streams d2h %s, h2d %s (from torch's stream pool, which NCCL "
                    "and DDP also draw from)", device, _handle(self._d2h_stream), _handle(self._h2d_stream))
        self.pinned = PinnedPool(self._ops)
        self._d2h = Ring(self.pinned, slots, name="gradient ring", wait=self._wait)
        self._h2d = Ring(self.pinned, slots, name="weight ring", wait=self._wait)
        self._lowp = LowpPlaces(self.pinned, wait=self._wait)
        self._scratch = Scratch()
        self._last_h2d: Any = None
        self._counted = 0  # registrations already reported by a step
        self._checksums: ChecksumKernel | None = None  # the pipeline's (set by prepare)

    def ready_event(self) -> Any:
        """An event on the calling thread's current stream (a hook's: FSDP2's post-reduce stream),
        made and recorded through the device ops, so a fake device sees which copies wait for it
        (``bench.device_checks._fake_device``). No host wait."""
        ops = self._ops
        with ops.context():
            event = ops.event(("ready", -1, "caller"))
            ops.record(event, ops.current_stream())
        return event

    def prepare(self, job: ChunkJob, calls: CallBuilder) -> None:
        """No kernel call ahead: the kernel's gradient operands exist only after the worker's d2h
        copy. The kernels' checksum function is kept for the staged copies of an early chunk's
        items of torch's kernel (:meth:`finish_d2h`)."""
        self._checksums = calls.kernels.checksums

    def issue_d2h(self, job: ChunkJob) -> None:
        t_issue = time.perf_counter()
        ops = self._ops
        dtypes = [it.grad.dtype for it in job.items]  # type: ignore[union-attr]
        offsets, nbytes = _staging_layout(job.items, dtypes)
        with ops.context():
            slot, buf = self._d2h.take(nbytes)
            start, end = ops.event(("d2h", job.chunk, "start")), ops.event(("d2h", job.chunk, "end"))
            stream = self._d2h_stream
            if job.ready_event is not None:
                ops.wait(stream, job.ready_event)
            ops.record(start, stream)
            staged = [_staged(buf, off, it.view.numel, dtype) for it, off, dtype in zip(job.items, offsets, dtypes)]
            ops.copies(staged, [it.grad for it in job.items], stream,  # type: ignore[misc]
                       spans=[(it.view.start, it.view.stop) for it in job.items])
            ops.record(end, stream)
            self._d2h.used_by(slot, end, ("d2h", job.chunk, "end"))
        job.progress.transfer = (staged, start, end, t_issue)

    def finish_d2h(self, job: ChunkJob, slabs: HostSlabs, records: list[StageRecord]) -> None:
        progress = job.progress
        staged, start, end, t_issue = progress.transfer
        self._lowp.note(job, slabs)
        self._wait(end, ("d2h", job.chunk, "end"), f"chunk {job.chunk}'s gradients (their copy to the host)")
        gpu_s = start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        sums = None if progress.speculate is None else progress.speculate.pop(KIND_TORCH, None)
        if sums is not None:
            self._checksum_staged(job, staged, sums)
        # The kernels read the pinned copies where they are (fused-mp: low precision; fp32
        # gradients: as they came down); only a low-precision gradient of the torch kernel is
        # upcast, into the chunk-sized scratch buffer.
        upcast = [i for i, (it, src) in enumerate(zip(job.items, staged))
                  if it.kind != KIND_MP and src.dtype != torch.float32]
        progress.grads, progress.coef_in_grads = torch_grads(job, list(staged), upcast, self._scratch)
        t1 = time.perf_counter()
        records.append(StageRecord(job.chunk, "d2h", t_issue, t1, gpu_s + (t1 - t0)))
        progress.transfer = None

    def _checksum_staged(self, job: ChunkJob, staged: list[Tensor], sums: Tensor) -> None:
        """An early chunk (``offload.overlap._speculation``): into ``sums``, the checksums of its
        torch-kernel items' staged gradients, the bytes their kernel (or the upcast) reads next.
        The copy has ended and nothing else writes the ring slot, so a gradient changed after
        the launch and changed back after the copy (A -> B -> A) is summed as B, what was
        consumed; and the hook did no device work. The function is the one ``step()`` applies to
        ``p.grad`` on the device (``offload.kernels._grad_stats``: bitwise the same value for the
        same bytes, with torch ops where the extension is missing)."""
        mine = [src for it, src in zip(job.items, staged) if it.kind == KIND_TORCH]
        if len(mine) != sums.numel() or self._checksums is None:
            raise RuntimeError(f"chunk {job.chunk}: {sums.numel()} checksums asked for its {len(mine)} staged "
                               "gradients of torch's kernel: expected one each, after prepare()")
        sums.copy_(self._checksums(mine))

    def _slot_view(self, job: ChunkJob, item: Item) -> Tensor:
        """``item``'s place in the job's h2d ring slot, taken on first use (before the kernel
        writes into it: ``take`` waits for the slot's previous copy)."""
        progress = job.progress
        if progress.staging is None:
            dtypes = [it.param.dtype for it in job.items]
            offsets, nbytes = _staging_layout(job.items, dtypes)
            with self._ops.context():
                slot, buf = self._h2d.take(nbytes)
            where = {id(it): (off, dt) for it, off, dt in zip(job.items, offsets, dtypes)}
            progress.staging = (slot, buf, where)
        _, buf, where = progress.staging
        off, dtype = where[id(item)]
        return _staged(buf, off, item.view.numel, dtype)

    def lowp_out(self, job: ChunkJob, item: Item) -> Tensor:
        """A step's job: the job's h2d ring slot (the weights go up from there; no full-size host
        copy). A job started during backward: the parameter's pinned place, kept until
        ``step()`` (after its previous host-to-device copy finished)."""
        if job.materialize:
            return self._slot_view(job, item)
        return self._lowp.view(item, for_write=True)

    def f32_out(self, job: ChunkJob, item: Item) -> Tensor | None:
        """A step's job: fp32 weights are written by the kernel straight into the ring slot too
        (no separate copy pass out of the master slab)."""
        return self._slot_view(job, item) if job.materialize else None

    def materialize(self, job: ChunkJob, slabs: HostSlabs, records: list[StageRecord]) -> None:
        ops = self._ops
        t0 = time.perf_counter()
        # the new master: out of place (a step that commits a speculation), the next generation's
        master = (lambda v: slabs.next_view("master", v)) if job.into_next else (lambda v: slabs.view("master", v))
        progress = job.progress
        with ops.context():
            if progress.staging is not None:  # the kernel of this job wrote its native items' weights
                written = {id(it) for it in job.items if it.kind} if progress.kernel_ran else set()
                staged = [self._slot_view(job, it) for it in job.items]
                _downcast([dst for it, dst in zip(job.items, staged) if id(it) not in written],
                          [master(it.view) for it in job.items if id(it) not in written])
                slot = progress.staging[0]
                progress.staging = None
                lowp_used = False
            else:
                downcast = [it for it in job.items if it.kind != KIND_MP]
                by_item: dict[int, Tensor] = {}
                slot = None  # a ring slot only for weights to downcast (none: all were written early)
                if downcast:
                    dtypes = [it.param.dtype for it in downcast]
                    offsets, nbytes = _staging_layout(downcast, dtypes)
                    slot, buf = self._h2d.take(nbytes)
                    dsts = [_staged(buf, off, it.view.numel, dtype) for it, off, dtype in zip(downcast, offsets, dtypes)]
                    _downcast(dsts, [master(it.view) for it in downcast])
                    by_item = {id(it): dst for it, dst in zip(downcast, dsts)}
                # fused-mp items of a chunk started during backward: their pinned places.
                staged = [
                    by_item[id(it)] if it.kind != KIND_MP else self._lowp.view(it, for_write=False)
                    for it in job.items
                ]
                lowp_used = True
            t1 = time.perf_counter()
            start, end = ops.event(("h2d", job.chunk, "start")), ops.event(("h2d", job.chunk, "end"))
            stream = self._h2d_stream
            if job.write_event is not None:
                ops.wait(stream, job.write_event)
            ops.record(start, stream)
            ops.copies([it.param.detach().view(-1)[it.view.start : it.view.stop] for it in job.items], staged, stream)
            ops.record(end, stream)
            label = ("h2d", job.chunk, "end")
            if slot is not None:
                self._h2d.used_by(slot, end, label)
            if lowp_used:
                for it in job.items:
                    if it.kind == KIND_MP:
                        self._lowp.used_by(it.view.slot, end, label)
            self._last_h2d = end
        t2 = time.perf_counter()
        records.append(
            StageRecord(job.chunk, "materialize", t0, t2, t1 - t0, pending=(start, end, functools.partial(
                self._wait, end, label, f"chunk {job.chunk}'s weights (their copy to the device, timed for last_stats)")))
        )

    def flush(self) -> Any:
        """End of a step: hand back the last h2d event (not waited), first, so the caller is
        ordered after it whatever :meth:`settle` then raises."""
        last, self._last_h2d = self._last_h2d, None
        return last

    def settle(self) -> None:
        """End of a step, after :meth:`flush`: wait for stray d2h copies; bring every ring slot to
        the largest chunk's size and give the places of the fused-mp parameters met (that may start
        during backward) one block, so later steps register nothing."""
        self._d2h.sync()
        with self._ops.context():
            self._d2h.settle()
            self._h2d.settle()
            self._lowp.settle()

    def order_caller(self, event: Any) -> None:
        """The caller's current stream waits on the device for ``event`` (no host wait): the
        weights that went up before it are what the next forward reads, also where ``step()``
        raises after the drain or the drain is a failed step's (``Launcher.fail_start``)."""
        with self._ops.context():
            self._ops.wait(self._ops.current_stream(), event)

    def pinned_stats(self) -> tuple[int, int]:
        """(pinned bytes held, blocks registered since the previous call): read at each step's end;
        a step that registered blocks says what the memory is for, once, in the log."""
        made, self._counted = self.pinned.registrations - self._counted, self.pinned.registrations
        if made:
            logger.info("CUDA transport: %.1f MiB of pinned host memory in %d registrations (%d this step): "
                        "gradient ring %.1f MiB, weight ring %.1f MiB, early weights of %d parameters %.1f MiB",
                        self.pinned.nbytes / 2**20, self.pinned.registrations, made, self._d2h.nbytes / 2**20,
                        self._h2d.nbytes / 2**20, self._lowp.places, self._lowp.nbytes / 2**20)
        return self.pinned.nbytes, made

    def forget(self) -> None:
        """The chunk layout changed (between steps): the ring's blocks, sized for the old chunks,
        are replaced by blocks for the new ones at the next :meth:`reserve` (the optimizer's, at
        once, on the worker, after each block's last copy: nothing waits here); the places per
        parameter stay."""
        self._d2h.renew()
        self._h2d.renew()

    def resize_rings(self, slots: int) -> None:
        """A new ring depth (``OffloadSettings.ring_slots``, between steps): ``slots`` blocks per
        direction from the next step on, and as many chunks' gradient copies in flight (the
        worker reads :attr:`lookahead` per job). As :meth:`forget`: the worker adds or gives
        back blocks at the next :meth:`reserve`, after their last copy; nothing waits here. The bytes
        staged are the same whatever the depth: only how far ahead the copies run changes."""
        self._d2h.resize(slots)
        self._h2d.resize(slots)
        self.lookahead = slots - 1

    def reserve(self, chunks: Sequence[Chunk], dtypes: Sequence[torch.dtype],
                places: Mapping[int, tuple[int, torch.dtype]]) -> None:
        """On the idle worker between steps (``Pipeline.reserve``: a new transport, chunk layout,
        ring depth or kernel): every ring slot sized for the largest chunk of ``chunks``
        (``dtypes``: per slot, the parameter's, which its gradient has) at the depth set, and one
        block for ``places`` (the early weights of fused-mp parameters that may start during
        backward), now. Page-locking synchronises the device, a known hang beside NCCL
        launches on other ranks: the worker's take of a ring slot during an overlapped backward
        used to make these blocks; now it finds them."""
        nbytes = max((_staging_layout(list(c.views), [dtypes[v.slot] for v in c.views])[1] for c in chunks), default=0)
        with self._ops.context():
            self._d2h.reserve(nbytes)
            self._h2d.reserve(nbytes)
            self._lowp.reserve(dict(places))

    def close(self) -> None:
        """The worker has stopped: wait for the last copies, then give every pinned block back."""
        with self._ops.context():
            self._d2h.release()
            self._h2d.release()
            self._lowp.release()
