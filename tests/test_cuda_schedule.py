"""The CUDA transport's schedule, checked without a GPU: its device operations go to fake streams
(threads that run copies and events asynchronously, in order), and gates make every copy that
should overlap a kernel wait for that kernel to start, and the kernel wait for the copy to start.
A schedule that serialises a copy and a kernel then stalls at a gate (a recorded timeout), so the
test checks structurally, never by wall-clock, that chunk i+1's gradients come down and chunk i-1's
weights go up while chunk i is in the kernel. The values are checked against torch's AdamW. And
every drain orders the caller's stream after the weights it wrote, also when the step raises."""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch
from _fake_cuda import FakeEvent, FakeOps, FakeStream, Log

from offload.testing import KernelSet
from offload.pipeline._cuda_transport import CudaTransport
from offload.pipeline._jobs import ChunkJob
from offload.state._items import KIND_F32, KIND_MP, KIND_TORCH, Item
from offload.kernels._adamw import DEFAULT_KERNELS, Hyper, new_step_tensor
from offload.pipeline._pipeline import Pipeline
from offload.state._slabs import HostSlabs, plan_chunks

NUMEL, CHUNKS = 1000, 6  # one parameter per chunk (chunk_numel 1024)


def _gated_kernels(log: Log, n: int) -> KernelSet:
    """The default kernels, each call gated: every job here holds one item, so the worker (one
    thread, jobs in FIFO order) makes one kernel call per chunk, and call ``c`` is chunk ``c``'s."""
    calls = [0]

    def gated(real: Callable[..., None]) -> Callable[..., None]:
        def kernel(*args: Any, **kwargs: Any) -> None:
            c = calls[0]
            calls[0] += 1
            log.add(("kernel", c, "start"))
            if c + 1 < n:
                log.wait_for(("d2h", c + 1, "start"), f"kernel of chunk {c}")
            if c >= 1:
                log.wait_for(("h2d", c - 1, "start"), f"kernel of chunk {c}")
            real(*args, **kwargs)
            log.add(("kernel", c, "end"))

        return kernel

    d = DEFAULT_KERNELS
    return KernelSet(fused_adamw=gated(d.fused_adamw), mixed_precision_adamw=gated(d.mixed_precision_adamw),
                     native_adamw_f32=gated(d.native_adamw_f32))


def _run(kind: int, *, lookahead: int | None = None, timeout_s: float = 10.0,
         early: bool = False):
    dtype = torch.bfloat16 if kind == KIND_MP else torch.float32
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(NUMEL, generator=gen).to(dtype) for _ in range(CHUNKS)]
    grads = [torch.randn(NUMEL, generator=gen).to(dtype) for _ in range(CHUNKS)]
    reference = [p.float().clone().requires_grad_(True) for p in params]
    for r, g in zip(reference, grads):
        r.grad = g.float()
    ref_opt = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, fused=True)
    ref_opt.step()

    slabs = HostSlabs([[p.shape for p in params]])
    for i, p in enumerate(params):
        slabs.flat("master", i).copy_(p.float())
    chunks = plan_chunks(list(slabs.slots), 1024)
    assert len(chunks) == CHUNKS
    log = Log(timeout_s)
    ops = FakeOps(log, CHUNKS, gate=not early)
    # (chunks started during backward copy their weights up only in step(): no gates then)
    kernels = DEFAULT_KERNELS if early else _gated_kernels(log, CHUNKS)
    transport = CudaTransport(torch.device("cpu"), slots=2, ops=ops)
    if lookahead is not None:
        transport.lookahead = lookahead
    # Hold the worker at its first copy until every job is queued (as step() queues them at once).
    queued = threading.Event()
    real_copies = ops.copies
    ops.copies = lambda dsts, srcs, stream, **kw: (queued.wait(30), real_copies(dsts, srcs, stream, **kw))[1]  # type: ignore[method-assign]
    pipe = Pipeline(slabs, transport, name="schedule-test", kernels=kernels)
    try:
        hyper = Hyper(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8)
        steps = [new_step_tensor() for _ in params]
        items = []
        for c in chunks:
            (v,) = c.views
            items.append(Item(v, params[v.slot], grads[v.slot], steps[v.slot], kind))
            # early: as during backward (kernel into a pinned buffer, weights unchanged)
            pipe.submit(ChunkJob(chunk=c.index, items=[items[-1]], hyper=hyper, threads=1, update=True,
                                 materialize=not early))
        queued.set()
        if early:
            before = [p.clone() for p in params]
            assert pipe.drain().error is None
            assert all(torch.equal(p, b) for p, b in zip(params, before)), "weights changed early"
            for c, item in zip(chunks, items):  # step(): the weights go up
                pipe.submit(ChunkJob(chunk=c.index, items=[item], hyper=hyper, threads=1, update=False,
                                     materialize=True))
        result = pipe.drain()
        assert result.error is None, result.error
        result.last_h2d_event.synchronize()
    finally:
        pipe.close()
        ops.close()
    return log, params, [r.detach().to(dtype) for r in reference]


