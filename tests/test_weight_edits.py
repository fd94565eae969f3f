"""Weights edited between steps (clamp_, model.load_state_dict, .data replaced): the next step
starts from the edited parameter, bitwise as torch.optim.AdamW(fused=True) does."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import assert_bitwise, batch, make_model, param_groups, uses_sometimes
from test_optimizer_numerics import MixedPrecisionReference

from offload import CPUOffloadAdamW, OffloadSettings

pytestmark = pytest.mark.usefixtures("single_threaded_main")

STEPS = 12


def _clamp(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.05, 0.05)


def _load(model: torch.nn.Module) -> None:
    other = make_model(next(model.parameters()).dtype, seed=5)
    model.load_state_dict(other.state_dict())


def _replace_data(model: torch.nn.Module) -> None:
    model.fc1.weight.data = model.fc1.weight.data * 0.5  # a new tensor: same version, new storage
    model.norm.bias.data = torch.full_like(model.norm.bias, 0.3)


EDITS = {"clamp": _clamp, "load_state_dict": _load, "data": _replace_data}


def _train(model, opt, edits: dict[int, object], *, micro: int = 1) -> None:
    for step in range(STEPS):
        if step in edits:
            edits[step](model)
            follow = getattr(opt, "follow_edits", None)
            if follow is not None:
                follow()
        opt.zero_grad(set_to_none=True)
        for m in range(micro):
            loss = model(batch(step, m), use_sometimes=uses_sometimes(step)) / micro
            if m < micro - 1:
                with getattr(opt, "accumulating", contextlib.nullcontext)():
                    loss.backward()
            else:
                loss.backward()
        opt.step()


class _EditAwareReference(MixedPrecisionReference):
    """The mixed-precision reference with the documented rule for edited low-precision weights:
    an element that no longer equals its master rounded to the weight's dtype restarts from the
    weight; the others keep their master."""

    def follow_edits(self) -> None:
        with torch.no_grad():
            for p in self.params:
                master = self.master[p]
                if master.shape != p.shape:
                    continue
                keep = master.to(p.dtype) == p
                master.copy_(torch.where(keep, master, p.float()))


def reference(model: torch.nn.Module, dtype: torch.dtype):
    """The reference optimizer for ``model`` and how to read a parameter's state from it: torch's
    AdamW for fp32, the edit-aware mixed-precision reference otherwise."""
    if dtype == torch.float32:
        ref = torch.optim.AdamW(param_groups(model), fused=True)
        return ref, lambda p: ref.state[p]
    ref = _EditAwareReference(model)
    return ref, ref.state


def _ours(model, *, overlap: bool) -> CPUOffloadAdamW:
    return CPUOffloadAdamW(
        param_groups(model),
        settings=OffloadSettings(threads=2, chunk_numel=1024),
        overlap_backward=overlap,
    )


def _check(model, opt, ref_model, ref_state) -> None:
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")
    with_state = [(p, r) for p, r in zip(model.parameters(), ref_model.parameters()) if opt.state.get(p)]
    for key in ("exp_avg", "exp_avg_sq", "step"):
        got = [opt.state[p][key].reshape(r.shape if key != "step" else ()) for p, r in with_state]
        want = [ref_state(r)[key].reshape(r.shape if key != "step" else ()) for p, r in with_state]
        assert_bitwise(got, want, key)


@pytest.mark.parametrize("kind", sorted(EDITS))
def test_fp32_edit_between_steps_is_kept_like_torch(kind: str) -> None:
    edits = {4: EDITS[kind], 9: EDITS[kind]}
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(param_groups(ref_model), fused=True)
    opt = _ours(model, overlap=False)
    _train(ref_model, ref, edits)
    _train(model, opt, edits)
    _check(model, opt, ref_model, lambda p: ref.state[p])
    # the master follows the parameter (fp32: equal)
    assert_bitwise([opt.state[p]["master_param"] for p in model.parameters() if opt.state.get(p)],
                   [p for p in model.parameters() if opt.state.get(p)], "master")
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overlap", [False, True])
def test_every_edit_kind_with_and_without_overlap(dtype: torch.dtype, overlap: bool) -> None:
    """Chunks started early during backward read the re-seeded master too (the check runs at
    launch); bf16 against the mixed-precision reference with the documented rule."""
    edits = {3: _clamp, 6: _load, 9: _replace_data}
    ref_model, model = make_model(dtype), make_model(dtype)
    ref, ref_state = reference(ref_model, dtype)
    opt = _ours(model, overlap=overlap)
    _train(ref_model, ref, edits, micro=2 if overlap else 1)
    _train(model, opt, edits, micro=2 if overlap else 1)
    if overlap:
        assert opt.last_stats.speculated_chunks > 0  # chunks really started during backward
    _check(model, opt, ref_model, ref_state)
    if dtype != torch.float32:
        pairs = [(p, r) for p, r in zip(model.parameters(), ref_model.parameters()) if opt.state.get(p)]
        assert_bitwise([opt.state[p]["master_param"] for p, _ in pairs],
                       [ref.master[r] for _, r in pairs], "master")
    opt.close()


def test_bf16_unchanged_elements_keep_the_masters_extra_precision() -> None:
    model = make_model(torch.bfloat16)
    opt = _ours(model, overlap=False)
    _train(model, opt, {})
    w = model.fc1.weight
    before = opt.state[w]["master_param"].clone()
    assert not torch.equal(before, w.float())  # the master has bits the bf16 weight lacks
    with torch.no_grad():
        w[0].fill_(0.25)  # edit one row only
    opt._engine.follow_edits(opt.param_groups, opt.state, {opt._layout.registry.of(w).slot: w.grad})
    after = opt.state[w]["master_param"]
    assert torch.equal(after[0], torch.full_like(after[0], 0.25))
    assert torch.equal(after[1:], before[1:])
    opt.close()


def test_edit_after_an_early_launch_is_followed_exactly() -> None:
    models, opts = [], []
    for overlap in (False, True):
        model = make_model()
        opt = _ours(model, overlap=overlap)
        _train(model, opt, {}, micro=2)
        opt.zero_grad()
        model(batch(99)).backward()
        if overlap:
            assert opt._overlap.has_launched()
        _clamp(model)
        opt.step()
        models.append(model)
        opts.append(opt)
    assert_bitwise(list(models[1].parameters()), list(models[0].parameters()), "params")
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert_bitwise([opts[1].state[p][key] for p in models[1].parameters() if opts[1].state.get(p)],
                       [opts[0].state[p][key] for p in models[0].parameters() if opts[0].state.get(p)], key)
    for opt in opts:
        opt.close()


def test_data_replaced_by_another_shape_names_the_parameter() -> None:
    lin = torch.nn.Linear(4, 3)
    opt = CPUOffloadAdamW(lin.parameters(), settings=OffloadSettings(threads=1, chunk_numel=1024))
    lin(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    lin.weight.data = torch.zeros(5, 4)
    lin.weight.grad = torch.ones(5, 4)
    lin.bias.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"parameter 0 now has shape \(5, 4\): expected \(3, 4\)"):
        opt.step()
    opt.close()
