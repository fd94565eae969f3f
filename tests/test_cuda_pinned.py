"""The CUDA transport's pinned memory, counted through fake device ops (no GPU): a few blocks of
exact size, registered in the first step of a chunk layout and never again (none per parameter),
reported by each drain, within 1.1x of what the rings and the early chunks' places need, and all
given back on close. The weights stay bitwise those of torch's AdamW on fp32 masters."""

from __future__ import annotations

import contextlib
import enum
import gc
import logging
import mmap
from dataclasses import dataclass, field

import pytest
import torch
from _fake_cuda import HYPER, SIZES, FakeOps, Log, stepped_case

from offload.kernels._adamw import DEFAULT_KERNELS, new_step_tensor
from offload.pipeline._cuda_runtime import CudaRuntime
from offload.pipeline._cuda_transport import CudaTransport, TorchCudaOps
from offload.pipeline._jobs import ChunkJob, DrainResult
from offload.pipeline._pinned import PIN_ALIGN
from offload.pipeline._pipeline import Pipeline
from offload.state._items import KIND_MP, KIND_TORCH, Item
from offload.state._slabs import Chunk, plan_chunks

# SIZES: bf16 parameters of uneven sizes and one fp32 parameter (no low-precision place: its
# weights are downcast from the master)
FP32 = 4  # index of the fp32 parameter
STEPS = 5  # the first without early chunks (the hooks count themselves in the first backward)


def _aligned(n: int) -> int:
    return -(-n // PIN_ALIGN) * PIN_ALIGN


def _staging(chunk: Chunk, params: list[torch.Tensor]) -> int:
    return sum(_aligned(v.numel * params[v.slot].element_size()) for v in chunk.views)


def _need(chunks: tuple[Chunk, ...], params: list[torch.Tensor], *, plain: bool, slots: int = 2) -> int:
    """Two rings of ``slots`` slots and a place per bf16 parameter. The gradients' ring as large
    as the largest chunk's staging; the weights' ring too if a plain step ran in the layout
    (``plain``), else as large as the largest chunk's fp32 weights (the bf16 ones go up from their
    places)."""
    d2h = max(_staging(c, params) for c in chunks)
    fp32 = [Chunk(c.index, c.group, tuple(v for v in c.views if v.slot == FP32)) for c in chunks]
    h2d = d2h if plain else max(_staging(c, params) for c in fp32)
    places = sum(_aligned(p.numel() * p.element_size()) for p in params if p.dtype == torch.bfloat16)
    return slots * (d2h + h2d) + places


@dataclass
class Run:
    params: list[torch.Tensor]
    expected: list[torch.Tensor]
    chunks: tuple[Chunk, ...]
    results: list[DrainResult] = field(default_factory=list)
    write_waits: list[list[tuple[str, object]]] = field(default_factory=list)
    forget_waits: int = 0
    """Host waits while the layout was forgotten (rechunk)."""
    """Per step with early chunks: the worker's host waits while the weights were written."""


def _grads(step: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.numel(), generator=gen).to(p.dtype) for p in params]


