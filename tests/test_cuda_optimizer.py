"""CPUOffloadAdamW end to end on the CUDA transport without a GPU: CPU parameters stand in for the
device's, and the transport's device operations (streams, events, copies, pinned blocks) are fake
ones whose streams are threads (``tests/_fake_cuda.py``), handed in through the public
``CPUOffloadAdamW(device_ops=)``. The weights and moments are bitwise those of torch's AdamW (the
mixed-precision reference), with and without overlap; every drain orders the caller's
stream after the last weight copy, also a step that fails while judging its early chunks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from _fake_cuda import FakeOps, Log
from conftest import assert_bitwise

from offload import CPUOffloadAdamW, OffloadSettings
from offload.testing import DeviceOps

pytestmark = pytest.mark.usefixtures("single_threaded_main")

STEPS = 4
HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}


@pytest.fixture
def ops() -> Iterator[FakeOps]:
    ops = FakeOps(Log(10.0), 0, gate=False)  # no gates: the schedule is test_cuda_schedule.py's
    yield ops
    ops.close()


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8)).to(dtype)


def _groups(model: torch.nn.Module) -> list[dict]:
    # the last layer first: its gradients come first in backward, so its chunks start (and are
    # judged) first
    return [{"params": list(model[2].parameters())}, {"params": list(model[0].parameters()), "lr": 5e-3}]


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step)).to(next(model.parameters()).dtype)
    return model(x).float().square().mean()


def _next_forward(ops: FakeOps) -> None:
    """Where a GPU would queue the next forward behind what the caller's stream waits for, this
    host thread waits until the caller's fake stream ran to here (the weights then landed)."""
    done = ops.event(("forward", 0, "start"))
    ops.record(done, ops.caller)
    done.synchronize()


class _Reference:
    """torch.optim.AdamW(fused=True) on fp32 copies of the weights, updated from the upcast
    gradients and cast back into the model (on an fp32 model: torch's AdamW itself)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = list(model.parameters())
        self.master = {p: p.detach().float().clone().requires_grad_(True) for p in self.params}
        self.opt = torch.optim.AdamW([{**g, "params": [self.master[p] for p in g["params"]]} for g in _groups(model)],
                                     fused=True, **HYPER)

    def step(self) -> None:
        for p in self.params:
            self.master[p].grad = p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.master[p])
                p.grad = None


def test_the_device_ops_are_the_public_protocol(ops: FakeOps) -> None:
    """The fake ops satisfy what ``device_ops=`` takes (``offload.DeviceOps``), member for member."""
    members = [m for m in vars(DeviceOps) if not m.startswith("_")]
    assert members and all(callable(getattr(ops, m)) for m in members), members


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_the_cuda_path_is_bitwise_torch_adamw(ops: FakeOps, overlap: bool) -> None:
    """Each step's gradients go down and weights go up through the fake streams (pinned blocks,
    copies), and the parameters and moments equal the reference bitwise after every step; with
    overlap the chunks started during backward commit."""
    model, ref_model = _model(torch.bfloat16), _model(torch.bfloat16)
    ref = _Reference(ref_model)
    opt = CPUOffloadAdamW(_groups(model), **HYPER, overlap_backward=overlap, device_ops=ops,
                          settings=OffloadSettings(threads=1, chunk_numel=1024))
    try:
        committed = 0
        for step in range(STEPS):
            _loss(model, step).backward()
            _loss(ref_model, step).backward()
            del ops.caller_waits[:]
            opt.step()
            opt.zero_grad()
            ref.step()
            _next_forward(ops)
            assert_bitwise(list(model.parameters()), list(ref_model.parameters()), f"params after step {step}")
            # the caller's stream waits for the last weight copy of the drain, once
            assert [w[0] for w in ops.caller_waits] == ["h2d"], ops.caller_waits
            committed += opt.last_stats.committed_chunks
        stats = opt.last_stats
        assert stats.pinned_bytes > 0 and ops.registrations > 0 and ops.copy_calls  # the CUDA path ran
        assert (committed > 0) == overlap, committed
        for p, m in zip(model.parameters(), ref_model.parameters()):
            state, expected = opt.state[p], ref.opt.state[ref.master[m]]
            assert_bitwise([state["exp_avg"], state["exp_avg_sq"]], [expected["exp_avg"], expected["exp_avg_sq"]],
                           "moments")
    finally:
        opt.close()
    assert not ops.pinned  # every pinned block given back on close


def test_fp32_cpu_parameters_are_refused(ops: FakeOps) -> None:
    """An fp32 parameter on the CPU is its own master (no master place); the CUDA path writes the
    weights from a master place, which every parameter on a device has: refused by name, before
    any step (bf16/fp16 CPU parameters stand in for a CUDA model's)."""
    model = _model(torch.float32)
    with pytest.raises(ValueError, match=r"device_ops= with parameters on the CPU: parameter 0 is fp32"):
        CPUOffloadAdamW(model.parameters(), device_ops=ops)


def test_a_step_that_fails_after_committed_chunks_went_up_orders_them(ops: FakeOps) -> None:
    """``step()`` raises while judging the early chunks (a later param group's ``eps`` made
    invalid after backward), after the first group's chunks committed and their weights were
    queued on the h2d stream: the failed step's drain still makes the caller's stream wait for
    those copies (commit f4199dd: ``Launcher.fail_start`` drained them without it), so the next
    forward cannot read weights still being written. bf16: on the CUDA transport the early chunks'
    weights go up at once when they commit."""
    model = _model(torch.bfloat16)
    opt = CPUOffloadAdamW(_groups(model), **HYPER, overlap_backward=True, device_ops=ops,
                          settings=OffloadSettings(threads=1, chunk_numel=1024))
    try:
        for step in range(2):  # the first backward calibrates the hooks: nothing starts early
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad()
            _next_forward(ops)
        assert opt.last_stats.committed_chunks > 0
        _loss(model, 2).backward()
        opt.param_groups[1]["eps"] = "not a number"
        del ops.caller_waits[:]
        with pytest.raises(ValueError, match="eps"):
            opt.step()
        assert ops.caller_waits and ops.caller_waits[-1][0] == "h2d", ops.caller_waits
    finally:
        opt.close()
