"""Weights edited through ``.data`` (and other edits no version counter shows): WGAN weight
clipping ``p.data.clamp_()``, pruning ``p.data.mul_(mask)``, Lookahead's copy-back
``p.data.copy_(slow)``. ``p.data`` is a new tensor with its own version counter over the same
storage, so the stamp check of ``offload.state._edits`` cannot see these; a model whose fp32
master is separate (bf16/fp16) follows them by content, in the kernel's pass (issue 25, item 1).

Each loop is checked bitwise against a reference that follows every edit by the documented rule
(an element whose master no longer rounds to its weight restarts from the weight): torch's
``AdamW(fused=True)`` for fp32, the mixed-precision reference for bf16/fp16; with overlap on and
off, with the native kernel and torch's.
"""

from __future__ import annotations

import pytest
import torch
from conftest import batch, make_model, param_groups, uses_sometimes
from test_weight_edits import _check, reference

from offload import CPUOffloadAdamW, OffloadSettings
from offload.kernels._adamw import Hyper, KernelSet, mixed_precision_adamw_
from offload.kernels._follow import follow_weights
from offload.kernels._grad_stats import checksums_reference
from offload.state._device_edits import DeviceWeightSums
from offload.state._params import ParamRegistry

pytestmark = pytest.mark.usefixtures("single_threaded_main")

STEPS = 8


def _clip_data(model: torch.nn.Module, step: int) -> None:  # WGAN's weight clipping
    for p in model.parameters():
        p.data.clamp_(-0.04, 0.04)


def _prune_data(model: torch.nn.Module, step: int) -> None:  # magnitude pruning through .data
    for p in model.parameters():
        p.data.mul_((p.data.abs() > 0.02).to(p.dtype))


