"""FSDP2 (2 gloo ranks): ``torch.save``, ``torch.load`` and ``copy.deepcopy`` of ``state_dict()``
work (its DTensors sit on standalone aliases of the host slabs, not offset views, nor copies), and DCP checkpoints cross
between ``torch.optim.AdamW(fused=True)`` and ``CPUOffloadAdamW`` both ways with the default
planner, continuing bitwise like torch AdamW's uninterrupted run."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
import torch

from _dist_util import run_workers
from _fsdp_models import make_pair, train_plain

pytestmark = pytest.mark.slow


def _state(model: Any, opt: Any) -> list[torch.Tensor]:
    from offload.state._dtensor import local

    out = [local(p).detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [local(opt.state[p][k]).detach().clone() for k in ("exp_avg", "exp_avg_sq", "step")]
    return out


def _worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from _fsdp_models import assert_same
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    # torch.save / torch.load / deepcopy of state_dict(): equal to the live state.
    for kind in ("ours", "ours-bf16"):
        model, opt = make_pair(kind)
        train_plain(model, opt, rank, range(2))
        sd = opt.state_dict()
        params = [p for g in opt.param_groups for p in g["params"]]
        for i, entry in sd["state"].items():  # aliases of the live state, not copies
            live = opt.state[params[i]]
            assert all(entry[k].to_local().data_ptr() == live[k].data_ptr()
                       for k in entry if k != "step" and live[k].numel()), (kind, i)
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        copied = copy.deepcopy(sd)
        for key, entry in sd["state"].items():
            for name, value in entry.items():
                for other in (loaded["state"][key][name], copied["state"][key][name]):
                    assert type(other) is type(value), (name, type(other), type(value))
                    if isinstance(value, DTensor):
                        assert other.placements == value.placements and other.shape == value.shape
                        assert torch.equal(other.to_local(), value.to_local()), (kind, key, name)
                    else:
                        assert torch.equal(other, value), (kind, key, name)
        opt.load_state_dict(loaded)  # and it loads back
        opt.close()
    # DCP both ways, default planner: torch -> ours -> torch, bitwise torch's uninterrupted run.
    ref, ref_opt = make_pair("torch")
    train_plain(ref, ref_opt, rank, range(9))
    chain = ("torch", "ours", "torch")
    model, opt = make_pair(chain[0])
    for i, kind in enumerate(chain):
        if i:
            model, opt = make_pair(kind)
            sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
            dcp.load(sd, checkpoint_id=str(Path(root) / str(i - 1)))
            set_model_state_dict(model, sd["model"])
            set_optimizer_state_dict(model, opt, sd["optim"])
        train_plain(model, opt, rank, range(3 * i, 3 * i + 3))
        if i < len(chain) - 1:
            dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                     checkpoint_id=str(Path(root) / str(i)))
            if kind == "ours":
                opt.close()
    assert_same(_state(model, opt), _state(ref, ref_opt), "torch -> ours -> torch")
    # bf16, torch -> ours: MasterParamLoadPlanner drops the masters the checkpoint lacks (the
    # default planner refuses), and they are seeded from the loaded weights.
    from offload import MasterParamLoadPlanner
    from offload.state._dtensor import local

    src, src_opt = make_pair("torch-bf16")
    train_plain(src, src_opt, rank, range(2))
    dcp.save({"model": get_model_state_dict(src), "optim": get_optimizer_state_dict(src, src_opt)},
             checkpoint_id=str(Path(root) / "bf16"))
    dst, dst_opt = make_pair("ours-bf16")
    train_plain(dst, dst_opt, rank, range(1))  # its own (stale) masters and moments, overwritten
    sd = {"model": get_model_state_dict(dst), "optim": get_optimizer_state_dict(dst, dst_opt)}
    planner = MasterParamLoadPlanner()
    dcp.load(sd, checkpoint_id=str(Path(root) / "bf16"), planner=planner)
    set_model_state_dict(dst, sd["model"])
    set_optimizer_state_dict(dst, dst_opt, sd["optim"])
    assert planner.dropped and all(k.endswith(".master_param") for k in planner.dropped), planner.dropped
    for p, q in zip(dst.parameters(), src.parameters(), strict=True):
        assert torch.equal(local(p), local(q))
        assert torch.equal(local(dst_opt.state[p]["master_param"]), local(q).float())
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(local(dst_opt.state[p][key]), local(src_opt.state[q][key]).float()), key
    dst_opt.close()
    return {}


def test_save_deepcopy_and_dcp_interop_under_fsdp2(tmp_path: Path) -> None:
    results = run_workers(_worker, world_size=2, kwargs={"root": str(tmp_path)}, timeout_s=600)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)
