"""Parameters re-bound in ``param_groups`` after construction are the ones stepped (issue 17).

The reference is torch's fused AdamW doing the same swap. torch keys its state by tensor: it
restarts the moments of a swapped parameter unless the caller moves its entry
(``opt.state[new] = opt.state.pop(old)``). CPUOffloadAdamW carries them over by itself for a
one-to-one swap (same group, position, global shape, dtype; ``offload.state._rebind``), so the
reference moves the entry by key; a swap before the first step, or to another shape, starts
fresh in both.
"""

from __future__ import annotations

import pytest
import torch
from _dist_util import run_workers
from conftest import assert_bitwise, batch, make_model, param_groups
from torch import nn

from offload import CPUOffloadAdamW, OffloadSettings

pytestmark = pytest.mark.usefixtures("single_threaded_main")

SWAP = ("fc1.weight", "norm.bias")


def _replace(model: nn.Module, name: str, *, shape: torch.Size | None = None
             ) -> tuple[nn.Parameter, nn.Parameter]:
    """Replace the parameter ``name`` of ``model`` by a new one: (old, new)."""
    mod_name, attr = name.rsplit(".", 1)
    mod = model.get_submodule(mod_name)
    old = getattr(mod, attr)
    new = nn.Parameter(old.detach().clone() if shape is None else torch.randn(shape, dtype=old.dtype))
    setattr(mod, attr, new)
    return old, new


def _swap(model: nn.Module, opt: torch.optim.Optimizer, name: str, *, move_state: bool,
          shape: torch.Size | None = None) -> nn.Parameter:
    """Replace the parameter ``name`` in the model and in ``opt.param_groups`` by a new tensor
    (a clone, or fresh values of ``shape``); ``move_state``: torch's way to keep its state."""
    old, new = _replace(model, name, shape=shape)
    for g in opt.param_groups:
        g["params"] = [new if p is old else p for p in g["params"]]
    if move_state and old in opt.state:
        opt.state[new] = opt.state.pop(old)
    return new


def _train(model, opt, steps, *, swap_at: int, move_state: bool) -> None:
    for step in range(steps):
        if step == swap_at:
            for name in SWAP:
                _swap(model, opt, name, move_state=move_state)
        opt.zero_grad(set_to_none=True)
        model(batch(step)).backward()
        opt.step()


def _compare(model, opt, ref_model, ref) -> None:
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")
    for key in ("exp_avg", "exp_avg_sq", "step"):
        ours = [opt.state[p][key].reshape(p.shape if key != "step" else ()) for p in model.parameters()
                if opt.state.get(p)]
        theirs = [ref.state[p][key] for p in ref_model.parameters() if ref.state.get(p)]
        assert_bitwise(ours, theirs, key)


@pytest.mark.parametrize(("swap_at", "overlap"), [(0, False), (3, False), (3, True)])
def test_a_swapped_parameter_is_stepped_with_its_state_carried_over(swap_at: int, overlap: bool) -> None:
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(param_groups(ref_model), fused=True)
    _train(ref_model, ref, 7, swap_at=swap_at, move_state=True)
    opt = CPUOffloadAdamW(param_groups(model), settings=OffloadSettings(threads=2, chunk_numel=1024),
                          overlap_backward=overlap)
    before = model.fc1.weight.detach().clone()
    _train(model, opt, 7, swap_at=swap_at, move_state=False)
    assert not torch.equal(model.fc1.weight, before)  # the new tensor really trained
    _compare(model, opt, ref_model, ref)
    if swap_at == 3:
        assert int(opt.state[model.fc1.weight]["step"]) == 7  # carried over, not restarted
    assert len(opt.state) == len(ref.state)  # no entry of the replaced tensors is left
    opt.state_dict()  # works (torch's raises KeyError when the old key stays)
    if overlap:  # the new parameters are hooked: their chunks start during backward again
        assert opt.last_stats.speculated_chunks > 0
        assert opt._layout.registry.of(model.fc1.weight).hooks_expected > 0
    opt.close()


