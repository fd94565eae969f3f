"""Checkpoints cross between ``torch.optim.AdamW(fused=True)`` and ``CPUOffloadAdamW`` both ways,
through ``load_state_dict`` and through ``dcp.save``/``dcp.load`` with the default planner, and
continue bitwise like torch's AdamW all the way (one process; FSDP2 in
``tests/test_checkpoint_interop_fsdp2.py``)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
from conftest import assert_bitwise, batch, make_model, param_groups, uses_sometimes

from offload import CPUOffloadAdamW, OffloadSettings

pytestmark = pytest.mark.usefixtures("single_threaded_main")

SMALL = OffloadSettings(threads=1, chunk_numel=1024)


def _train(model, opt, steps) -> None:
    for step in steps:
        opt.zero_grad(set_to_none=True)
        model(batch(step), use_sometimes=uses_sometimes(step)).backward()
        opt.step()


def _torch(model) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model), fused=True)


def _state(model, opt) -> list[torch.Tensor]:
    out = [p.detach() for p in model.parameters()]
    for key in ("exp_avg", "exp_avg_sq", "step"):
        out += [opt.state[p][key] for p in model.parameters() if opt.state.get(p)]
    return out


def test_state_dict_has_torch_fused_adamw_keys() -> None:
    """fp32: exactly torch's keys and group flags; bf16: ``master_param`` in addition."""
    for dtype in (torch.float32, torch.bfloat16):
        model, ref_model = make_model(dtype), make_model(dtype)
        opt, ref = CPUOffloadAdamW(param_groups(model), settings=SMALL), _torch(ref_model)
        _train(model, opt, range(1))
        _train(ref_model, ref, range(1))
        sd, rsd = opt.state_dict(), ref.state_dict()
        assert sd["param_groups"] == rsd["param_groups"]
        extra = {"master_param"} if dtype == torch.bfloat16 else set()
        assert {k: set(v) for k, v in sd["state"].items()} == {k: set(v) | extra for k, v in rsd["state"].items()}
        opt.close()


def test_torch_adamw_loading_ours_stays_fused() -> None:
    """torch's ``load_state_dict`` takes the loaded group's flags: ours says ``fused=True``."""
    model = make_model()
    opt = CPUOffloadAdamW(param_groups(model), settings=SMALL)
    _train(model, opt, range(1))
    for fused in (True, None):
        ref = torch.optim.AdamW(param_groups(model), fused=fused)
        ref.load_state_dict(opt.state_dict())
        assert all(g["fused"] is True and g["decoupled_weight_decay"] is True for g in ref.param_groups)
    opt.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_round_trip_ours_torch_ours_is_torch_all_the_way(overlap: bool) -> None:
    """ours (4 steps) -> torch AdamW (3) -> a fresh ours (3): bitwise torch AdamW's 10 steps; the
    saved state between them is torch's (no master_param on an fp32 model)."""
    ref_model, model = make_model(), make_model()
    ref = _torch(ref_model)
    _train(ref_model, ref, range(10))
    opt = CPUOffloadAdamW(param_groups(model), settings=SMALL, overlap_backward=overlap)
    _train(model, opt, range(4))
    middle = _torch(model)
    middle.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.close()
    _train(model, middle, range(4, 7))
    back = CPUOffloadAdamW(param_groups(model), settings=SMALL, overlap_backward=overlap)
    back.load_state_dict(middle.state_dict())
    _train(model, back, range(7, 10))
    assert_bitwise(_state(model, back), _state(ref_model, ref), "round trip")
    back.close()