@pytest.mark.parametrize("kind", [KIND_TORCH, KIND_F32, KIND_MP], ids=["torch-fp32", "fused-fp32", "fused-mp-bf16"])
def test_copies_of_neighbour_chunks_run_while_a_chunk_is_in_the_kernel(kind) -> None:
    if kind != KIND_TORCH:
        from offload.kernels._fused_mp import fused_mp_available

        ok, reason = fused_mp_available()
        if not ok:
            pytest.skip(f"fused-mp kernel unavailable: {reason}")
    log, params, expected = _run(kind)
    assert log.violations == []
    at = log.index
    for c in range(CHUNKS):
        if c + 1 < CHUNKS:  # the next chunk's gradients come down during this kernel
            assert at(("d2h", c + 1, "start")) < at(("kernel", c, "end"))
            assert at(("kernel", c, "start")) < at(("d2h", c + 1, "end"))
        if c >= 1:  # the previous chunk's weights go up during this kernel
            assert at(("h2d", c - 1, "start")) < at(("kernel", c, "end"))
            assert at(("kernel", c, "start")) < at(("h2d", c - 1, "end"))
        assert at(("d2h", c, "end")) < at(("kernel", c, "start")) < at(("kernel", c, "end")) < at(("h2d", c, "start"))
    for i, (p, e) in enumerate(zip(params, expected)):
        assert torch.equal(p, e), f"parameter {i} differs from torch's AdamW"


@pytest.mark.parametrize("kind", [KIND_TORCH, KIND_F32, KIND_MP], ids=["torch-fp32", "fused-fp32", "fused-mp-bf16"])
def test_chunks_started_during_backward_write_the_weights_only_at_step(kind) -> None:
    if kind != KIND_TORCH:
        from offload.kernels._fused_mp import fused_mp_available

        ok, reason = fused_mp_available()
        if not ok:
            pytest.skip(f"fused-mp kernel unavailable: {reason}")
    _, params, expected = _run(kind, early=True)
    for i, (p, e) in enumerate(zip(params, expected)):
        assert torch.equal(p, e), f"parameter {i} differs from torch's AdamW"


def test_a_serial_schedule_is_caught() -> None:
    """Without lookahead the next chunk's gradients are not in flight during a kernel: the gates
    record it (so the test above can fail), and the values are still right."""
    log, params, expected = _run(KIND_TORCH, lookahead=0, timeout_s=0.2)
    assert any("kernel of chunk" in v and "'d2h'" in v for v in log.violations)
    for p, e in zip(params, expected):
        assert torch.equal(p, e)


def test_ring_needs_two_slots() -> None:
    with pytest.raises(ValueError, match="staging slots=1: expected >= 2"):
        CudaTransport(torch.device("cpu"), slots=1, ops=FakeOps(Log(1.0), 1))


def test_every_transport_implements_the_whole_protocol() -> None:
    """The worker calls every member of Transport without probing: both transports have them."""
    from offload.pipeline._host_transport import HostTransport
    from offload.pipeline._transport import Transport

    members = {n for n in vars(Transport) if not n.startswith("_")} | set(Transport.__annotations__)
    assert {"device", "lookahead", "prepare", "forget", "f32_out", "flush"} <= members
    for transport in (HostTransport(), CudaTransport(torch.device("cpu"), ops=FakeOps(Log(1.0), 1))):
        missing = sorted(n for n in members if not hasattr(transport, n))
        assert not missing, f"{type(transport).__name__} lacks {missing}"