def test_a_bf16_swap_keeps_the_fp32_master() -> None:
    """bf16 parameters: the migrated master keeps its extra bits (the clone rounds to it), as
    the mixed-precision reference whose master simply stays with the swapped parameter."""
    from test_optimizer_numerics import MixedPrecisionReference

    ref_model, model = make_model(torch.bfloat16), make_model(torch.bfloat16)
    ref = MixedPrecisionReference(ref_model)
    opt = CPUOffloadAdamW(param_groups(model), settings=OffloadSettings(threads=2, chunk_numel=1024))
    for step in range(6):
        if step == 3:
            for name in SWAP:
                old, new = _replace(ref_model, name)
                ref.params = [new if p is old else p for p in ref.params]
                ref.master[new] = ref.master.pop(old)
                _swap(model, opt, name, move_state=False)
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            m(batch(step)).backward()
            o.step()
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")
    for key in ("exp_avg", "exp_avg_sq"):
        assert_bitwise([opt.state[p][key] for p in model.parameters() if opt.state.get(p)],
                       [ref.state(p)[key] for p in ref_model.parameters() if ref.state(p)], key)
    assert_bitwise([opt.state[p]["master_param"] for p in model.parameters() if opt.state.get(p)],
                   [ref.master[p] for p in ref_model.parameters() if ref.state(p)], "master")
    assert int(opt.state[model.fc1.weight]["step"]) == 6
    opt.close()


def test_a_rebind_after_backward_started_chunks_undoes_them() -> None:
    out = []
    for overlap in (False, True):
        model = make_model()
        opt = CPUOffloadAdamW(param_groups(model), overlap_backward=overlap,
                              settings=OffloadSettings(threads=1, chunk_numel=1024))
        for step in range(2):  # the first backward calibrates, the second starts chunks early
            opt.zero_grad()
            model(batch(step)).backward()
            if step == 0:
                opt.step()
        if overlap:
            assert opt._overlap.has_launched()
        _swap(model, opt, "fc1.weight", move_state=False)
        opt.step()
        out.append((model, opt))
    assert_bitwise(list(out[1][0].parameters()), list(out[0][0].parameters()), "params")
    for _, opt in out:
        opt.close()


def test_the_state_moved_by_key_is_taken_as_torch_does() -> None:
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(param_groups(ref_model), fused=True)
    _train(ref_model, ref, 6, swap_at=2, move_state=True)
    opt = CPUOffloadAdamW(param_groups(model))
    _train(model, opt, 6, swap_at=2, move_state=True)
    _compare(model, opt, ref_model, ref)
    opt.close()


def test_a_swap_to_another_shape_starts_fresh_as_torch_does() -> None:
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(param_groups(ref_model), fused=True)
    opt = CPUOffloadAdamW(param_groups(model))
    for m, o in ((ref_model, ref), (model, opt)):
        for step in range(5):
            if step == 2:
                torch.manual_seed(5)
                _swap(m, o, "sometimes.bias", move_state=False, shape=torch.Size([7]))
            o.zero_grad()
            (m(batch(step)) + m.sometimes.bias.pow(2).sum()).backward()
            o.step()
    assert int(opt.state[model.sometimes.bias]["step"]) == 3  # fresh at the swap
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")
    opt.close()


def test_a_parameter_appended_to_a_group_is_stepped() -> None:
    ref_model, model = make_model(), make_model()
    extra = {}
    for m, o in ((ref_model, torch.optim.AdamW(param_groups(ref_model), fused=True)),
                 (model, CPUOffloadAdamW(param_groups(model)))):
        torch.manual_seed(3)
        extra[m] = nn.Parameter(torch.randn(33))
        for step in range(4):
            if step == 1:
                o.param_groups[1]["params"].append(extra[m])  # in place: same list object
            o.zero_grad()
            (m(batch(step)) + extra[m].pow(2).sum()).backward()
            o.step()
    assert_bitwise([extra[model]], [extra[ref_model]], "appended")
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")


