"""CPU fp32 parameters that are their own masters (no master slab place) next to parameters
with a real master, at their seams with weight edits, dtype changes, state dicts, added groups,
settings switches and the cached per-chunk Items; every case against torch's AdamW (or the
mixed-precision reference) bitwise."""

from __future__ import annotations

import io

import pytest
import torch
from conftest import assert_bitwise, batch, make_model, param_groups, uses_sometimes
from test_optimizer_numerics import MixedPrecisionReference
from test_weight_edits import _EditAwareReference

from offload import CPUOffloadAdamW, OffloadSettings

pytestmark = pytest.mark.usefixtures("single_threaded_main")

SMALL = OffloadSettings(threads=2, chunk_numel=1024)


def _train(model, opt, steps, *, set_to_none: bool = True) -> None:
    for step in steps:
        opt.zero_grad(set_to_none=set_to_none)
        model(batch(step), use_sometimes=uses_sometimes(step)).backward()
        opt.step()


def _with_state(model, opt):
    return [p for p in model.parameters() if opt.state.get(p)]


# ---------------------------------------------------------------- .data of another dtype
@pytest.mark.parametrize("kernel", ["torch", "fused-mp"])
def test_fp32_model_cast_to_bf16_mid_training_continues_mixed_precision(kernel: str) -> None:
    """``model.to(torch.bfloat16)`` between steps replaces every ``.data`` by a bf16 tensor: an
    own-master parameter gets a master seeded from its fp32 weights and training goes on in mixed
    precision (it used to hand the bf16 parameter to the kernel as its master and raise mid-step,
    after other chunks had advanced)."""
    ref_model, model = make_model(), make_model()
    ref = _EditAwareReference(ref_model)
    opt = CPUOffloadAdamW(param_groups(model), settings=OffloadSettings(threads=2, chunk_numel=1024,
                                                                        kernel=kernel))
    _train(ref_model, ref, range(4))
    _train(model, opt, range(4))
    for m in (ref_model, model):
        m.to(torch.bfloat16)
    ref.follow_edits()
    _train(ref_model, ref, range(4, 8))
    _train(model, opt, range(4, 8))
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")
    opt.close()


def test_bf16_model_cast_to_fp32_mid_training() -> None:
    """The other direction (a slot with a real master gets an fp32 parameter): the master follows."""
    ref_model, model = make_model(torch.bfloat16), make_model(torch.bfloat16)
    ref = _EditAwareReference(ref_model)
    opt = CPUOffloadAdamW(param_groups(model), settings=SMALL)
    _train(ref_model, ref, range(4))
    _train(model, opt, range(4))
    for m in (ref_model, model):
        m.float()
    ref.follow_edits()
    _train(ref_model, ref, range(4, 8))
    _train(model, opt, range(4, 8))
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")
    opt.close()


# ---------------------------------------------------------------- state_dict after an edit
def _replace_data(m) -> None:
    m.fc1.weight.data = m.fc1.weight.data * 0.5


def _load_weights(m) -> None:
    m.load_state_dict(make_model(seed=5).state_dict())


@pytest.mark.parametrize("edit", ["data", "load_state_dict"])
@pytest.mark.parametrize("save_overlap", [False, True], ids=["own-master", "real-master"])
def test_state_dict_right_after_an_edit_saves_the_edited_master(save_overlap: bool, edit: str) -> None:
    """Weights edited after the last step, then a checkpoint: an fp32 model saves no
    ``master_param`` (the weight is the master, torch AdamW's keys), so an optimizer resumed from
    it with a real master (overlap_backward=True, or CUDA) starts from the edit, as torch's AdamW
    does (``load_state_dict`` records no stamp: a stale saved master would silently win)."""
    edit_fn = _replace_data if edit == "data" else _load_weights
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(param_groups(ref_model), fused=True)
    opt = CPUOffloadAdamW(param_groups(model), settings=SMALL, overlap_backward=save_overlap)
    _train(ref_model, ref, range(3))
    _train(model, opt, range(3))
    for m in (ref_model, model):
        edit_fn(m)
    sd = opt.state_dict()
    slot = opt._layout.registry.of(model.fc1.weight).slot
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": sd}, buf)
    opt.close()
    buf.seek(0)
    ck = torch.load(buf)
    resumed = make_model(seed=7)
    resumed.load_state_dict(ck["model"])
    ropt = CPUOffloadAdamW(param_groups(resumed), settings=SMALL, overlap_backward=True)
    ropt.load_state_dict(ck["optim"])
    _train(ref_model, ref, range(3, 6))
    _train(resumed, ropt, range(3, 6))
    ropt.close()
    assert set(ck["optim"]["state"][slot]) == {"step", "exp_avg", "exp_avg_sq"}, \
        "an fp32 model's checkpoint has torch AdamW's keys only"
    assert_bitwise(list(resumed.parameters()), list(ref_model.parameters()), "resumed params")


