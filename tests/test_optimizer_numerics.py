"""CPUOffloadAdamW against torch.optim.AdamW(fused=True): bitwise, whatever the settings."""

from __future__ import annotations

import functools
import io

import pytest
import torch
from conftest import assert_bitwise, batch, make_model, param_groups, uses_sometimes

from offload import CPUOffloadAdamW, OffloadSettings
from offload.kernels._adamw import Hyper, fused_adamw_, new_step_tensor
from offload.state._slabs import ParamSlot, plan_chunks

STEPS = 30
pytestmark = pytest.mark.usefixtures("single_threaded_main")


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.07 * s))


def _train(model, opt, sched, steps: range, on_step=None) -> None:
    for step in steps:
        if on_step is not None:
            on_step(step)
        opt.zero_grad(set_to_none=True)
        model(batch(step), use_sometimes=uses_sometimes(step)).backward()
        opt.step()
        sched.step()


class MixedPrecisionReference:
    """fp32 master copies updated by torch.optim.AdamW(fused=True) from the upcast low-precision
    gradient, then cast back into the model: the mixed-precision reference."""

    def __init__(self, model: torch.nn.Module, groups: list[dict] | None = None) -> None:
        """``groups``: the model's parameter groups (default: conftest's ``param_groups``)."""
        self.params = list(model.parameters())
        self.master = {p: p.detach().float().clone().requires_grad_(True) for p in self.params}
        groups = [
            {**g, "params": [self.master[p] for p in g["params"]]}
            for g in (param_groups(model) if groups is None else groups)
        ]
        self.opt = torch.optim.AdamW(groups, fused=True)
        self.param_groups = self.opt.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        for p in self.params:
            self.master[p].grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        with torch.no_grad():
            self.after_step()
            for p in self.params:
                p.copy_(self.master[p])

    def after_step(self) -> None:
        """What a variant does to the fp32 state after the step, before the cast back (nothing)."""

    def state(self, p: torch.Tensor) -> dict:
        return self.opt.state[self.master[p]]


def _state_lists(model, get_state) -> tuple[list, list, list, list]:
    params = [p for p in model.parameters() if get_state(p)]
    return (
        [get_state(p)["exp_avg"] for p in params],
        [get_state(p)["exp_avg_sq"] for p in params],
        [get_state(p)["step"].reshape(()) for p in params],
        params,
    )


@functools.lru_cache(maxsize=None)
def _reference(dtype: torch.dtype, steps: int = STEPS):
    """Trained reference model and its optimizer state (computed once per dtype)."""
    model = make_model(dtype)
    if dtype == torch.float32:
        opt = torch.optim.AdamW(param_groups(model), fused=True)
        get_state = lambda p: opt.state[p]  # noqa: E731
        masters = None
    else:
        opt = MixedPrecisionReference(model)
        get_state = opt.state
        masters = opt.master
    _train(model, opt, _schedule(opt if dtype == torch.float32 else opt.opt), range(steps))
    exp_avg, exp_avg_sq, step, with_state = _state_lists(model, get_state)
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "exp_avg": [t.clone() for t in exp_avg],
        "exp_avg_sq": [t.clone() for t in exp_avg_sq],
        "step": [t.clone() for t in step],
        "with_state": [names[id(p)] for p in with_state],
        "master": None if masters is None else [masters[p].detach().clone() for p in with_state],
    }


def _check_against_reference(model, opt: CPUOffloadAdamW, dtype: torch.dtype) -> None:
    ref = _reference(dtype)
    assert_bitwise(list(model.parameters()), ref["params"], "params")
    exp_avg, exp_avg_sq, step, with_state = _state_lists(model, lambda p: opt.state.get(p))
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)] for p in with_state] == ref["with_state"]
    assert "unused.weight" not in ref["with_state"]  # a parameter that never had a gradient
    assert_bitwise(exp_avg, ref["exp_avg"], "exp_avg")
    assert_bitwise(exp_avg_sq, ref["exp_avg_sq"], "exp_avg_sq")
    assert_bitwise(step, ref["step"], "step")
    if ref["master"] is not None:
        assert_bitwise([opt.state[p]["master_param"] for p in with_state], ref["master"], "master")