def test_a_bad_rebound_parameter_raises() -> None:
    model = make_model()
    opt = CPUOffloadAdamW(param_groups(model))
    opt.param_groups[0]["params"].append(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        opt.step()
    opt.param_groups[0]["params"][-1] = model.fc1.weight
    with pytest.raises(ValueError, match="twice"):
        opt.zero_grad()
    opt.close()


def _accelerate_swap(model: nn.Module, opt: torch.optim.Optimizer) -> nn.Module:
    """accelerate's FSDP2 preparation: the optimizer was built on the plain parameters; shard
    the model, then point ``param_groups`` at the sharded parameters (by name)."""
    from bench.train._fsdp import shard_model

    old = dict(model.named_parameters())
    shard_model(model)
    new = dict(model.named_parameters())
    mapping = {id(old[n]): new[n] for n in old}
    for g in opt.param_groups:
        g["params"] = [mapping[id(p)] for p in g["params"]]
    return model


def _fsdp_worker(rank: int, world_size: int) -> list[str]:
    from torch.distributed.tensor import distribute_tensor

    from _fsdp_models import Net, assert_same, batch as fsdp_batch, groups, schedule, train

    torch.set_num_threads(1)
    checked = []

    def run(make_opt, *, plain_steps: int, overlap: bool = False, move_state: bool = False):
        model = Net()
        opt = make_opt(groups(model))
        for step in range(plain_steps):  # before sharding: the same batch on every rank
            opt.zero_grad()
            model(*fsdp_batch(0, step)).backward()
            opt.step()
        old = list(model.parameters())
        _accelerate_swap(model, opt)
        if move_state:  # torch's AdamW: its entries must be moved, as DTensors, by hand
            for o, n in zip(old, model.parameters()):
                if o in opt.state:
                    entry = opt.state.pop(o)
                    opt.state[n] = {k: v if k == "step" else distribute_tensor(v, n.device_mesh, n.placements)
                                    for k, v in entry.items()}
        before = [p.to_local().detach().clone() for p in model.parameters()]
        train(model, opt, schedule(opt), rank, range(plain_steps, plain_steps + 4), overlap=overlap)
        changed = [not torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters())
                   if b.numel()]
        assert all(changed), f"rank {rank}: some parameter did not train: {changed}"
        return model, opt

    for plain_steps in (0, 2):
        ref_model, ref = run(lambda g: torch.optim.AdamW(g, lr=1e-3, fused=True),
                             plain_steps=plain_steps, move_state=plain_steps > 0)
        for overlap in (False, True):
            what = f"plain_steps={plain_steps} overlap={overlap}"
            model, opt = run(lambda g: CPUOffloadAdamW(g, lr=1e-3, overlap_backward=overlap,
                                                       settings=OffloadSettings(threads=1)),
                             plain_steps=plain_steps, overlap=overlap)
            assert_same(list(model.parameters()), list(ref_model.parameters()), f"{what} params")
            for key in ("exp_avg", "exp_avg_sq"):
                assert_same([opt.state[p][key] for p in model.parameters()],
                            [ref.state[p][key] for p in ref_model.parameters()], f"{what} {key}")
            assert [int(opt.state[p]["step"]) for p in model.parameters()] == \
                [int(ref.state[p]["step"]) for p in ref_model.parameters()], what
            if overlap:
                assert opt.last_stats.speculated_chunks > 0, f"{what}: the sharded params are not hooked"
            opt.state_dict()
            opt.close()
            checked.append(what)
    return checked


@pytest.mark.slow  # a real client: accelerate prepares an FSDP2 model
def test_accelerate_fsdp2_swap_trains_bitwise_like_torch() -> None:
    """Built on the plain model, the model sharded, param_groups pointed at the DTensors (before
    any step, as accelerate does, and after two: the state sliced to each rank's shard)."""
    results = run_workers(_fsdp_worker, world_size=2, timeout_s=600)
    assert all(r.ok for r in results), [r.describe() for r in results]
    assert len(results[0].value) == 4


def test_a_moved_entry_with_a_foreign_step_gets_a_host_fp32_step() -> None:
    model = make_model()
    opt = CPUOffloadAdamW(param_groups(model))
    for step in range(2):
        opt.zero_grad()
        model(batch(step)).backward()
        opt.step()
    new = _swap(model, opt, "fc1.weight", move_state=True)
    opt.state[new]["step"] = torch.tensor(2.0, dtype=torch.float64)  # not the kernels' layout
    opt.zero_grad()
    model(batch(2)).backward()
    opt.step()
    step = opt.state[new]["step"]
    assert step.dtype == torch.float32 and step.device.type == "cpu" and float(step) == 3.0
    opt.close()
