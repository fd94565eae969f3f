"""The one relayout path (``HostLayout.build``) at its seams: add_param_group after a dtype change
or a load with masters pending re-check, param_groups re-bound with slots that move, state entries
deleted or holding extra keys, chunk_numel switches and the speculate knob with overlap on. Every
case against torch's AdamW(fused=True) (fp32), or the same loop without the relayout / overlap off,
bitwise."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from conftest import assert_bitwise, batch, make_model, param_groups, uses_sometimes

from offload import CPUOffloadAdamW, OffloadSettings

pytestmark = pytest.mark.usefixtures("single_threaded_main")

SMALL = OffloadSettings(threads=2, chunk_numel=1024)


def _step(model, opt, step: int, *, clip: float | None = None) -> None:
    opt.zero_grad(set_to_none=True)
    model(batch(step), use_sometimes=uses_sometimes(step)).backward()
    if clip is not None:
        opt.clip_grad_norm_(clip)
    opt.step()


def _frozen_rare(model) -> list[dict]:
    """Groups 0 and 1 of ``param_groups``; the rare layers get no gradient (so stepping or not
    stepping an extra group changes nothing else)."""
    groups = param_groups(model)
    for p in groups[2]["params"]:
        p.requires_grad_(False)
    return groups[:2]


def _extra_group() -> dict:
    """A group of a parameter outside the model (never a gradient): adding it only relays out."""
    return {"params": [nn.Parameter(torch.zeros(7))], "lr": 1e-3}


# ---------------------------------------------------------------- dtype change, then add_param_group
@pytest.mark.parametrize("add", [False, True], ids=["no-add", "add"])
def test_cast_to_bf16_then_add_param_group_keeps_the_fp32_master(add: bool) -> None:
    """An fp32 CPU model (own masters) cast to bf16 between steps: the next step seeds the new
    masters from the fp32 weights it had. An add_param_group between the cast and that step must
    not change that (the same loop without it is the reference)."""
    ref_model, model = make_model(), make_model()
    ref = CPUOffloadAdamW(_frozen_rare(ref_model), settings=SMALL)
    opt = CPUOffloadAdamW(_frozen_rare(model), settings=SMALL)
    for step in range(3):
        _step(ref_model, ref, step)
        _step(model, opt, step)
    for m in (ref_model, model):
        m.to(torch.bfloat16)
    if add:
        opt.add_param_group(_extra_group())
    for step in range(3, 6):
        _step(ref_model, ref, step)
        _step(model, opt, step)
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")
    with_state = [p for p in model.parameters() if opt.state.get(p)]
    ref_with_state = [p for p in ref_model.parameters() if ref.state.get(p)]
    assert_bitwise([opt.state[p]["master_param"] for p in with_state],
                   [ref.state[p]["master_param"] for p in ref_with_state], "master_param")
    ref.close()
    opt.close()


# ---------------------------------------------------------------- a load with masters to re-check
def _checkpoint(dtype: torch.dtype) -> tuple[dict, dict]:
    model = make_model(dtype)
    opt = CPUOffloadAdamW(_frozen_rare(model), settings=SMALL)
    for step in range(3):
        _step(model, opt, step)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    opt.close()
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    return saved["model"], saved["opt"]


@pytest.mark.parametrize(("saved", "resumed"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
                         ids=["fp32-ckpt-in-bf16", "bf16-ckpt-in-fp32"])
@pytest.mark.parametrize("model_first", [True, False], ids=["model-first", "optimizer-first"])
def test_add_param_group_after_a_load_with_masters_to_recheck(saved, resumed, model_first: bool) -> None:
    """A checkpoint loaded into a model of the other dtype (the loaded masters are re-checked at
    the next step), then add_param_group before that step: the same as without the add."""
    model_sd, opt_sd = _checkpoint(saved)
    results = []
    for add in (False, True):
        model = make_model(resumed)
        opt = CPUOffloadAdamW(_frozen_rare(model), settings=SMALL)
        if model_first:
            model.load_state_dict({k: v.to(resumed) for k, v in model_sd.items()})
        opt.load_state_dict(opt_sd)
        if not model_first:
            model.load_state_dict({k: v.to(resumed) for k, v in model_sd.items()})
        if add:
            opt.add_param_group(_extra_group())
        for step in range(3, 6):
            _step(model, opt, step)
        with_state = [p for p in model.parameters() if opt.state.get(p)]
        sd = opt.state_dict()
        results.append((list(model.parameters()), [opt.state[p]["exp_avg"] for p in with_state],
                        [v["master_param"] for k, v in sorted(sd["state"].items()) if "master_param" in v
                         and k < len(with_state)]))
        opt.close()
    (p0, m0, w0), (p1, m1, w1) = results
    assert_bitwise(p1, p0, "params")
    assert_bitwise(m1, m0, "exp_avg")
    assert_bitwise(w1, w0, "master_param")


# ---------------------------------------------------------------- re-binds that move slots
class _Same(nn.Module):
    """Three weights of one shape (no bias): a moved slot reads a neighbour's state silently."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b, self.c = (nn.Linear(8, 8, bias=False) for _ in range(3))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).pow(2).mean()