def test_round_trip_bf16_drops_the_stale_master_with_one_warning(caplog) -> None:
    """bf16: ours' fp32 ``master_param`` rides along torch AdamW's 3 steps unchanged; loaded
    back, it no longer rounds to the trained weights, so the weights win (one warning naming the
    count): the run continues exactly as from torch's own state (no master_param)."""
    model = make_model(torch.bfloat16)
    opt = CPUOffloadAdamW(param_groups(model), settings=SMALL)
    _train(model, opt, range(4))
    middle = _torch(model)
    middle.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.close()
    _train(model, middle, range(4, 7))
    sd = middle.state_dict()
    assert all("master_param" in s for s in sd["state"].values())  # torch keeps foreign keys
    twin = copy.deepcopy(model)
    clean = copy.deepcopy(sd)
    for s in clean["state"].values():
        del s["master_param"]
    back = CPUOffloadAdamW(param_groups(model), settings=SMALL)
    ref = CPUOffloadAdamW(param_groups(twin), settings=SMALL)
    back.load_state_dict(sd)
    ref.load_state_dict(clean)
    params = [p for g in back.param_groups for p in g["params"]]
    stale_count = sum(1 for i, s in sd["state"].items()
                      if not torch.equal(s["master_param"].bfloat16(), params[i].detach()))
    assert stale_count
    with caplog.at_level(logging.WARNING, logger="offload.state._masters"):
        _train(model, back, range(7, 10))
        _train(twin, ref, range(7, 10))
    stale = [r for r in caplog.records if "no longer rounds" in r.getMessage()]
    assert len(stale) == 1 and f"of {stale_count} parameter(s)" in stale[0].getMessage(), \
        [r.getMessage() for r in stale]
    assert_bitwise(_state(model, back), _state(twin, ref), "bf16 round trip")
    back.close()
    ref.close()


def test_loaded_master_that_agrees_is_kept_without_warning(caplog) -> None:
    """A bf16 checkpoint resumed straight (model and optimizer together): the master is kept
    (bitwise the uninterrupted run) and nothing is warned."""
    model, resumed = make_model(torch.bfloat16), make_model(torch.bfloat16, seed=3)
    opt = CPUOffloadAdamW(param_groups(model), settings=SMALL)
    _train(model, opt, range(4))
    ck = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    ropt = CPUOffloadAdamW(param_groups(resumed), settings=SMALL)
    ropt.load_state_dict(ck["optim"])
    resumed.load_state_dict(ck["model"])
    with caplog.at_level(logging.WARNING, logger="offload.state._masters"):
        _train(model, opt, range(4, 7))
        _train(resumed, ropt, range(4, 7))
    assert not [r for r in caplog.records if "no longer rounds" in r.getMessage()]
    assert_bitwise(_state(resumed, ropt), _state(model, opt), "resumed")
    opt.close()
    ropt.close()


# ---------------------------------------------------------------- DCP, default planner
def _dcp_model(dtype: torch.dtype = torch.float32, seed: int = 0):
    """``make_model`` without the parameter that never gets a gradient: a destination's
    ``get_optimizer_state_dict`` gives it fresh state the source lacks (torch -> torch too)."""
    model = make_model(dtype, seed=seed)
    model.unused.requires_grad_(False)
    return model


def _dcp_save(model, opt, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(path))


def _dcp_load(model, opt, path: Path, planner=None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=str(path), planner=planner)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])


@pytest.mark.parametrize("direction", ["torch->ours", "ours->torch"])
def test_dcp_default_planner_both_ways(tmp_path: Path, direction: str) -> None:
    """A DCP checkpoint of one optimizer loads into the other (fresh model, default planner) and
    the run continues bitwise like torch AdamW's uninterrupted one."""
    ref_model = _dcp_model()
    ref = _torch(ref_model)
    first, second = _dcp_model(), _dcp_model(seed=3)
    make_ours = lambda m: CPUOffloadAdamW(param_groups(m), settings=SMALL)  # noqa: E731
    kinds = (_torch, make_ours) if direction == "torch->ours" else (make_ours, _torch)
    opt = kinds[0](first)
    _train(first, opt, range(4))
    _dcp_save(first, opt, tmp_path / "ck")
    ropt = kinds[1](second)
    _dcp_load(second, ropt, tmp_path / "ck")
    _train(ref_model, ref, range(7))
    _train(second, ropt, range(4, 7))
    assert_bitwise(_state(second, ropt), _state(ref_model, ref), direction)
    for o in (opt, ropt):
        if isinstance(o, CPUOffloadAdamW):
            o.close()