def test_a_non_contiguous_gradient_is_read_after_the_launch_event_on_the_copy_stream() -> None:
    """A transposed gradient cannot be sliced flat as a view: its dense copy must be made on the
    copy stream, after the stream waited for the job's ready event (the gradient is final only
    then), not on the worker's stream when the copy is issued. Here the gradient gets its final
    values after the job is submitted and before the event fires: the step must use them."""
    rows = cols = 20
    gen = torch.Generator().manual_seed(5)
    param = torch.randn(rows * cols, generator=gen)
    base = torch.randn(cols, rows, generator=gen)
    grad = base.t()  # (rows, cols), not contiguous: the parameter's 400 elements in another order
    final = torch.randn(cols, rows, generator=gen)

    reference = param.clone().requires_grad_(True)
    reference.grad = final.t().contiguous().reshape(-1)
    torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.1, fused=True).step()

    slabs = HostSlabs([[param.shape]])
    slabs.flat("master", 0).copy_(param)
    (chunk,) = plan_chunks(list(slabs.slots), 1024)
    ops = FakeOps(Log(10.0), 1, gate=False)
    transport = CudaTransport(torch.device("cpu"), slots=2, ops=ops)
    pipe = Pipeline(slabs, transport, name="ready-event-test", kernels=DEFAULT_KERNELS)
    ready = FakeEvent(("ready", 0, "end"))
    issued = threading.Event()  # the worker has issued the gradient's copy
    real_copies = ops.copies

    def copies(dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: FakeStream, **kw: Any) -> None:
        real_copies(dsts, srcs, stream, **kw)
        issued.set()

    ops.copies = copies  # type: ignore[method-assign]
    try:
        hyper = Hyper(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8)
        (view,) = chunk.views
        item = Item(view, param, grad, new_step_tensor(), KIND_TORCH)
        pipe.submit(ChunkJob(chunk=0, items=[item], hyper=hyper, threads=1, update=True, materialize=True,
                             ready_event=ready))
        assert issued.wait(30)
        base.copy_(final)  # backward finishes writing the gradient ...
        ready.done.set()  # ... and then the event the copy stream waits on fires
        result = pipe.drain()
        assert result.error is None, result.error
        result.last_h2d_event.synchronize()
    finally:
        pipe.close()
        ops.close()
    assert torch.equal(param, reference.detach()), "the step read the gradient before it was final"


def test_a_drain_orders_the_caller_after_the_weight_copies_also_when_a_chunk_failed() -> None:
    """The copies to the parameters are asynchronous: the thread that drained has its current
    stream wait for the last one on the device (issue 24 item 10), also when a chunk failed. Every
    drain does it (a failed step()'s, ``Launcher.fail_start``, drained committed chunks' weight
    copies without it)."""
    params = [torch.randn(500) for _ in range(3)]
    slabs = HostSlabs([[p.shape for p in params]])
    for i, p in enumerate(params):
        slabs.flat("master", i).copy_(p)
    chunks = plan_chunks(list(slabs.slots), 512)
    calls = [0]

    def third_fails(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("chunk 2's kernel failed")
        DEFAULT_KERNELS.fused_adamw(*args, **kwargs)

    ops = FakeOps(Log(10.0), 0, gate=False)
    pipe = Pipeline(slabs, CudaTransport(torch.device("cpu"), slots=2, ops=ops), name="order-test",
                    kernels=KernelSet(fused_adamw=third_fails))
    try:
        steps = [new_step_tensor() for _ in params]
        for c in chunks:
            (v,) = c.views
            item = Item(v, params[v.slot], torch.randn(500), steps[v.slot], KIND_TORCH)
            pipe.submit(ChunkJob(chunk=c.index, items=[item], hyper=Hyper(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8), threads=1, update=True,
                                 materialize=True))
        result = pipe.drain()
        main_waits = [label for thread, label in ops.host_waits if thread == "MainThread"]
    finally:  # (close waits for the last copies on the host, before unpinning)
        pipe.close()
        ops.close()
    assert isinstance(result.error, RuntimeError)
    # chunks 0 and 1 went up; the caller's stream waits for the last of them, on the device
    assert ops.caller_waits == [("h2d", 1, "end")], ops.caller_waits
    assert main_waits == []