def _same_batch(step: int) -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(step))


def _rebind_run(make_opt, edit) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    model = _Same()
    opt = make_opt([{"params": [model.a.weight, model.b.weight, model.c.weight]}])
    for step in range(6):
        if step == 3:
            edit(opt, model)
        opt.zero_grad(set_to_none=True)
        model(_same_batch(step)).backward()
        opt.step()
    return list(model.parameters()), opt


def _drop_first(opt, model) -> None:
    opt.param_groups[0]["params"] = [model.b.weight, model.c.weight]


def _reorder(opt, model) -> None:
    opt.param_groups[0]["params"] = [model.c.weight, model.a.weight, model.b.weight]


def _insert_new(opt, model) -> None:
    torch.manual_seed(9)
    model.extra = nn.Linear(8, 8, bias=False)  # no gradient: never stepped, but takes slot 0
    opt.param_groups[0]["params"] = [model.extra.weight, *opt.param_groups[0]["params"]]


@pytest.mark.parametrize("edit", [_drop_first, _reorder, _insert_new], ids=["drop-first", "reorder", "insert-first"])
def test_a_rebind_that_moves_slots_keeps_each_parameters_state_like_torch(edit) -> None:
    """param_groups re-bound so that kept parameters change slot (one dropped before them,
    reordered, one inserted before them): each keeps its own state, as torch's AdamW (keyed by
    the tensor) does."""
    want, ref = _rebind_run(lambda g: torch.optim.AdamW(g, fused=True), edit)
    got, opt = _rebind_run(lambda g: CPUOffloadAdamW(g, settings=SMALL), edit)
    assert_bitwise(got, want, "params")
    opt.close()


# ---------------------------------------------------------------- state entries and add_param_group
def test_a_deleted_state_entry_then_add_param_group_restarts_like_torch() -> None:
    """``del opt.state[p]`` (a re-initialised layer), then add_param_group: p restarts at step 0
    with zero moments, as torch's AdamW; the others keep theirs."""
    def run(make_opt):
        model = make_model()
        groups = _frozen_rare(model)
        opt = make_opt(groups)
        for step in range(6):
            if step == 3:
                del opt.state[model.fc1.weight]
                opt.add_param_group(_extra_group())
            _step(model, opt, step)
        return list(model.parameters()), [opt.state[p]["exp_avg"] for p in model.parameters() if opt.state.get(p)]

    want = run(lambda g: torch.optim.AdamW(g, fused=True))
    got = run(lambda g: CPUOffloadAdamW(g, settings=SMALL))
    assert_bitwise(got[0], want[0], "params")
    assert_bitwise(got[1], want[1], "exp_avg")