def test_dcp_bf16_master_param_is_a_key_only_ours_needs(tmp_path: Path, caplog) -> None:
    """bf16: ours -> torch loads with the default planner (the checkpoint's extra
    ``master_param`` is not asked for; torch keeps its moments in bf16, the parameter's dtype);
    torch -> ours: the default planner refuses (our destination asks for ``master_param``),
    ``MasterParamLoadPlanner`` drops exactly those keys, and the loaded weights are the masters
    (no stale master left behind: no warning at the next step)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from offload import MasterParamLoadPlanner

    model = _dcp_model(torch.bfloat16)
    opt = CPUOffloadAdamW(param_groups(model), settings=SMALL)
    _train(model, opt, range(3))
    _dcp_save(model, opt, tmp_path / "ours")
    ref_model = _dcp_model(torch.bfloat16, seed=3)
    ref = _torch(ref_model)
    _dcp_load(ref_model, ref, tmp_path / "ours")
    assert_bitwise([ref.state[p]["exp_avg"] for p in ref_model.parameters() if ref.state.get(p)],
                   [opt.state[p]["exp_avg"].bfloat16() for p in model.parameters() if opt.state.get(p)],
                   "exp_avg")
    assert all(g["fused"] is True for g in ref.param_groups)
    _train(ref_model, ref, range(3, 4))
    _dcp_save(ref_model, ref, tmp_path / "torch")
    back_model = _dcp_model(torch.bfloat16, seed=4)
    back = CPUOffloadAdamW(param_groups(back_model), settings=SMALL)
    with pytest.raises(CheckpointException, match="master_param"):
        _dcp_load(back_model, back, tmp_path / "torch")
    planner = MasterParamLoadPlanner()
    _dcp_load(back_model, back, tmp_path / "torch", planner=planner)
    held = [p for p in ref_model.parameters() if ref.state.get(p)]
    mine = [p for p in back_model.parameters() if back.state.get(p)]
    assert len(planner.dropped) == len(mine) > 0
    assert all(key.endswith(".master_param") for key in planner.dropped)
    assert_bitwise(list(back_model.parameters()), list(ref_model.parameters()), "weights")
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert_bitwise([back.state[p][key] for p in mine], [ref.state[p][key].float() for p in held], key)
    assert_bitwise([back.state[p]["master_param"] for p in mine], [p.detach().float() for p in held],
                   "masters seeded from the loaded weights")
    with caplog.at_level(logging.WARNING, logger="offload.state._masters"):
        _train(back_model, back, range(4, 5))
    assert not [r.getMessage() for r in caplog.records if "no longer rounds" in r.getMessage()]
    opt.close()
    back.close()


def test_master_param_planner_still_refuses_any_other_missing_key(tmp_path: Path) -> None:
    """Only ``master_param`` may be missing: a checkpoint without a moment still raises, naming it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from offload import MasterParamLoadPlanner

    model = _dcp_model(torch.bfloat16)
    opt = CPUOffloadAdamW(param_groups(model), settings=SMALL)
    _train(model, opt, range(2))
    saved = get_optimizer_state_dict(model, opt)
    fqn = next(iter(saved["state"]))
    saved["state"][fqn] = {k: v for k, v in saved["state"][fqn].items()  # (a copy: not opt.state's)
                           if k not in ("exp_avg_sq", "master_param")}
    dcp.save({"optim": saved}, checkpoint_id=str(tmp_path / "ck"))
    with pytest.raises(CheckpointException, match="exp_avg_sq"):
        dcp.load({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(tmp_path / "ck"),
                 planner=MasterParamLoadPlanner())
    opt.close()


# --- review: MasterParamLoadPlanner on the two other state-dict layouts DCP users hand it ---


def _torch_bf16_source(steps=range(3)):
    ref_model = _dcp_model(torch.bfloat16)
    ref = torch.optim.AdamW(param_groups(ref_model), fused=True)
    _train(ref_model, ref, steps)
    return ref_model, ref


def test_master_param_planner_int_keyed_optimizer_state_dict(tmp_path: Path) -> None:
    """``dcp.load({"model": model.state_dict(), "optim": opt.state_dict()})``: the plain
    int-keyed layout. ``flatten_state_dict`` spells the key ``"0"``, the state dict has ``0``: the
    planner must drop ``state[0]["master_param"]``, not raise ``KeyError: '0'``."""
    import torch.distributed.checkpoint as dcp

    from offload import MasterParamLoadPlanner

    ref_model, ref = _torch_bf16_source()
    dcp.save({"model": ref_model.state_dict(), "optim": ref.state_dict()}, checkpoint_id=str(tmp_path / "ck"))
    model = _dcp_model(torch.bfloat16)
    opt = CPUOffloadAdamW(param_groups(model), settings=SMALL)
    _train(model, opt, range(1))
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    planner = MasterParamLoadPlanner()
    dcp.load(sd, checkpoint_id=str(tmp_path / "ck"), planner=planner)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    mine = [p for p in model.parameters() if opt.state.get(p)]
    assert planner.dropped and len(planner.dropped) == len(mine)
    assert_bitwise([opt.state[p]["master_param"] for p in mine], [p.detach().float() for p in mine], "masters")
    opt.close()


def test_master_param_planner_flat_optimizer_state_dict(tmp_path: Path) -> None:
    """``StateDictOptions(flatten_optimizer_state_dict=True)``, the layout torchtitan's
    ``OptimizersContainer.state_dict()`` hands ``dcp.load``: the keys are ``"state.<fqn>.master_param"``
    (one string), and a torch AdamW bf16 checkpoint must load as in the nested layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    from offload import MasterParamLoadPlanner

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    ref_model, ref = _torch_bf16_source()
    dcp.save({"model": get_model_state_dict(ref_model), "optim": get_optimizer_state_dict(ref_model, ref, options=flat)},
             checkpoint_id=str(tmp_path / "ck"))
    model = _dcp_model(torch.bfloat16)
    opt = CPUOffloadAdamW(param_groups(model), settings=SMALL)
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=flat)}
    planner = MasterParamLoadPlanner()
    dcp.load(sd, checkpoint_id=str(tmp_path / "ck"), planner=planner)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"], options=flat)
    held = [p for p in ref_model.parameters() if ref.state.get(p)]
    mine = [p for p in model.parameters() if opt.state.get(p)]
    assert len(planner.dropped) == len(mine) > 0
    assert_bitwise([opt.state[p]["master_param"] for p in mine], [p.detach().float() for p in held], "masters")
    for key in ("exp_avg", "exp_avg_sq"):
        assert_bitwise([opt.state[p][key] for p in mine], [ref.state[p][key].float() for p in held], key)
    opt.close()


def test_master_param_planner_never_drops_a_model_weight_named_master_param(tmp_path: Path) -> None:
    """Only an optimizer state's ``master_param`` may be missing: a model (or any other entry)
    whose own key is ``master_param`` still gets DCP's 'Missing key' refusal."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from offload import MasterParamLoadPlanner

    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.master_param = torch.nn.Parameter(torch.ones(4))
            self.w = torch.nn.Parameter(torch.ones(4))

    dcp.save({"model": {"w": torch.full((4,), 2.0)}}, checkpoint_id=str(tmp_path / "ck"))
    model = Scale()
    with pytest.raises(CheckpointException, match="master_param"):
        dcp.load({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ck"), planner=MasterParamLoadPlanner())