@pytest.mark.parametrize(("save_overlap", "load_overlap"), [(True, False), (False, True)])
def test_checkpoint_between_real_and_own_masters(save_overlap: bool, load_overlap: bool) -> None:
    """A checkpoint saved with a real master (overlap_backward=True) resumes in an own-master
    optimizer and vice versa (optimizer loaded first, then the model), bitwise torch's run."""
    ref_model = make_model()
    ref = torch.optim.AdamW(param_groups(ref_model), fused=True)
    _train(ref_model, ref, range(5))
    model = make_model()
    opt = CPUOffloadAdamW(param_groups(model), settings=SMALL, overlap_backward=save_overlap)
    _train(model, opt, range(5))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    opt.close()
    buf.seek(0)
    ck = torch.load(buf)
    resumed = make_model(seed=3)
    ropt = CPUOffloadAdamW(param_groups(resumed), settings=SMALL, overlap_backward=load_overlap)
    _train(resumed, ropt, range(2))  # state of its own first, overwritten by the load
    ropt.load_state_dict(ck["optim"])
    resumed.load_state_dict(ck["model"])
    _train(ref_model, ref, range(5, 10))
    _train(resumed, ropt, range(5, 10))
    assert_bitwise(list(resumed.parameters()), list(ref_model.parameters()), "params")
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert_bitwise([ropt.state[p][key] for p in _with_state(resumed, ropt)],
                       [ref.state[p][key] for p in _with_state(ref_model, ref)], key)
    ropt.close()