class _Lookahead:
    """Lookahead's slow weights (k=2, alpha=0.5), copied back through ``.data``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.slow = [p.detach().clone() for p in model.parameters()]

    def __call__(self, model: torch.nn.Module, step: int) -> None:
        if step % 2:
            return
        for p, s in zip(model.parameters(), self.slow):
            s.add_(p.detach() - s, alpha=0.5)
            p.data.copy_(s)


EDITS = {"clip": lambda model: _clip_data, "prune": lambda model: _prune_data, "lookahead": _Lookahead}


def _train(model, opt, edit, *, edit_before_step: bool = False) -> None:
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        model(batch(step, 0), use_sometimes=uses_sometimes(step)).backward()
        if edit_before_step and step % 3 == 2:  # after backward started early chunks, before step()
            edit(model, step)
            getattr(opt, "follow_edits", lambda: None)()
        opt.step()
        edit(model, step)
        getattr(opt, "follow_edits", lambda: None)()  # the reference follows by the documented rule


def _pair(dtype: torch.dtype, kind: str):
    ref_model, model = make_model(dtype), make_model(dtype)
    ref, ref_state = reference(ref_model, dtype)
    return ref_model, ref, ref_state, model, EDITS[kind](ref_model), EDITS[kind](model)


@pytest.mark.parametrize("kind", sorted(EDITS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("overlap", [False, True], ids=["off", "overlap"])
@pytest.mark.parametrize("kernel", ["fused-mp", "torch"])
def test_data_edits_are_followed_bitwise(kind: str, dtype: torch.dtype, overlap: bool, kernel: str) -> None:
    ref_model, ref, ref_state, model, ref_edit, edit = _pair(dtype, kind)
    opt = CPUOffloadAdamW(param_groups(model), settings=OffloadSettings(threads=2, chunk_numel=1024, kernel=kernel),
                          overlap_backward=overlap)
    _train(ref_model, ref, ref_edit)
    _train(model, opt, edit)
    if overlap:
        assert opt.last_stats.speculated_chunks > 0
    _check(model, opt, ref_model, ref_state)
    opt.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kernel", ["fused-mp", "torch"])
def test_data_edit_after_early_chunks_started_makes_them_stale(dtype: torch.dtype, kernel: str) -> None:
    """An edit through .data between backward and step(): the early chunks compared their masters
    with the weights as they were; their checksums hold those weights' words, so step() finds the
    change and recomputes them."""
    ref_model, ref, ref_state, model, ref_edit, edit = _pair(dtype, "clip")
    opt = CPUOffloadAdamW(param_groups(model), settings=OffloadSettings(threads=2, chunk_numel=1024, kernel=kernel),
                          overlap_backward=True)
    _train(ref_model, ref, ref_edit, edit_before_step=True)
    _train(model, opt, edit, edit_before_step=True)
    _check(model, opt, ref_model, ref_state)
    opt.close()


def test_data_edit_between_backward_and_step_is_redone_not_committed() -> None:
    """The edit lands after every early kernel ran (the test waits for them through a counting
    KernelSet: an early kernel that ran after the edit would rightly commit, having compared
    with the edited weights): the chunks holding the parameter are redone, the others kept."""
    import threading

    early = threading.Semaphore(0)

    def counting(*args, **kwargs):  # the real kernel; early ones (out of place: into=) counted
        mixed_precision_adamw_(*args, **kwargs)
        if kwargs.get("into"):
            early.release()

    model = make_model(torch.bfloat16)
    opt = CPUOffloadAdamW(param_groups(model), settings=OffloadSettings(threads=2, chunk_numel=1024),
                          overlap_backward=True, kernels=KernelSet(mixed_precision_adamw=counting))
    for step in range(3):
        opt.zero_grad()
        model(batch(step, 0)).backward()
        opt.step()
    launched = opt.last_stats.speculated_chunks  # (launches follow the hooks, not the timing)
    assert 0 < opt.last_stats.committed_chunks == launched  # nothing edited: the early chunks are kept
    while early.acquire(blocking=False):
        pass
    opt.zero_grad()
    model(batch(3, 0)).backward()
    for _ in range(launched):
        assert early.acquire(timeout=60), "an early kernel did not run"
    model.fc1.weight.data.mul_(0.5)
    opt.step()
    assert opt.last_stats.speculated_chunks == launched
    assert 0 < opt.last_stats.committed_chunks < launched
    opt.close()


# ---------------------------------------------------------------- the kernel's comparison
def _operands(n: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g) * 0.1
    weight = master.to(dtype)
    edited = torch.rand(n, generator=g) < 0.2
    weight[edited] = (torch.randn(int(edited.sum()), generator=g)).to(dtype)
    if n > 8:
        weight[3] = float("nan")
        master[5], weight[5] = 0.0, -0.0  # equal as values: the master stays
        master[6] = float("nan")  # a NaN master never equals its weight
        master[7] = 7e4 if dtype == torch.float16 else 3.4e38  # rounds to inf in fp16
        weight[7] = float("inf") if dtype == torch.float16 else weight[7]
    grad = torch.randn(n, generator=g).to(dtype)
    return master, weight, grad, torch.randn(n, generator=g) * 0.01, torch.rand(n, generator=g) * 0.01


@pytest.mark.parametrize("n", [1, 15, 16, 17, 33, 100, 16384 * 2 + 7, 1 << 18])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("out_of_place", [False, True], ids=["in_place", "into"])
def test_kernel_follows_the_seen_weights_as_follow_weights_does(n: int, dtype: torch.dtype, out_of_place: bool) -> None:
    master, weight, grad, exp_avg, exp_avg_sq = _operands(n, dtype, seed=n)
    hyper = Hyper(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)
    # the reference: torch ops follow, then the plain kernel
    ref = [master.clone(), exp_avg.clone(), exp_avg_sq.clone(), weight.clone(), torch.tensor(2.0)]
    follow_weights([ref[0]], [ref[3]])
    mixed_precision_adamw_([ref[3]], [grad], [ref[0]], [ref[1]], [ref[2]], [ref[4]], steps_to_increment=[ref[4]],
                           hyper=hyper)
    got = [master.clone(), exp_avg.clone(), exp_avg_sq.clone(), weight.clone(), torch.tensor(2.0)]
    sums = torch.zeros(1, dtype=torch.int64)
    if out_of_place:
        into = [torch.empty(n) for _ in range(3)]
        out = torch.empty(n, dtype=dtype)
        mixed_precision_adamw_([out], [grad], [got[0]], [got[1]], [got[2]], [got[4]], steps_to_increment=[got[4]],
                               hyper=hyper, into=into, checksums=sums, seen=[got[3]])
        assert torch.equal(got[0].view(torch.int32), master.view(torch.int32))  # only read
        assert torch.equal(got[3].view(torch.int16), weight.view(torch.int16))
        got = [*into, out]
    else:
        mixed_precision_adamw_([got[3]], [grad], [got[0]], [got[1]], [got[2]], [got[4]], steps_to_increment=[got[4]],
                               hyper=hyper, checksums=sums, follow=True)
        got = got[:4]
    for a, b, name in zip(got, ref, ("master", "exp_avg", "exp_avg_sq", "weight")):
        bits = torch.int32 if a.dtype == torch.float32 else torch.int16
        assert torch.equal(a.view(bits), b.view(bits)), name
    # the checksum holds the gradient's words and the weights' (as the speculation compares them)
    assert int(sums[0]) == int(checksums_reference([grad])[0] + checksums_reference([weight])[0])


def test_kernel_names_a_seen_tensor_of_the_wrong_size() -> None:
    master, weight, grad, exp_avg, exp_avg_sq = _operands(64, torch.bfloat16, seed=1)
    step = torch.tensor(0.0)
    with pytest.raises(ValueError, match=r"seen\[0\] has 63 elements"):
        mixed_precision_adamw_([weight.clone()], [grad], [master], [exp_avg], [exp_avg_sq], [step],
                               steps_to_increment=[step], hyper=Hyper(lr=1e-3, beta1=0.9, beta2=0.999,
                                                                      weight_decay=0.0, eps=1e-8),
                               seen=[weight[:63]])
    assert float(step) == 0.0  # refused before anything was written


# ---------------------------------------------------------------- CUDA models: by device checksums
def test_device_weight_sums_find_a_data_edit_and_nothing_else() -> None:
    """The CUDA path's watch (offload.state._device_edits), run on host tensors: after the step
    wrote the weights their checksums are recorded; a .data edit of one weight is found at the next
    step, an untouched weight is not, and a weight never recorded is not compared."""
    model = make_model(torch.bfloat16)
    records = ParamRegistry(param_groups(model)).records
    sums = DeviceWeightSums(watched=lambda t: True)
    slots = [r.slot for r in records]
    sums.record(records, slots[:-1])
    assert sums.changed(records, slots) == []
    records[2].param.data.mul_(0.5)
    records[-1].param.data.mul_(0.5)  # never recorded: nothing to compare with
    assert sums.changed(records, slots) == [2]
    sums.record(records, [2])  # the step wrote it again
    assert sums.changed(records, slots) == []
    assert DeviceWeightSums().changed(records, slots) == []  # host tensors are not watched by default
