"""Own masters and cached Items under FSDP2: a DTensor parameter given a new local tensor
(``load_state_dict(assign=True)`` with ``torch.__future__.set_swap_module_params_on_conversion(True)``:
same parameter object, new ``_local_tensor``; FSDP2's post-load hook re-pads it) is written by
the next step (the prepared kernel calls are made again), and DCP checkpoints move between
optimizers with real and own masters."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _dist_util import run_workers

pytestmark = pytest.mark.slow


def _train(pairs, rank: int, steps: range) -> None:
    """Steps of each (model, optimizer) pair on the same batches."""
    from _fsdp_models import batch

    for step in steps:
        for m, o in pairs:
            m(*batch(rank, step)).backward()
            o.step()
            o.zero_grad(set_to_none=True)


def _swap_load(models, other: torch.nn.Module) -> None:
    """Load ``other``'s weights into each model by swapping the parameters' contents (the
    parameter objects stay, their local tensors are new)."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for m in models:
            m.load_state_dict({k: v.detach().clone() for k, v in other.state_dict().items()}, assign=True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def _swap_load_worker(rank: int, world_size: int, kernel: str) -> dict[str, Any]:
    from _fsdp_models import ShardMixedPrecisionReference, assert_same, groups, sharded
    from offload import CPUOffloadAdamW, OffloadSettings
    from offload.state._dtensor import local

    torch.set_num_threads(1)
    model, ref = sharded(torch.bfloat16), sharded(torch.bfloat16)
    mp_ref = ShardMixedPrecisionReference(ref)
    opt = CPUOffloadAdamW(groups(model), lr=1e-3,
                          settings=OffloadSettings(threads=1, chunk_numel=1024, kernel=kernel))
    if kernel == "fused-mp" and opt.settings.kernel != "fused-mp":
        return {"skipped": "fused-mp unavailable"}

    pairs = ((model, opt), (ref, mp_ref))
    _train(pairs, rank, range(3))
    # New weights, loaded by swapping the parameters' contents (the parameter objects stay).
    other = sharded(torch.bfloat16)
    with torch.no_grad():
        for p in other.parameters():
            local(p).mul_(0.5).add_(0.01)
    ids = [id(p) for p in model.parameters()]
    old_locals = [local(p) for p in model.parameters()]
    _swap_load((model, ref), other)
    assert [id(p) for p in model.parameters()] == ids  # same parameter objects...
    replaced = sum(local(p) is not o for p, o in zip(model.parameters(), old_locals))
    assert replaced > 0  # ... with new local tensors
    # The reference's masters follow the loaded weights (the documented bf16 rule).
    with torch.no_grad():
        for p in ref.parameters():
            master, w = mp_ref.master[p], local(p)
            master.copy_(torch.where(master.to(w.dtype) == w, master, w.float()))
    _train(pairs, rank, range(3, 6))
    assert_same(list(model.parameters()), list(ref.parameters()), f"{kernel} params after swap-load")
    opt.close()
    return {"replaced": replaced}


@pytest.mark.parametrize("kernel", ["torch", "fused-mp"])
def test_fsdp2_bf16_swap_load_new_local_tensors_are_written(kernel: str) -> None:
    results = run_workers(_swap_load_worker, world_size=2, kwargs={"kernel": kernel}, timeout_s=400)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)


def _swap_load_fp32_worker(rank: int, world_size: int) -> dict[str, Any]:
    """fp32 shards (own masters): the new local tensors are written, as torch AdamW writes them."""
    from _fsdp_models import assert_same, groups, sharded
    from offload import CPUOffloadAdamW, OffloadSettings
    from offload.state._dtensor import local

    torch.set_num_threads(1)
    model, ref = sharded(), sharded()
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-3, fused=True)
    opt = CPUOffloadAdamW(groups(model), lr=1e-3, settings=OffloadSettings(threads=1, chunk_numel=1024))
    assert all(s.own_master for s in opt._layout.slabs.slots)

    pairs = ((model, opt), (ref, ref_opt))
    _train(pairs, rank, range(3))
    other = sharded()
    with torch.no_grad():
        for p in other.parameters():
            local(p).mul_(0.5).add_(0.01)
    _swap_load((model, ref), other)
    _train(pairs, rank, range(3, 6))
    assert_same(list(model.parameters()), list(ref.parameters()), "fp32 params after swap-load")
    opt.close()
    return {}


def test_fsdp2_fp32_own_master_swap_load() -> None:
    results = run_workers(_swap_load_fp32_worker, world_size=2, timeout_s=400)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)


def _dcp_cross_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """DCP checkpoints between an optimizer with real masters (overlap_backward=True) and one
    whose fp32 shards are their own masters, both ways, against torch AdamW's checkpoint."""
    from pathlib import Path

    from _fsdp_models import assert_same, groups, sharded
    from _fsdp_models import train_plain as _train
    from test_fsdp2_checkpoint import _load, _save, _state
    from offload import CPUOffloadAdamW, OffloadSettings

    torch.set_num_threads(1)

    def make(kind: str):
        model = sharded()
        if kind == "torch":
            return model, torch.optim.AdamW(groups(model), lr=1e-3, fused=True)
        return model, CPUOffloadAdamW(groups(model), lr=1e-3, overlap_backward=kind == "real",
                                      settings=OffloadSettings(threads=1, chunk_numel=1024))

    for kind in ("torch", "real", "own"):
        model, opt = make(kind)
        _train(model, opt, rank, range(4))
        _save(model, opt, Path(root) / kind)
        if kind != "torch":
            opt.close()
    ref, ref_opt = make("torch")
    _load(ref, ref_opt, Path(root) / "torch")
    _train(ref, ref_opt, rank, range(4, 7))
    for saved, loaded in (("real", "own"), ("own", "real")):
        model, opt = make(loaded)
        _train(model, opt, rank, range(2))  # some state of its own, replaced by the load
        _load(model, opt, Path(root) / saved)
        _train(model, opt, rank, range(4, 7))
        assert_same(_state(model, opt), _state(ref, ref_opt), f"{saved} -> {loaded}")
        opt.close()
    return {}


def test_fsdp2_dcp_between_real_and_own_masters(tmp_path) -> None:
    results = run_workers(_dcp_cross_worker, world_size=2, kwargs={"root": str(tmp_path)}, timeout_s=500)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)
