"""The weights a drain wrote are ordered before the caller's next device work, also when the step
raises (issue 24 item 10), checked through fake device ops (no GPU): the CUDA transport's copies
to the parameters are asynchronous, so the thread that drained must have its current stream wait
for the last one on the device; a path that raises or drains without that wait lets the next
forward read weights still being written."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _fake_cuda import FakeOps, Log

import offload._optimizer as optimizer_module
from offload import CPUOffloadAdamW, KernelSet, OffloadSettings
from offload.kernels._adamw import DEFAULT_KERNELS, Hyper, new_step_tensor
from offload.pipeline._cuda_transport import CudaTransport
from offload.pipeline._jobs import ChunkJob
from offload.pipeline._pipeline import Pipeline
from offload.state._items import KIND_TORCH, Item
from offload.state._slabs import HostSlabs, plan_chunks

HYPER = Hyper(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8)


def test_a_drain_orders_the_caller_after_the_weight_copies_also_when_a_chunk_failed() -> None:
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
            pipe.submit(ChunkJob(chunk=c.index, items=[item], hyper=HYPER, threads=1, update=True,
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


class _Stream:
    def wait_event(self, event: Any) -> None:  # the optimizer's own wait (a real GPU's stream)
        pass


@pytest.fixture
def fake_cuda_optimizer(monkeypatch) -> FakeOps:
    """CPUOffloadAdamW on CPU parameters through the CUDA transport with fake device ops."""
    ops = FakeOps(Log(10.0), 0, gate=False)
    monkeypatch.setattr(optimizer_module, "HostTransport",
                        lambda copy: CudaTransport(torch.device("cpu"), slots=2, ops=ops))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    yield ops
    ops.close()


def test_a_step_that_fails_after_committed_chunks_went_up_orders_them(fake_cuda_optimizer) -> None:
    """``step()`` raises while judging the early chunks (a later param group's hyper-parameters
    were made invalid after backward), after the first group's chunks committed and their weights
    were queued: the failed step's drain still makes the caller's stream wait for those copies."""
    ops = fake_cuda_optimizer
    torch.manual_seed(0)
    # bf16: on CPU parameters the optimizer keeps fp32 ones as their own masters, never on CUDA
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(torch.bfloat16)
    # the last layer's gradients come first in backward: its chunks start (and are judged) first
    opt = CPUOffloadAdamW([{"params": model[1].parameters()}, {"params": model[0].parameters()}],
                          lr=1e-2, overlap_backward=True, settings=OffloadSettings(chunk_numel=1024))
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    try:
        for _ in range(2):  # the first backward calibrates the hooks, nothing starts early
            opt.zero_grad()
            model(x).float().square().mean().backward()
            opt.step()
        assert opt.last_stats.committed_chunks > 0
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.param_groups[1]["eps"] = "not a number"
        del ops.caller_waits[:]
        with pytest.raises(ValueError, match="eps"):
            opt.step()
        assert ops.caller_waits and ops.caller_waits[-1][0] == "h2d", ops.caller_waits
    finally:
        opt.close()