@pytest.mark.parametrize("how", ["add_param_group", "rebind-by-key"])
def test_extra_keys_of_a_state_entry_survive_a_relayout(how: str) -> None:
    """A user's own key in a state entry (as torch's optimizers keep any key) is still there after
    add_param_group or a re-bind that moves the entry by key."""
    model = _Same()
    opt = CPUOffloadAdamW([{"params": [model.a.weight, model.b.weight]}], settings=SMALL)
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        model(_same_batch(step)).backward()
        opt.step()
    opt.state[model.a.weight]["mine"] = 42
    if how == "add_param_group":
        opt.add_param_group({"params": [model.c.weight]})
        key = model.a.weight
    else:
        new = nn.Parameter(model.a.weight.detach().clone())
        opt.state[new] = opt.state.pop(model.a.weight)
        opt.param_groups[0]["params"][0] = new
        opt.zero_grad()
        key = new
    opt.state_dict()  # follows the re-bind
    assert opt.state[key].get("mine") == 42
    opt.close()


# ---------------------------------------------------------------- overlap on: settings between steps
def _overlap_run(overlap: bool, *, schedule) -> tuple[list[torch.Tensor], list]:
    model = make_model()
    groups = _frozen_rare(model)
    opt = CPUOffloadAdamW(groups, settings=SMALL, overlap_backward=overlap)
    seen = []
    for step in range(10):
        action = schedule.get(step)
        if action is not None:
            action(opt)
        _step(model, opt, step, clip=1e-3 if 2 <= step < 6 else None)
        st = opt.last_stats
        seen.append((st.speculated_chunks, st.committed_chunks, st.speculation_paused))
    params = list(model.parameters())
    opt.close()
    return params, seen


def _chunk(n: int):
    return lambda opt: opt.apply_settings(replace(opt.settings, chunk_numel=n))


def _speculate(on: bool):
    return lambda opt: opt.apply_settings(replace(opt.settings, speculate=on))


@pytest.mark.parametrize("name", ["rechunk", "speculate-toggled-while-paused", "add-while-paused"])
def test_overlap_with_settings_and_groups_changed_between_steps_equals_off(name: str) -> None:
    """Steps 2-5 clip (speculation pauses after 3 of them); chunk_numel switched, speculate toggled
    off and on while paused, a group added while paused: bitwise overlap off, and speculation
    resumes and commits after the clipped steps (hooks stay calibrated across the relayouts)."""
    schedule = {
        "rechunk": {1: _chunk(1500), 4: _chunk(2048), 7: _chunk(1024)},
        "speculate-toggled-while-paused": {5: _speculate(False), 6: _speculate(True)},
        "add-while-paused": {5: lambda opt: opt.add_param_group(_extra_group())},
    }[name]
    want, _ = _overlap_run(False, schedule=schedule)
    got, seen = _overlap_run(True, schedule=schedule)
    assert_bitwise(got, want, "params")
    assert any(s > 0 and c == s for s, c, _ in seen[-2:]), seen
    assert seen[-1][2] is False, seen


def test_overlap_add_param_group_keeps_the_hook_calibration() -> None:
    """add_param_group between steps with overlap on: the old parameters' chunks still start
    during the next backward (their hook counts are kept), and the result is overlap off's."""
    def run(overlap: bool):
        model = make_model()
        opt = CPUOffloadAdamW(_frozen_rare(model), settings=SMALL, overlap_backward=overlap)
        seen = []
        for step in range(5):
            if step == 2:
                opt.add_param_group(_extra_group())
            _step(model, opt, step)
            seen.append(opt.last_stats.committed_chunks)
        params = list(model.parameters())
        opt.close()
        return params, seen

    want, _ = run(False)
    got, seen = run(True)
    assert_bitwise(got, want, "params")
    assert seen[2] > 0, seen  # the step right after the add