# ---------------------------------------------------------------- mixed models, settings switches
class _Mixed(torch.nn.Module):
    """fp32 (own masters on the CPU) and bf16 parameters in one group; two get gradients only
    on some steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(3000))
        self.b = torch.nn.Parameter(torch.randn(770, 5).bfloat16())
        self.c = torch.nn.Parameter(torch.randn(130))
        self.d = torch.nn.Parameter(torch.randn(2000).bfloat16())
        self.e = torch.nn.Parameter(torch.randn(65))

    def forward(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(step)
        x = [torch.randn(p.shape, generator=g) for p in (self.a, self.b, self.c, self.d, self.e)]
        loss = (self.a * x[0]).pow(2).sum() + (self.b.float() * x[1]).sin().sum()
        loss = loss + (self.c * x[2]).cos().sum()
        if step % 3 != 1:
            loss = loss + (self.d.float() * x[3]).pow(2).sum()
        if step % 2:
            loss = loss + (self.e * x[4]).sum()
        return loss

    def groups(self) -> list[dict]:
        return [{"params": [self.a, self.b, self.c], "lr": 3e-3, "weight_decay": 0.1},
                {"params": [self.d, self.e], "lr": 1e-3, "weight_decay": 0.0}]


class _MixedReference(MixedPrecisionReference):
    def __init__(self, model: _Mixed) -> None:
        self.params = list(model.parameters())
        self.master = {p: p.detach().float().clone().requires_grad_(True) for p in self.params}
        self.opt = torch.optim.AdamW([{**g, "params": [self.master[p] for p in g["params"]]}
                                      for g in model.groups()], fused=True)
        self.param_groups = self.opt.param_groups


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_fp32_bf16_with_kernel_and_chunk_switches(overlap: bool, set_to_none: bool) -> None:
    settings = [OffloadSettings(threads=1, chunk_numel=1024, kernel="torch"),
                OffloadSettings(threads=2, chunk_numel=1024, kernel="fused-mp"),
                OffloadSettings(threads=2, chunk_numel=1088, kernel="fused-mp"),
                OffloadSettings(threads=1, chunk_numel=4096, kernel="torch")]
    ref_model, model = _Mixed(), _Mixed()
    ref = _MixedReference(ref_model)
    opt = CPUOffloadAdamW(model.groups(), settings=settings[0], overlap_backward=overlap)
    own = [s.own_master for s in opt._layout.slabs.slots]
    assert own == [True, False, True, False, True]  # with overlap too: early chunks write a scratch master
    for step in range(16):
        opt.apply_settings(settings[step % 4])
        for m, o in ((ref_model, ref), (model, opt)):
            if set_to_none:
                o.zero_grad(set_to_none=True)
            else:
                for p in m.parameters():
                    if p.grad is not None:
                        p.grad.zero_()
            m(step).backward()
            o.step()
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert_bitwise([opt.state[p][key] for p in model.parameters()],
                       [ref.state(p)[key] for p in ref_model.parameters()], key)
    opt.close()


def test_bf16_group_added_to_an_own_master_optimizer() -> None:
    """add_param_group of bf16 parameters into an optimizer of own-master fp32 ones (and the
    reverse order of kinds in the slabs), mid-training."""
    ref_model, model = _Mixed(), _Mixed()
    ref_groups, groups = ref_model.groups(), model.groups()
    ref = _MixedReference(ref_model)
    ref.opt = torch.optim.AdamW([{**ref_groups[0], "params": [ref.master[p] for p in ref_groups[0]["params"]]}],
                                fused=True)
    opt = CPUOffloadAdamW([groups[0]], settings=SMALL)
    for m in (ref_model, model):
        m.d.requires_grad_(False)
        m.e.requires_grad_(False)
    for step in range(10):
        if step == 4:
            for m in (ref_model, model):
                m.d.requires_grad_(True)
                m.e.requires_grad_(True)
            ref.opt.add_param_group({**ref_groups[1], "params": [ref.master[p] for p in ref_groups[1]["params"]]})
            opt.add_param_group(groups[1])
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad(set_to_none=True)
            m(step).backward()
            o.step()
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")
    opt.close()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_own_master_edits_with_settings_switches(set_to_none: bool) -> None:
    """Own masters (fp32 on the CPU) with every edit kind while the kernel and chunk size change
    between steps (the cached Item templates and prepared calls are remade or reused across both),
    parameters with a gradient on some steps only: bitwise torch's AdamW."""
    from test_weight_edits import EDITS

    settings = [OffloadSettings(threads=2, chunk_numel=1024, kernel="fused-mp"),
                OffloadSettings(threads=1, chunk_numel=1024, kernel="torch"),
                OffloadSettings(threads=2, chunk_numel=2048, kernel="fused-mp"),
                OffloadSettings(threads=2, chunk_numel=2048, kernel="torch")]
    edits = {2: EDITS["data"], 5: EDITS["clamp"], 7: EDITS["load_state_dict"], 10: EDITS["data"]}
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(param_groups(ref_model), fused=True)
    opt = CPUOffloadAdamW(param_groups(model), settings=settings[0])
    assert all(s.own_master for s in opt._layout.slabs.slots)
    for step in range(13):
        opt.apply_settings(settings[step % 4])
        for m in (ref_model, model):
            if step in edits:
                edits[step](m)
        _train(ref_model, ref, [step], set_to_none=set_to_none)
        _train(model, opt, [step], set_to_none=set_to_none)
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert_bitwise([opt.state[p][key] for p in _with_state(model, opt)],
                       [ref.state[p][key] for p in _with_state(ref_model, ref)], key)
    assert_bitwise([opt.state[p]["master_param"] for p in _with_state(model, opt)],
                   _with_state(model, opt), "master is the parameter")
    opt.close()