def _train(ops: FakeOps, *, chunk_numel: int, steps: int = STEPS, rechunk_at: int | None = None,
           first_plain: bool = True) -> Run:
    """``steps`` steps through the CUDA transport: the first runs every chunk in step(), the
    others start every chunk during backward (kernel into the pinned places) and write the
    weights in step(); ``rechunk_at``: the chunk layout halves before that step; not
    ``first_plain``: the first step starts its chunks during backward too."""
    params, masters, ref, slabs = stepped_case(7, fp32=lambda i: i == FP32)
    chunks = plan_chunks(list(slabs.slots), chunk_numel)
    transport = CudaTransport(torch.device("cpu"), slots=2, ops=ops)
    pipe = Pipeline(slabs, transport, name="pinned-test", kernels=DEFAULT_KERNELS)
    run = Run(params, [], chunks)
    steps_t = [new_step_tensor() for _ in params]
    try:
        for step in range(steps):
            if step == rechunk_at:
                chunks = run.chunks = plan_chunks(list(slabs.slots), chunk_numel // 2)
                before = len(ops.host_waits)
                pipe.forget_layout()
                run.forget_waits = len(ops.host_waits) - before
            grads = _grads(step, params)
            for m, g in zip(masters, grads):
                m.grad = g.float()
            ref.step()
            items = {c.index: [Item(v, params[v.slot], grads[v.slot], steps_t[v.slot],
                                    KIND_MP if params[v.slot].dtype == torch.bfloat16 else KIND_TORCH)
                               for v in c.views] for c in chunks}
            early = step > 0 or not first_plain
            for c in chunks:  # during backward (early) or in step()
                pipe.submit(ChunkJob(chunk=c.index, items=items[c.index], hyper=HYPER, threads=1, update=True,
                                     materialize=not early))
            if early:
                run.results.append(pipe.drain())  # the early kernels ran (step() judges them)
                assert run.results[-1].error is None, run.results[-1].error
                mark = len(ops.host_waits)
                for c in chunks:  # step(): the committed chunks' weights go up
                    pipe.submit(ChunkJob(chunk=c.index, items=items[c.index], hyper=HYPER, threads=1,
                                         update=False, materialize=True))
            result = pipe.drain()
            assert result.error is None, result.error
            if early:
                run.write_waits.append(ops.host_waits[mark:])
            result.last_h2d_event.synchronize()
            run.results.append(result)
            for i, (p, m) in enumerate(zip(params, masters)):
                assert torch.equal(p, m.detach().to(p.dtype)), f"step {step}: parameter {i} differs from torch's AdamW"
    finally:
        pipe.close()
        ops.close()
    return run


@pytest.fixture
def native(kernel) -> None:
    """Fused-mp (the native kernel) updates the bf16 parameters: their early weights need places."""


def test_registrations_only_in_the_first_step_and_bytes_as_needed(native) -> None:
    ops = FakeOps(Log(10.0), 0, gate=False)
    run = _train(ops, chunk_numel=2048)
    regs = [r.pinned_registrations for r in run.results]  # two drains per step with early chunks
    assert regs[0] > 0 and regs[1:] == [0] * (len(regs) - 1), f"registrations per drain {regs}: expected some, then 0"
    assert sum(regs) == ops.registrations
    need = _need(run.chunks, run.params, plain=True)
    for r in run.results:
        assert need <= r.pinned_bytes <= 1.1 * need, (r.pinned_bytes, need)
    # a few blocks: one per ring slot and one for every early place, not one per parameter
    assert ops.registrations <= 2 * 2 + 1 + 2, ops.registrations
    assert not ops.pinned, "close() left pinned blocks registered"


def test_a_new_chunk_layout_registers_its_ring_once(native) -> None:
    ops = FakeOps(Log(10.0), 0, gate=False)
    run = _train(ops, chunk_numel=4096, steps=6, rechunk_at=3)
    regs = [r.pinned_registrations for r in run.results]  # drains: 1 for step 0, then 2 per step
    assert regs[0] > 0 and regs[1:5] == [0] * 4 and sum(regs[5:7]) > 0 and regs[7:] == [0] * 4, regs
    assert run.forget_waits == 0  # the old blocks are replaced by the worker, after their last copies
    need = _need(run.chunks, run.params, plain=False)  # the layout of the last steps: smaller chunks
    assert need <= run.results[-1].pinned_bytes <= 1.1 * need, (run.results[-1].pinned_bytes, need)
    assert not ops.pinned


def test_committed_weight_writes_take_no_ring_slot_when_nothing_is_downcast(native) -> None:
    """A committed early chunk of bf16 parameters only copies its pinned places up: its weight
    write neither takes an h2d ring slot nor waits on the host for that slot's previous copy."""
    ops = FakeOps(Log(10.0), 0, gate=False)
    run = _train(ops, chunk_numel=1024, steps=4)
    with_fp32 = [c.index for c in run.chunks if any(v.slot == FP32 for v in c.views)]
    assert 0 < len(with_fp32) < len(run.chunks)
    assert len(run.write_waits) == 3
    for waits in run.write_waits:
        worker = [label for thread, label in waits if thread == "pinned-test"]
        # a ring slot is taken (and its previous copy waited for) only for the fp32 weights
        assert len(worker) <= len(with_fp32), worker


def test_early_chunks_in_a_layout_s_first_step_register_a_block_per_chunk_then_none(native) -> None:
    """Early chunks before any step the transport saw (a layout whose hooks were counted
    already): a chunk whose places are missing gets one block for all of them (not one per
    parameter); the next steps' early chunks find their places."""
    ops = FakeOps(Log(10.0), 0, gate=False)
    run = _train(ops, chunk_numel=2048, first_plain=False)
    regs = [r.pinned_registrations for r in run.results]  # two drains per step
    assert 0 < regs[0] + regs[1] <= 2 * 2 + len(run.chunks) and regs[2:] == [0] * (len(regs) - 2), regs
    assert not ops.pinned


def test_a_place_read_before_it_was_written_is_an_error() -> None:
    from offload.pipeline._pinned import LowpPlaces, PinnedPool
    from offload.state._slabs import View

    places = LowpPlaces(PinnedPool(FakeOps(Log(1.0), 0)))
    item = Item(View(3, 0, 10, whole=True), torch.zeros(10, dtype=torch.bfloat16), None, new_step_tensor(), KIND_MP)
    with pytest.raises(RuntimeError, match="parameter 3 .* has no pinned place holding its new weights"):
        places.view(item, for_write=False)


class _Runtime(CudaRuntime):
    """The CUDA runtime calls of the real ops, recorded, with the calling thread's last error kept
    as CUDA keeps it: a failed call sets it, ``cudaGetLastError`` returns and clears it (``fail``:
    what a call returns; ``unreachable``: ``get_last_error`` raises, as where no libcudart is loaded)."""

    class cudaError(enum.IntEnum):  # noqa: N801 - torch's name
        success = 0
        invalid_value = 1
        host_memory_already_registered = 712

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail: dict[str, _Runtime.cudaError] = {}
        self.unreachable = False
        self.last_error = self.cudaError.success

    def _result(self, call: str) -> _Runtime.cudaError:
        err = self.fail.get(call, self.cudaError.success)
        if err:
            self.last_error = err
        return err

    def host_register(self, ptr: int, nbytes: int):
        self.calls.append(("register", ptr, nbytes))
        return self._result("register")

    def host_unregister(self, ptr: int):
        self.calls.append(("unregister", ptr))
        return self._result("unregister")

    def error_string(self, err) -> str:
        return f"error {err.name}"

    def get_last_error(self) -> int:
        self.calls.append(("get_last_error", int(self.last_error)))
        if self.unreachable:
            raise OSError("no libcudart.so is loaded in this process")
        err, self.last_error = self.last_error, self.cudaError.success
        return int(err)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        self.calls.append(("pinned_empty", nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)

    def launch(self) -> None:
        """A kernel launch as torch checks it (``C10_CUDA_KERNEL_LAUNCH_CHECK``): the thread's last error raises."""
        err = self.get_last_error()
        if err:
            raise RuntimeError(f"CUDA error: {self.cudaError(err).name}")


class _Ops(TorchCudaOps):
    """The real ops on the CPU: the runtime faked, no device guard (the only CUDA call left)."""

    def context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


@pytest.fixture
def runtime() -> _Runtime:
    return _Runtime()


def test_real_ops_register_whole_page_aligned_pages_and_unregister_them(runtime) -> None:
    ops = _Ops(torch.device("cuda", 0), runtime=runtime)
    page = mmap.PAGESIZE
    buf = ops.pin(3 * page + 5)
    ((kind, ptr, size),) = runtime.calls
    assert kind == "register" and ptr % page == 0 and size == 4 * page
    assert buf.data_ptr() == ptr and buf.numel() == size and buf.dtype == torch.uint8
    buf[:] = 7  # the memory is ours to write
    ops.unpin(buf)
    assert runtime.calls[-1] == ("unregister", ptr)
    with pytest.raises(ValueError, match="unpin of a tensor at 0x[0-9a-f]+: expected one that pin"):
        ops.unpin(buf)


def test_real_ops_name_a_failed_unregistration_and_clear_its_cuda_error(runtime) -> None:
    ops = _Ops(torch.device("cuda", 0), runtime=runtime)
    buf = ops.pin(100)
    runtime.fail["unregister"] = _Runtime.cudaError.invalid_value
    with pytest.raises(RuntimeError, match=r"cudaHostUnregister of the block at 0x[0-9a-f]+ failed: "
                                           r"error invalid_value \(1\); expected success"):
        ops.unpin(buf)
    assert runtime.calls[-1] == ("get_last_error", 1)
    runtime.launch()  # the thread's next kernel launch does not raise the unregistration's error


def test_a_failed_registration_clears_the_thread_s_cuda_error_before_the_fallback(runtime, caplog) -> None:
    """cudaHostRegister fails (torch's binding returns the error and leaves it set on the thread):
    the ops consume it before anything else runs on the thread, fall back to torch's pinned
    allocator, and the thread's next kernel launch works; later blocks skip registration."""
    ops = _Ops(torch.device("cuda", 0), runtime=runtime)
    runtime.fail["register"] = _Runtime.cudaError.host_memory_already_registered
    with caplog.at_level(logging.WARNING, logger="offload.pipeline._cuda_transport"):
        buf = ops.pin(100)
    assert [c[0] for c in runtime.calls] == ["register", "get_last_error", "pinned_empty"], runtime.calls
    assert runtime.calls[1] == ("get_last_error", 712) and runtime.calls[2] == ("pinned_empty", 100)
    assert buf.numel() == 100
    runtime.launch()  # (before the fix: "CUDA error: host_memory_already_registered")
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"cudaHostRegister of {mmap.PAGESIZE} bytes failed: error host_memory_already_registered (712)" in line
    assert "falls back to torch's pinned allocator" in line
    mark = len(runtime.calls)
    ops.pin(10)
    ops.unpin(buf)  # a fallback block is not unregistered
    assert runtime.calls[mark:] == [("pinned_empty", 10)]


def test_a_failed_registration_whose_error_cannot_be_cleared_raises_a_clear_error(runtime) -> None:
    ops = _Ops(torch.device("cuda", 0), runtime=runtime)
    runtime.fail["register"] = _Runtime.cudaError.invalid_value
    runtime.unreachable = True
    with pytest.raises(RuntimeError, match=rf"^cudaHostRegister of {mmap.PAGESIZE} bytes failed: error invalid_value \(1\), and "
                                           r"the CUDA error it leaves on this thread could not be cleared \(OSError: "
                                           r"no libcudart.so is loaded in this process\)"):
        ops.pin(100)
    assert not any(c[0] == "pinned_empty" for c in runtime.calls)


def test_real_ops_collected_with_blocks_unregister_them(runtime) -> None:
    ops = _Ops(torch.device("cuda", 0), runtime=runtime)
    ptrs = [ops.pin(n).data_ptr() for n in (10, 20000)]
    del ops
    gc.collect()
    assert sorted(c[1] for c in runtime.calls if c[0] == "unregister") == sorted(ptrs)


def test_a_step_that_registers_says_what_the_pinned_memory_is_for(native, caplog) -> None:
    ops = FakeOps(Log(10.0), 0, gate=False)
    with caplog.at_level(logging.INFO, logger="offload.pipeline._cuda_transport"):
        run = _train(ops, chunk_numel=2048, steps=3)
    lines = [r.getMessage() for r in caplog.records if "pinned host memory" in r.getMessage()]
    assert len(lines) == 1, lines  # the first step only
    assert f"early weights of {len(SIZES) - 1} parameters" in lines[0] and "gradient ring" in lines[0]
    assert f"{run.results[0].pinned_bytes / 2**20:.1f} MiB of pinned host memory" in lines[0]
