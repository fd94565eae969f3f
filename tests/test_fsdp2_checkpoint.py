"""CPUOffloadAdamW of an FSDP2 model through ``torch.distributed.checkpoint``: real gloo ranks.

Saved on 2 ranks: the run resumes bitwise on 2 ranks (fp32 and a bf16 model, whose fp32 master
must survive), and loads on 3 and on 1 rank, where the optimizer state equals what torch AdamW's
state of the identical model becomes after the same save and load (and both continue equal).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from _dist_util import run_workers
from _fsdp_models import make_pair, train_plain

pytestmark = pytest.mark.slow

SAVED_STEPS = 4
MORE_STEPS = 3


def _save(model: Any, opt: Any, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(path))


def _load(model: Any, opt: Any, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=str(path))
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])


def _state(model: Any, opt: Any) -> list[torch.Tensor]:
    from offload.state._dtensor import local

    out = [local(p).detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [local(opt.state[p][k]).detach().clone() for k in ("exp_avg", "exp_avg_sq", "step")]
    return out


def _save_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from _fsdp_models import assert_same
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    saved = []
    for kind in ("torch", "ours", "ours-bf16"):
        model, opt = make_pair(kind)
        train_plain(model, opt, rank, range(SAVED_STEPS))
        if kind != "torch":
            entry = next(iter(opt.state_dict()["state"].values()))
            names = ("exp_avg", "exp_avg_sq") + (("master_param",) if kind == "ours-bf16" else ())
            assert ("master_param" in entry) == (kind == "ours-bf16"), sorted(entry)
            assert all(isinstance(entry[n], DTensor) for n in names), {n: type(entry[n]) for n in names}
        _save(model, opt, Path(root) / kind)
        saved.append(kind)
        if kind == "torch":
            continue
        # Resume on the same world size: bitwise the uninterrupted run.
        train_plain(model, opt, rank, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
        resumed, ropt = make_pair(kind)
        _load(resumed, ropt, Path(root) / kind)
        train_plain(resumed, ropt, rank, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
        assert_same(_state(resumed, ropt), _state(model, opt), f"{kind} resumed")
        if kind == "ours-bf16":
            assert_same([ropt.state[p]["master_param"] for p in resumed.parameters()],
                        [opt.state[p]["master_param"] for p in model.parameters()], "bf16 master")
        opt.close()
        ropt.close()
    return {"saved": saved}


def _load_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from _fsdp_models import assert_same

    torch.set_num_threads(1)
    ours, opt = make_pair("ours")
    ref, ref_opt = make_pair("torch")
    _load(ours, opt, Path(root) / "ours")
    _load(ref, ref_opt, Path(root) / "torch")
    assert_same(_state(ours, opt), _state(ref, ref_opt), f"loaded on {world_size}")
    # ... and it is the saved state, not two fresh ones: step 4, moments non-zero where held.
    for p in ours.parameters():
        assert float(opt.state[p]["step"]) == SAVED_STEPS, float(opt.state[p]["step"])
    assert all(bool(opt.state[p]["exp_avg_sq"].ne(0).any())
               for p in ours.parameters() if p.to_local().numel()), "loaded moments are zero"
    train_plain(ours, opt, rank, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
    train_plain(ref, ref_opt, rank, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
    assert_same(_state(ours, opt), _state(ref, ref_opt), f"continued on {world_size}")
    opt.close()
    return {"numel": sum(p.to_local().numel() for p in ours.parameters())}


def test_dcp_resume_and_reshard_2_to_3_and_1(tmp_path: Path) -> None:
    results = run_workers(_save_worker, world_size=2, kwargs={"root": str(tmp_path)}, timeout_s=600)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)
    for world_size in (3, 1):
        results = run_workers(_load_worker, world_size=world_size, kwargs={"root": str(tmp_path)},
                              timeout_s=600)
        assert all(r.ok for r in results), "\n".join(r.describe() for r in results)
        assert sum(r.value["numel"] for r in results) == sum(p.numel() for p in _full_model().parameters())


def _full_model() -> torch.nn.Module:
    from _fsdp_models import Net

    return Net()
