"""Speculation writes a second generation of the state; ``step()`` commits it by a swap.

Checked here, overlap on against overlap off on the same loop: while early kernels have run and
``step()`` has not, ``optimizer.state`` (step, moments, master) is the last committed step's,
bitwise (the early kernels wrote the other generation, with ``into=``); after ``step()`` it is
the new step's, through the same tensor objects (the swap exchanges storage memory under every
view); a redone chunk (the clip coefficient changed) and a dropped window (``zero_grad()``) need
nothing restored; parameters without a gradient in a step that commits keep their state; the
commit without the native swap (a copy) gives the same bits; and a ``step()`` that fails while
judging its early chunks, after some were committed and their weights written, keeps weights
and state together.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from conftest import assert_bitwise, batch, make_model, param_groups, uses_sometimes

from offload import CPUOffloadAdamW, OffloadSettings
from offload.testing import KernelSet
from offload.kernels._adamw import mixed_precision_adamw_, native_adamw_f32_

pytestmark = pytest.mark.usefixtures("single_threaded_main")

SETTINGS = OffloadSettings(threads=1, chunk_numel=1024)


class EarlyCalls:
    """A kernel set whose native kernels count the calls that update out of place (``into=``,
    the early chunks'), so a test can wait until the speculation ran."""

    def __init__(self) -> None:
        self.count = 0
        self.cond = threading.Condition()

    def wrap(self, fn):  # noqa: ANN001, ANN201
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            fn(*args, **kwargs)
            if kwargs.get("into"):
                with self.cond:
                    self.count += 1
                    self.cond.notify_all()
        return call

    def kernels(self) -> KernelSet:
        return KernelSet(mixed_precision_adamw=self.wrap(mixed_precision_adamw_),
                         native_adamw_f32=self.wrap(native_adamw_f32_))

    def wait_for(self, n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.count < n:
                left = deadline - time.monotonic()
                assert left > 0, f"{self.count} early kernel calls after {timeout} s: expected {n}"
                self.cond.wait(left)


def _snapshot(opt: CPUOffloadAdamW) -> list[torch.Tensor]:
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                out += [st["step"].clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()]
                if "master_param" in st:
                    out.append(st["master_param"].clone())
    return out


def _loss(model, step: int) -> torch.Tensor:  # noqa: ANN001
    return model(batch(step), use_sometimes=uses_sometimes(step)).float().square().mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_between_backward_and_step_is_the_committed_step(kernel, dtype) -> None:
    ref_model, model = make_model(dtype), make_model(dtype)
    ref = CPUOffloadAdamW(param_groups(ref_model), settings=SETTINGS)
    calls = EarlyCalls()
    opt = CPUOffloadAdamW(param_groups(model), settings=SETTINGS, overlap_backward=True, kernels=calls.kernels())
    tensors = None
    committed: list[torch.Tensor] = []  # opt.state after the last step
    for step in range(4):
        before = calls.count
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            _loss(m, step).backward()
        if step:
            calls.wait_for(before + 1)  # at least one early kernel ran into the second generation
            assert_bitwise(_snapshot(opt), committed, f"opt.state between backward and step() {step}")
        ref.step()
        opt.step()
        if step:
            assert opt.last_stats.speculated_chunks > 0
            assert opt.last_stats.committed_chunks == opt.last_stats.speculated_chunks
        committed = _snapshot(opt)
        assert_bitwise(committed, _snapshot(ref), f"state after step {step}")
        assert_bitwise(list(model.parameters()), list(ref_model.parameters()), f"params after step {step}")
        views = [t for st in opt.state.values() for t in (st["exp_avg"], st["exp_avg_sq"])]
        if tensors is not None:  # the same tensor objects show each new step: views of swapped storages
            assert all(a is b for a, b in zip(views, tensors))
        tensors = views
    ref.close()
    opt.close()


@pytest.mark.parametrize("native_swap", [True, False])
def test_redo_drop_and_gradientless_parameters_without_restores(kernel, native_swap) -> None:
    """Every step of the loop speculates. Step 1 clips (every early chunk redone from the
    committed state), step 2 is dropped by ``zero_grad()`` after backward (nothing to restore),
    every third step a layer has no gradient (its state is carried into the committed
    generation). ``native_swap=False``: the commit copies (as without the native extension)."""
    dtype = torch.bfloat16
    ref_model, model = make_model(dtype), make_model(dtype)
    ref = CPUOffloadAdamW(param_groups(ref_model), settings=SETTINGS)
    kernels = KernelSet() if native_swap else KernelSet(swap=None)
    opt = CPUOffloadAdamW(param_groups(model), settings=SETTINGS, overlap_backward=True, kernels=kernels)
    assert (opt._engine.swap is not None) == native_swap
    for step in range(7):
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            _loss(m, step).backward()
            if step == 1:
                o.clip_grad_norm_(1e-3)
            if step == 2:
                o.zero_grad()  # a step that does not happen
                continue
            o.step()
        if step == 1:
            assert opt.last_stats.committed_chunks == 0 < opt.last_stats.speculated_chunks
        assert_bitwise(_snapshot(opt), _snapshot(ref), f"state after step {step}")
        assert_bitwise(list(model.parameters()), list(ref_model.parameters()), f"params after step {step}")
    ref.close()
    opt.close()


class FailingChecksums:
    """``KernelSet.checksums`` that raises at call ``fail_at`` (counted from 1) while armed: the
    checksums step() reads chunk by chunk, after earlier chunks were committed and written."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail_at: int | None = None

    def __call__(self, tensors, **kwargs):  # noqa: ANN001, ANN003, ANN204
        from offload.kernels._grad_stats import checksums_
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise OSError("injected checksum failure")
        return checksums_(tensors, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_failure_after_committed_writes_keeps_weights_and_state_together(kernel, dtype) -> None:
    """step() fails while judging its early chunks, after some were committed and their weights
    written: those chunks keep their update (state and weights agree: the master rounds to the
    weight, the step counts it), the others keep the last step's, and training goes on."""
    checks = FailingChecksums()
    calls = EarlyCalls()
    model = make_model(dtype)
    opt = CPUOffloadAdamW(param_groups(model), settings=SETTINGS, overlap_backward=True,
                          kernels=KernelSet(checksums=checks, mixed_precision_adamw=calls.wrap(mixed_precision_adamw_),
                                            native_adamw_f32=calls.wrap(native_adamw_f32_)))
    for step in range(2):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    steps_before = {id(p): float(st["step"]) for p, st in opt.state.items()}
    checkpoint = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    start = calls.count
    _loss(model, 2).backward()
    calls.wait_for(start + 3)  # several early chunks ran
    checks.calls, checks.fail_at = 0, 3  # the third chunk's check fails: two were committed first
    with pytest.raises(OSError, match="injected checksum failure"):
        opt.step()
    checks.fail_at = None
    moved = [i for i, (p, b) in enumerate(zip(model.parameters(), before)) if not torch.equal(p, b)]
    assert moved, "the chunks committed before the failure kept their update"
    assert len(moved) < len(before), "the chunks after the failure kept the last step"
    for i, p in enumerate(model.parameters()):
        st = opt.state.get(p)
        if not st:
            continue
        master = st["master_param"]
        assert torch.equal(master.to(p.dtype), p.detach()), f"parameter {i}: master and weight disagree"
        advanced = float(st["step"]) - steps_before[id(p)]
        assert advanced == (1.0 if i in moved else 0.0) or p.numel() > SETTINGS.chunk_numel, i
    # A parameter spanning chunks kept part of the update: refused until a checkpoint is loaded.
    assert any(p.numel() > SETTINGS.chunk_numel for i, p in enumerate(model.parameters()) if i in moved)
    with pytest.raises(RuntimeError, match="part-stepped"):
        opt.step()
    opt.load_state_dict(checkpoint)
    with torch.no_grad():
        for p, b in zip(model.parameters(), before):
            p.copy_(b)
    for step in range(3, 5):  # training goes on
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
    opt.close()
