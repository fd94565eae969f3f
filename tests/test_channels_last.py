"""Parameters that cover their memory in another order than the contiguous one: ``channels_last``
conv weights (how vision models train), a transposed weight. torch's AdamW steps them elementwise
with moments of their own strides (``torch.zeros_like(p)``); ours works on them in memory order
(``ParamRecord.local``: a contiguous permuted view of the same storage) and shows state with the
parameter's shape and strides. Bitwise torch's ``AdamW(fused=True)`` (fp32) or the
mixed-precision reference (bf16/fp16), overlap off and on, both kernels, chunks that split a
weight; a checkpoint of torch's AdamW resumed by ours; edits; and the layouts still refused
(issue 25, item 5)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_bitwise
from test_optimizer_numerics import MixedPrecisionReference

from offload import CPUOffloadAdamW, OffloadSettings

pytestmark = pytest.mark.usefixtures("single_threaded_main")

STEPS = 5


class _Net(torch.nn.Module):
    """Two convolutions (the second's weight spans several 1024-element chunks), a transposed
    linear weight and a plain one."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 32, 3)
        self.conv2 = torch.nn.Conv2d(32, 8, 3)
        self.proj = torch.nn.Parameter(torch.randn(24, 128).t() * 0.05)  # strides (1, 128)
        self.head = torch.nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x))
        h = self.conv2(h).flatten(1)
        return self.head(h @ self.proj)


def _net(dtype: torch.dtype) -> _Net:
    torch.manual_seed(0)
    net = _Net().to(dtype=dtype, memory_format=torch.channels_last)
    assert not net.conv2.weight.is_contiguous() and not net.proj.is_contiguous()
    return net


def _batch(step: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(2, 3, 8, 8, generator=g).to(dtype).contiguous(memory_format=torch.channels_last)


def _reference(model: torch.nn.Module, dtype: torch.dtype):
    if dtype == torch.float32:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        return opt, lambda p: opt.state[p]
    ref = MixedPrecisionReference(model)
    for g in ref.param_groups:
        g.update(lr=1e-2, weight_decay=0.1)
    return ref, ref.state


def _ours(model: torch.nn.Module, **kwargs) -> CPUOffloadAdamW:
    return CPUOffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                           settings=OffloadSettings(threads=2, chunk_numel=1024, kernel=kwargs.pop("kernel", "auto")),
                           **kwargs)


def _train(model, opt, dtype, steps=range(STEPS), edit=None) -> None:
    for step in steps:
        opt.zero_grad()
        model(_batch(step, dtype)).float().square().mean().backward()
        opt.step()
        if edit is not None:
            edit(model)
            getattr(opt, "follow_edits", lambda: None)()


def _check(model, opt, ref_model, ref_state) -> None:
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")
    for key in ("exp_avg", "exp_avg_sq"):
        got = [opt.state[p][key] for p in model.parameters()]
        want = [ref_state(r)[key] for r in ref_model.parameters()]
        assert_bitwise(got, want, key)
        assert [t.stride() for t in got] == [t.stride() for t in want], key  # torch's zeros_like(p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("overlap", [False, True], ids=["off", "overlap"])
@pytest.mark.parametrize("kernel", ["fused-mp", "torch"])
def test_channels_last_and_transposed_weights_step_bitwise(dtype: torch.dtype, overlap: bool, kernel: str) -> None:
    ref_model, model = _net(dtype), _net(dtype)
    ref, ref_state = _reference(ref_model, dtype)
    opt = _ours(model, overlap_backward=overlap, kernel=kernel)
    _train(ref_model, ref, dtype)
    _train(model, opt, dtype)
    if overlap:
        assert opt.last_stats.speculated_chunks > 0
    _check(model, opt, ref_model, ref_state)
    assert model.conv2.weight.is_contiguous(memory_format=torch.channels_last)  # written in place
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_edits_of_channels_last_weights_are_followed(dtype: torch.dtype) -> None:
    """An in-place edit (version counter) and one through .data (content): the masters follow
    in the parameter's memory order."""
    def edit(model: torch.nn.Module) -> None:
        with torch.no_grad():
            model.conv1.weight.clamp_(-0.1, 0.1)
        model.conv2.weight.data.mul_(0.5)

    ref_model, model = _net(dtype), _net(dtype)
    if dtype == torch.float32:
        ref, ref_state = _reference(ref_model, dtype)
    else:
        from test_weight_edits import _EditAwareReference
        ref = _EditAwareReference(ref_model)
        for g in ref.param_groups:
            g.update(lr=1e-2, weight_decay=0.1)
        ref_state = ref.state
    opt = _ours(model, overlap_backward=True)
    _train(ref_model, ref, dtype, edit=edit)
    _train(model, opt, dtype, edit=edit)
    _check(model, opt, ref_model, ref_state)
    opt.close()


def test_a_checkpoint_of_torchs_adamw_resumes_bitwise() -> None:
    ref_model, model = _net(torch.float32), _net(torch.float32)
    ref, ref_state = _reference(ref_model, torch.float32)
    _train(ref_model, ref, torch.float32, range(3))
    model.load_state_dict(ref_model.state_dict())
    opt = _ours(model, overlap_backward=True)
    opt.load_state_dict(ref.state_dict())
    _train(ref_model, ref, torch.float32, range(3, 6))
    _train(model, opt, torch.float32, range(3, 6))
    _check(model, opt, ref_model, ref_state)
    # and ours back into torch's
    again = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    again.load_state_dict(opt.state_dict())
    assert_bitwise([again.state[p]["exp_avg"] for p in ref_model.parameters()],
                   [opt.state[p]["exp_avg"] for p in model.parameters()], "exp_avg")
    opt.close()


def test_a_parameter_with_gaps_is_refused_naming_it() -> None:
    base = torch.nn.Parameter(torch.zeros(8, 8))
    strided = torch.nn.Parameter(base.detach()[:, ::2])  # every other column: not one dense block
    with pytest.raises(ValueError, match=r"parameter 1 \(shape \(8, 4\), strides \(8, 2\)\) does not cover one "
                                         r"dense block of memory"):
        CPUOffloadAdamW([torch.nn.Parameter(torch.zeros(3)), strided])


def test_data_replaced_by_another_memory_format_raises_before_writing() -> None:
    model = _net(torch.float32)
    opt = _ours(model)
    _train(model, opt, torch.float32, range(1))
    w = model.conv2.weight
    w.data = w.data.contiguous()  # back to NCHW after the optimizer was built
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model(_batch(9, torch.float32)).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"no longer lies in memory as it did when the optimizer was built"):
        opt.step()
    assert_bitwise(list(model.parameters()), before, "params")
    opt.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["off", "overlap"])
def test_a_replaced_channels_last_moment_is_taken_in(overlap: bool) -> None:
    """``opt.state[p]["exp_avg"] = torch.full_like(p, c)`` (a tensor of the parameter's strides):
    taken into the slabs in memory order, as torch's AdamW uses it."""
    ref_model, model = _net(torch.float32), _net(torch.float32)
    ref, ref_state = _reference(ref_model, torch.float32)
    opt = _ours(model, overlap_backward=overlap)
    for m, o in ((ref_model, ref), (model, opt)):
        _train(m, o, torch.float32, range(2))
        o.state[m.conv2.weight]["exp_avg"] = torch.linspace(-1, 1, m.conv2.weight.numel()).view_as(
            m.conv2.weight).contiguous(memory_format=torch.channels_last) * 1e-2
        _train(m, o, torch.float32, range(2, 4))
    _check(model, opt, ref_model, ref_state)
    opt.close()