def _run(dtype: torch.dtype, settings: OffloadSettings, on_step=None):
    model = make_model(dtype)
    opt = CPUOffloadAdamW(param_groups(model), settings=settings)
    _train(model, opt, _schedule(opt), range(STEPS), on_step=lambda s: on_step(opt, s) if on_step else None)
    return model, opt


@pytest.mark.parametrize("kernel", ["torch", "auto"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("chunk_numel", [1024, 1500, 4096, 1 << 20])
def test_fp32_bitwise_equal_to_torch_fused_adamw(chunk_numel: int, threads: int, kernel: str) -> None:
    """Both kernels ("auto" is the native fp32 entry where it is verified and built)."""
    model, opt = _run(torch.float32, OffloadSettings(threads=threads, chunk_numel=chunk_numel,
                                                     kernel=kernel))  # type: ignore[arg-type]
    if chunk_numel == 1024:
        assert len(opt._layout.chunks) > 10  # chunks really split parameters
    _check_against_reference(model, opt, torch.float32)
    opt.close()


@pytest.mark.parametrize("kernel", ["torch", "auto"])
@pytest.mark.parametrize(
    ("chunk_numel", "threads"), [(1024, 1), (1500, 2), (1 << 20, 2)]
)
def test_bf16_bitwise_equal_to_mixed_precision_reference(chunk_numel: int, threads: int, kernel: str) -> None:
    model, opt = _run(torch.bfloat16, OffloadSettings(threads=threads, chunk_numel=chunk_numel,
                                                      kernel=kernel))  # type: ignore[arg-type]
    _check_against_reference(model, opt, torch.bfloat16)
    opt.close()


def test_fp16_bitwise_equal_to_mixed_precision_reference() -> None:
    model, opt = _run(torch.float16, OffloadSettings(threads=2, chunk_numel=2048))
    _check_against_reference(model, opt, torch.float16)


def test_apply_settings_mid_run_keeps_bitwise_equality() -> None:
    plan = {
        4: OffloadSettings(threads=2, chunk_numel=1024),
        9: OffloadSettings(threads=1, chunk_numel=1 << 20),
        15: OffloadSettings(threads=2, chunk_numel=1500),
        22: OffloadSettings(threads=None, chunk_numel=4096),
    }
    seen = []

    def switch(opt: CPUOffloadAdamW, step: int) -> None:
        if step in plan:
            opt.apply_settings(plan[step])
            seen.append(opt.settings)

    model, opt = _run(torch.float32, OffloadSettings(threads=1, chunk_numel=4096), switch)
    assert [s.chunk_numel for s in seen] == [1024, 1 << 20, 1500, 4096]
    assert seen[-1].threads == opt._planned_threads  # None resolves to the construction plan
    _check_against_reference(model, opt, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_from_state_dict_is_bitwise_equal_to_uninterrupted(dtype: torch.dtype) -> None:
    total, cut = 20, 11
    model_a = make_model(dtype)
    opt_a = CPUOffloadAdamW(param_groups(model_a), settings=OffloadSettings(chunk_numel=1024))
    _train(model_a, opt_a, _schedule(opt_a), range(total))

    model_b = make_model(dtype)
    opt_b = CPUOffloadAdamW(param_groups(model_b), settings=OffloadSettings(chunk_numel=1024))
    sched_b = _schedule(opt_b)
    _train(model_b, opt_b, sched_b, range(cut))
    buf = io.BytesIO()
    torch.save({"model": model_b.state_dict(), "opt": opt_b.state_dict(), "sched": sched_b.state_dict()}, buf)
    opt_b.close()
    del model_b, opt_b, sched_b

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model_c = make_model(dtype, seed=123)  # different init: everything must come from the checkpoint
    model_c.load_state_dict(ckpt["model"])
    opt_c = CPUOffloadAdamW(
        param_groups(model_c), settings=OffloadSettings(threads=2, chunk_numel=1 << 20)
    )
    sched_c = _schedule(opt_c)
    opt_c.load_state_dict(ckpt["opt"])
    sched_c.load_state_dict(ckpt["sched"])
    _train(model_c, opt_c, sched_c, range(cut, total))

    assert_bitwise(list(model_c.parameters()), list(model_a.parameters()), "params")
    for key in ("step", "exp_avg", "exp_avg_sq", "master_param"):
        got = [opt_c.state[p][key] for p in model_c.parameters() if opt_c.state.get(p)]
        want = [opt_a.state[p][key] for p in model_a.parameters() if opt_a.state.get(p)]
        assert_bitwise(got, want, key)


def test_loads_torch_adamw_state_dict_and_continues_bitwise() -> None:
    ref_model = make_model()
    ref = torch.optim.AdamW(param_groups(ref_model), fused=True)
    ref_sched = _schedule(ref)
    _train(ref_model, ref, ref_sched, range(6))

    model = make_model(seed=7)
    model.load_state_dict(ref_model.state_dict())
    opt = CPUOffloadAdamW(param_groups(model), settings=OffloadSettings(chunk_numel=1024))
    sched = _schedule(opt)
    opt.load_state_dict(ref.state_dict())
    sched.load_state_dict(ref_sched.state_dict())
    _train(ref_model, ref, ref_sched, range(6, 12))
    _train(model, opt, sched, range(6, 12))
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")


def _updated_in_views(starts: list[int], n: int = 4099, steps: int = 3) -> list[torch.Tensor]:
    """A parameter of ``n`` elements and its moments after ``steps`` AdamW updates by torch's fused
    CPU kernel, each update run over the views ``[starts[i], starts[i + 1])`` (the last ending at
    ``n``)."""
    g = torch.Generator().manual_seed(0)
    p, m, v = (torch.randn(n, generator=g) for _ in range(3))
    v = v.abs()
    step = new_step_tensor()
    bounds = [*starts, n]
    hyper = Hyper(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)
    for k in range(steps):
        grad = torch.randn(n, generator=g)
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            fused_adamw_([p[a:b]], [grad[a:b]], [m[a:b]], [v[a:b]], [step],
                         steps_to_increment=[step] if i == 0 else [], hyper=hyper)
    return [p, m, v]


def test_misaligned_chunks_would_break_bitwise_equality() -> None:
    """Guards the chunking rule of offload.state._slabs (``plan_chunks`` starts every view of a
    parameter at a multiple of its ``align``): views starting at unaligned offsets inside a
    parameter take the fused kernel's scalar-tail path for different elements. Split at aligned
    offsets the update is bitwise the whole-tensor update; split at 1029 and 2058 it is not."""
    whole = _updated_in_views([0])
    assert all(map(torch.equal, _updated_in_views([0, 1024, 2048]), whole))
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        # The vector body (fused multiply-adds) and the scalar tail differ only in a vector build;
        # under ATEN_CPU_CAPABILITY=default both are plain multiplies and adds, equal bits.
        assert not all(map(torch.equal, _updated_in_views([0, 1029, 2058]), whole))
    chunks = plan_chunks([ParamSlot(index=0, group=0, offset=0, numel=4099, shape=torch.Size([4099]))], 1029, align=1)
    assert [v.start for c in chunks for v in c.views] == [0, 1029, 2058, 3087]  # align=1: anywhere


def test_tensor_lr_bitwise_equal_to_torch_fused_adamw() -> None:
    """lr given as a tensor (and scheduled in place) is passed to the kernel like torch does."""
    models = [make_model(), make_model()]
    ref = torch.optim.AdamW(models[0].parameters(), lr=torch.tensor(2e-3), fused=True)
    opt = CPUOffloadAdamW(models[1].parameters(), lr=torch.tensor(2e-3),
                          settings=OffloadSettings(chunk_numel=1024))
    for model, o in zip(models, (ref, opt)):
        _train(model, o, _schedule(o), range(6))
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert_bitwise(list(models[1].parameters()), list(models[0].parameters()), "params")


def _strided_grads(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Gradients torch's AdamW takes that are not contiguous: expanded from one value (stride 0,
    ``p.grad = torch.ones(1).expand_as(p)``), an expanded row over a parameter that spans chunks
    (strides (0, 1)), and a transposed one (dense, not contiguous)."""
    g = torch.Generator().manual_seed(step)
    return [torch.randn(1, generator=g).to(dtype).expand(37, 5),
            torch.randn(1, 9, generator=g).to(dtype).expand(700, 9),
            torch.randn(700, 9, generator=g).to(dtype).t()]


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
@pytest.mark.parametrize("kernel", ["torch", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expanded_and_transposed_gradients_bitwise_equal_to_torch(dtype: torch.dtype, kernel: str,
                                                                   overlap: bool) -> None:
    """A stride-0 gradient failed in the native kernel ("grads[1] is not contiguous") and gave
    NaN through torch's kernel; each kernel now reads a dense copy of its slice. The reference is
    torch's fused AdamW on dense copies: on a non-contiguous gradient torch 2.13's fused CPU kernel
    reads the memory as if contiguous (NaN where expanded, permuted where transposed), while its
    foreach and for-loop AdamW read the values. With overlap, a hook registered before the
    optimizer's sets the gradients during backward, so early chunks read them too (and commit)."""
    torch.manual_seed(0)
    shapes = [(37, 5), (700, 9), (9, 700)]
    params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
    ref_params = [p.detach().float().clone().requires_grad_(True) for p in params]
    step_now = [0]
    for i, p in enumerate(params):  # runs before the optimizer's own hook (registered later)
        p.register_post_accumulate_grad_hook(
            lambda q, i=i: setattr(q, "grad", _strided_grads(step_now[0], dtype)[i]))
    opt = CPUOffloadAdamW(params, lr=1e-2, weight_decay=0.1, overlap_backward=overlap,
                          settings=OffloadSettings(chunk_numel=1024, kernel=kernel))  # type: ignore[arg-type]
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(4):
        step_now[0] = step
        sum((p.float() * 1.5).sum() for p in params).backward()
        assert params[0].grad.stride() == (0, 0) and not params[2].grad.is_contiguous()
        opt.step()
        opt.zero_grad()
        for q, g in zip(ref_params, _strided_grads(step, dtype)):
            q.grad = g.float().contiguous()  # bf16: the mixed-precision reference
        ref.step()
        if overlap and step > 0:
            assert opt.last_stats.committed_chunks > 0, opt.last_stats
        expected = [q.detach().to(dtype) for q in ref_params]
        assert_bitwise(list(params), expected, f"{dtype} kernel={kernel} overlap={overlap} step {step}")
    for p, q in zip(params, ref_params):
        assert_bitwise([opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]],
                       [ref.state[q]["exp_avg"], ref.state[q]["exp_avg_sq"]], "moments")
    opt.close()


class _Reads(torch.overrides.TorchFunctionMode):
    """Counts torch calls on this thread that take ``target`` (by identity) as an argument."""

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__()
        self.target, self.count = target, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(a is self.target for a in args):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
def test_tensor_lr_is_read_once_per_group_and_step_not_per_chunk(overlap: bool) -> None:
    """A tensor lr is copied to the host by the step once per param group, not once per chunk:
    on a CUDA lr every such read is a host-device sync (issue 24). Counted on a CPU lr, whose
    reads go through the same path; bitwise torch's fused AdamW as before."""
    models = [make_model(), make_model()]
    lr = torch.tensor(2e-3)
    ref = torch.optim.AdamW(models[0].parameters(), lr=torch.tensor(2e-3), fused=True)
    opt = CPUOffloadAdamW(models[1].parameters(), lr=lr, overlap_backward=overlap,
                          settings=OffloadSettings(chunk_numel=1024))
    for step in range(3):
        for model, o in ((models[0], ref), (models[1], opt)):
            o.zero_grad(set_to_none=True)
            model(batch(step)).backward()
            if o is opt:
                reads = _Reads(opt.param_groups[0]["lr"])
                with reads:
                    o.step()
            else:
                o.step()
    assert opt.last_stats.num_chunks > 3  # several chunks, one group
    # the step's hyper-parameters (one read), and with overlap the pause check when nothing
    # started early (the first step) or the verdicts' comparison (once per group)
    assert reads.count <= 2, reads.count
    assert_bitwise(list(models[1].parameters()), list(models[0].parameters()), "params")
    opt.close()
