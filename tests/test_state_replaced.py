"""State tensors replaced by assignment (how recipes reset a re-initialised layer's moments) are
what the next step uses, as in torch's AdamW: overlap off and on, fp32 and bf16, between steps and
between backward and step(); a tensor that cannot be a moment of its parameter raises."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import assert_bitwise, batch, make_model, param_groups

from offload import CPUOffloadAdamW, OffloadSettings

pytestmark = pytest.mark.usefixtures("single_threaded_main")

SETTINGS = OffloadSettings(threads=1, chunk_numel=1024)
STEPS = 5
EDIT_AT = 2


def _replace_moment(opt: torch.optim.Optimizer, p: torch.Tensor) -> None:
    opt.state[p]["exp_avg"] = torch.zeros_like(p)


def _replace_entry(opt: torch.optim.Optimizer, p: torch.Tensor) -> None:
    # The step read off opt.state, as recipes do: between backward and step() too it is the
    # committed count (EDIT_AT steps done), whatever early chunks counted meanwhile.
    step = opt.state[p]["step"].clone()
    assert step.item() == EDIT_AT
    opt.state[p] = {"step": step, "exp_avg": torch.full_like(p, 1e-3, dtype=torch.float32),
                    "exp_avg_sq": torch.ones_like(p)}


def _in_place_moment(opt: torch.optim.Optimizer, p: torch.Tensor) -> None:
    opt.state[p]["exp_avg"].zero_()


def _in_place_entry(opt: torch.optim.Optimizer, p: torch.Tensor) -> None:
    st = opt.state[p]
    st["exp_avg"].fill_(1e-3)
    st["exp_avg_sq"].fill_(1.0)


def _train(make_opt: Callable, dtype: torch.dtype, edit: Callable, *, after_backward: bool
           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model = make_model(dtype)
    opt = make_opt(model)
    target = model.emb.weight if hasattr(model, "emb") else next(model.parameters())
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        if step == EDIT_AT and not after_backward:
            edit(opt, target)
        model(batch(step)).backward()
        if step == EDIT_AT and after_backward:
            edit(opt, target)
        opt.step()
    params = list(model.parameters())
    return params, [opt.state[p]["exp_avg"] for p in params if opt.state.get(p)]


def _ours(overlap: bool) -> Callable:
    return lambda model: CPUOffloadAdamW(param_groups(model), settings=SETTINGS, overlap_backward=overlap)


@pytest.mark.parametrize("after_backward", [False, True], ids=["between-steps", "after-backward"])
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("replace", "in_place"), [(_replace_moment, _in_place_moment), (_replace_entry, _in_place_entry)],
                         ids=["moment", "entry"])
def test_a_replaced_state_tensor_is_what_the_next_step_uses(replace, in_place, dtype, overlap, after_backward) -> None:
    """The reference is the same values written in place (followed since the start): a replaced
    tensor must give the same bits. For fp32, torch's AdamW given the same replacement too."""
    got = _train(_ours(overlap), dtype, replace, after_backward=after_backward)
    want = _train(_ours(False), dtype, in_place, after_backward=after_backward)
    assert_bitwise(got[0], want[0], "params")
    assert_bitwise(got[1], want[1], "exp_avg")
    if dtype == torch.float32:
        torch_run = _train(lambda m: torch.optim.AdamW(param_groups(m), fused=True), dtype, replace,
                           after_backward=after_backward)
        assert_bitwise(got[0], torch_run[0], "params vs torch")


def test_the_replaced_state_is_in_the_state_dict_and_survives_a_relayout() -> None:
    model = make_model()
    opt = CPUOffloadAdamW(param_groups(model), settings=SETTINGS)
    model(batch(0)).backward()
    opt.step()
    p = model.emb.weight
    opt.state[p]["exp_avg_sq"] = torch.full_like(p, 2.0)
    sd = opt.state_dict()  # torch's shows the new tensor; so does ours
    slot = [q for g in opt.param_groups for q in g["params"]].index(p)
    assert torch.equal(sd["state"][slot]["exp_avg_sq"], torch.full_like(p, 2.0))
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})  # lays the slabs out again
    assert torch.equal(opt.state[p]["exp_avg_sq"], torch.full_like(p, 2.0))


@pytest.mark.parametrize(("value", "error", "match"), [
    (lambda p: torch.zeros(3), ValueError, r"optimizer.state\[.*\]\['exp_avg'\] has shape \(3,\): expected the parameter's shape"),
    (lambda p: torch.zeros_like(p, dtype=torch.int32), TypeError, r"\['exp_avg'\] is torch.int32: expected a floating-point tensor"),
    (lambda p: 0.0, TypeError, r"\['exp_avg'\] is float: expected a floating-point tensor"),
])
def test_a_replaced_tensor_that_cannot_be_a_moment_raises_naming_it(value, error, match) -> None:
    model = make_model()
    opt = CPUOffloadAdamW(param_groups(model), settings=SETTINGS)
    model(batch(0)).backward()
    opt.step()
    p = model.emb.weight
    before = p.detach().clone()
    opt.state[p]["exp_avg"] = value(p)
    model(batch(1)).backward()
    with pytest.raises(error, match=match):
        opt.step()
    assert torch.equal(p, before)  # nothing was written