def test_bf16_checkpoint_resumed_in_fp32_keeps_the_fp32_master() -> None:
    """A bf16 run's checkpoint (fp32 ``master_param`` with bits the bf16 weights lack) resumed on
    the CPU in fp32 (``model.float()``, where parameters are their own masters): the loaded master
    is kept, in either load order (the parameter gets a master place)."""
    model = make_model(torch.bfloat16)
    opt = CPUOffloadAdamW(param_groups(model), settings=SMALL)
    _train(model, opt, range(4))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    opt.close()
    for optimizer_first in (True, False):
        buf.seek(0)
        ck = torch.load(buf)
        resumed = make_model(seed=3)  # fp32
        ropt = CPUOffloadAdamW(param_groups(resumed), settings=SMALL)
        if optimizer_first:
            ropt.load_state_dict(ck["optim"])
            resumed.load_state_dict(ck["model"])
        else:
            resumed.load_state_dict(ck["model"])
            ropt.load_state_dict(ck["optim"])
        saved = [ck["optim"]["state"][i]["master_param"] for i in sorted(ck["optim"]["state"])]
        params = [ropt._layout.registry[i].param for i in sorted(ck["optim"]["state"])]  # param_groups order
        assert any(not torch.equal(m, p.detach()) for m, p in zip(saved, params))  # extra bits
        assert_bitwise([ropt.state[p]["master_param"] for p in params], saved,
                       f"master after load (optimizer first: {optimizer_first})")
        ropt.close()


def test_state_step_tensor_replaced_between_steps_is_used() -> None:
    """``opt.state[p]["step"] = torch.tensor(0.)`` (a restart of the bias correction, as torch's
    AdamW honours it) is used by the next step, though the chunk's Items were cached with the old
    step tensor."""
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(param_groups(ref_model), fused=True)
    opt = CPUOffloadAdamW(param_groups(model), settings=SMALL)
    _train(ref_model, ref, range(4))
    _train(model, opt, range(4))
    for m, o in ((ref_model, ref), (model, opt)):
        for p in m.parameters():
            if o.state.get(p):
                o.state[p]["step"] = torch.tensor(0.0)
    _train(ref_model, ref, range(4, 7))
    _train(model, opt, range(4, 7))
    assert_bitwise([opt.state[p]["step"] for p in _with_state(model, opt)],
                   [ref.state[p]["step"] for p in _with_state(ref_model, ref)], "step")
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")
    opt.close()


def test_optimizer_loaded_before_the_model_is_its_own_master_again_after_a_step() -> None:
    """An fp32 CPU checkpoint with ``master_param`` (saved before state dicts had torch AdamW's
    keys only) loaded optimizer first: the loaded masters differ from the fresh weights, so those
    parameters get a master place; once the model is loaded they equal it, and the next step
    gives the place back (host state returns to the two moments), bitwise as torch."""
    model = make_model()
    opt = CPUOffloadAdamW(param_groups(model), settings=SMALL)
    ref_model = make_model()
    ref = torch.optim.AdamW(param_groups(ref_model), fused=True)
    _train(model, opt, range(3))
    _train(ref_model, ref, range(3))
    slab_bytes = opt._layout.slabs.nbytes
    buf = io.BytesIO()
    sd = opt.state_dict()
    names = {id(p): n for n, p in model.named_parameters()}
    for i, entry in sd["state"].items():  # the older layout
        entry["master_param"] = model.state_dict()[names[id(opt._layout.registry[i].param)]]
    torch.save({"model": model.state_dict(), "optim": sd}, buf)
    opt.close()
    buf.seek(0)
    ck = torch.load(buf)
    resumed = make_model(seed=3)
    ropt = CPUOffloadAdamW(param_groups(resumed), settings=SMALL)
    ropt.load_state_dict(ck["optim"])
    held = [i for i in sorted(ck["optim"]["state"])]
    assert not any(ropt._layout.slabs.slots[i].own_master for i in held)  # masters kept for now
    assert_bitwise([ropt.state[ropt._layout.registry[i].param]["master_param"] for i in held],
                   [ck["optim"]["state"][i]["master_param"] for i in held], "loaded masters")
    resumed.load_state_dict(ck["model"])
    _train(resumed, ropt, range(3, 6))
    _train(ref_model, ref, range(3, 6))
    assert all(ropt._layout.slabs.slots[i].own_master for i in held)
    assert ropt._layout.slabs.nbytes == slab_bytes
    assert_bitwise(list(resumed.parameters()), list(ref_model.parameters()), "params")
    ropt.close()
