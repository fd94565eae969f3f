"""Every kernel of KernelSet honours Hyper.grad_coef / grad_scale / found_inf bitwise.

The reference is torch alone: the clipping coefficient as ``torch._foreach_mul_(grads, coef)`` on a
copy of the gradients in their own dtype, then ``torch._fused_adamw_`` on the upcast copy; the
scale as ``torch._fused_adamw_(grad_scale=)``; both as ``(g / s) * c`` in fp32, rounded once to the
gradient's dtype (the order ``offload.kernels._adamw`` documents). NaN elements compare equal whatever
their payload (torch's own vector and scalar paths give different NaN payloads).
"""

from __future__ import annotations

import pytest
import torch

from offload.testing import KernelSet
from offload.kernels._adamw import (
    Hyper,
    fused_adamw_,
    mixed_precision_adamw_,
    native_adamw_f32_,
)

LR, BETA1, BETA2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01
# Around the vector width, the 8-element tail block and the 64-element unit; one large enough to
# be split across threads.
SIZES = (1, 7, 17, 33, 65, 1000, 66_001)
MODES = ("coef", "scale", "both")


def _grads(dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """Gradients over many decades (scaled as GradScaler scales them), plus one tensor of special
    values: +-0, subnormals of every dtype, the largest finite values, infinities and NaN."""
    out = [(torch.randn(n, generator=gen) * 10 ** (6 * torch.rand(n, generator=gen) - 4) * 4096)
           .to(dtype) for n in SIZES]
    info = torch.finfo(dtype)
    special = [0.0, -0.0, info.tiny, -info.tiny / 4, info.tiny / 1024, 1e-40, -1e-45, info.max,
               -info.max, float("inf"), float("-inf"), float("nan"), 1.0, 3.0, 65504.0, 1e30]
    out.append(torch.tensor(special * 3, dtype=torch.float32).to(dtype))
    return out


def _state(grads: list[torch.Tensor], gen: torch.Generator):
    masters = [torch.randn(g.numel(), generator=gen) for g in grads]
    exp_avgs = [0.1 * torch.randn(g.numel(), generator=gen) for g in grads]
    exp_avg_sqs = [0.01 * torch.rand(g.numel(), generator=gen) for g in grads]
    return masters, exp_avgs, exp_avg_sqs


def _transform(mode: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    coef = torch.tensor(0.3712, dtype=torch.float32) if mode != "scale" else None
    scale = torch.tensor(3 * 2.0**12, dtype=torch.float32) if mode != "coef" else None
    return coef, scale


def _hyper(coef=None, scale=None, found_inf=None) -> Hyper:
    return Hyper(lr=LR, beta1=BETA1, beta2=BETA2, weight_decay=WD, eps=EPS, grad_coef=coef,
                 grad_scale=scale, found_inf=found_inf)


def _reference(masters, exp_avgs, exp_avg_sqs, grads, step: float, coef, scale):
    """torch ops only; returns the updated (masters, exp_avgs, exp_avg_sqs)."""
    masters, exp_avgs, exp_avg_sqs = ([t.clone() for t in ts] for ts in (masters, exp_avgs, exp_avg_sqs))
    grad_scale = None
    if scale is None:  # torch's clip on the gradients' own dtype, then the upcast
        low = [g.clone() for g in grads]
        torch._foreach_mul_(low, coef)
        g32 = [g.to(torch.float32).clone() for g in low]
    elif coef is None:  # GradScaler's fused path: the kernel divides the upcast gradient
        g32 = [g.to(torch.float32).clone() for g in grads]
        grad_scale = scale
    else:
        g32 = [g.to(torch.float32).clone() for g in grads]
        torch._foreach_div_(g32, scale)
        torch._foreach_mul_(g32, coef)
        g32 = [g.to(grads[0].dtype).to(torch.float32) for g in g32]
    steps = [torch.tensor(step) for _ in masters]
    torch._fused_adamw_(masters, g32, exp_avgs, exp_avg_sqs, [], steps, lr=LR, beta1=BETA1,
                        beta2=BETA2, weight_decay=WD, eps=EPS, amsgrad=False, maximize=False,
                        grad_scale=grad_scale, found_inf=None)
    return masters, exp_avgs, exp_avg_sqs


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise, except that any two NaNs are equal."""
    ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
    nan = torch.isnan(a) & torch.isnan(b)
    return a.dtype == b.dtype and bool(((a.view(ints) == b.view(ints)) | nan).all())


def _assert_same(got, want, what: str) -> None:
    for name, gs, ws in zip(("master", "exp_avg", "exp_avg_sq"), got, want):
        for i, (g, w) in enumerate(zip(gs, ws)):
            assert _same(g, w), f"{what}: {name}[{i}] ({g.numel()} elements) differs from torch"


def _run(kernel: str, grads, masters, exp_avgs, exp_avg_sqs, hyper: Hyper, steps):
    """One call of ``kernel`` on copies of the state; returns (masters, exp_avgs, exp_avg_sqs)."""
    masters, exp_avgs, exp_avg_sqs = ([t.clone() for t in ts] for ts in (masters, exp_avgs, exp_avg_sqs))
    dtype = grads[0].dtype
    if kernel == "torch":
        up = [g.to(torch.float32) for g in grads]  # fp32: the gradients themselves
        fused_adamw_(masters, up, exp_avgs, exp_avg_sqs, steps, steps_to_increment=steps[:1],
                     hyper=hyper, grad_dtypes=[dtype] * len(grads) if dtype != torch.float32 else ())
    elif kernel == "native-f32":
        native_adamw_f32_(masters, grads, exp_avgs, exp_avg_sqs, steps, steps_to_increment=steps[:1],
                          hyper=hyper)
    else:
        params = [m.to(dtype) for m in masters]
        mixed_precision_adamw_(params, grads, masters, exp_avgs, exp_avg_sqs, steps,
                               steps_to_increment=steps[:1], hyper=hyper)
        assert all(_same(p, m.to(dtype)) for p, m in zip(params, masters))
    return masters, exp_avgs, exp_avg_sqs


CASES = [("torch", dt) for dt in (torch.float32, torch.bfloat16, torch.float16)] + [
    ("native-f32", torch.float32), ("native-mp", torch.bfloat16), ("native-mp", torch.float16)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("path", "dtype"), CASES, ids=[f"{k}-{str(d)[6:]}" for k, d in CASES])
def test_transforms_are_bitwise_torch(request, path, dtype, mode) -> None:
    if path != "torch":
        request.getfixturevalue("kernel")
    gen = torch.Generator().manual_seed(sum(map(ord, f"{path}{dtype}{mode}")))
    grads = _grads(dtype, gen)
    before = [g.clone() for g in grads]
    state = _state(grads, gen)
    coef, scale = _transform(mode)
    want = _reference(*state, grads, 3.0, coef, scale)
    for threads in (1, 2) if path != "torch" else (torch.get_num_threads(),):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            steps = [torch.tensor(2.0)] * len(grads)  # one parameter's views: incremented once
            got = _run(path, grads, *state, _hyper(coef, scale, torch.tensor(0.0)), steps)
        finally:
            torch.set_num_threads(previous)
        assert steps[0].item() == 3.0
        _assert_same(got, want, f"{path} {dtype} {mode} threads={threads}")
    for g, b in zip(grads, before):  # the gradients are only read
        assert torch.equal(g.view(torch.uint8), b.view(torch.uint8))


def test_a_chunk_mixing_bf16_and_fp16_applies_each_rounding(kernel) -> None:
    gen = torch.Generator().manual_seed(5)
    grads = [_grads(torch.bfloat16, gen)[-2], _grads(torch.float16, gen)[-2]]
    state = _state(grads, gen)
    coef, _ = _transform("coef")
    want = [_reference(*(ts[i : i + 1] for ts in state), grads[i : i + 1], 1.0, coef, None)
            for i in range(2)]
    masters, exp_avgs, exp_avg_sqs = ([t.clone() for t in ts] for ts in state)
    params = [m.to(g.dtype) for m, g in zip(masters, grads)]
    step = torch.tensor(0.0)
    mixed_precision_adamw_(params, grads, masters, exp_avgs, exp_avg_sqs, [step, step],
                           steps_to_increment=[step], hyper=_hyper(coef))
    for i in range(2):
        _assert_same(([masters[i]], [exp_avgs[i]], [exp_avg_sqs[i]]), want[i], f"mixed call [{i}]")


def test_scale_equals_torch_adamw_under_gradscaler_semantics() -> None:
    """fused_adamw_ with grad_scale against torch.optim.AdamW(fused=True) with the attributes
    GradScaler.step sets on it (grad_scale, found_inf)."""
    gen = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (5, 333)]
    grads = [torch.randn(p.numel(), generator=gen) * 1024 for p in params]
    opt = torch.optim.AdamW(params, lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD, fused=True)
    masters = [p.detach().clone() for p in params]
    exp_avgs = [torch.zeros_like(m) for m in masters]
    exp_avg_sqs = [torch.zeros_like(m) for m in masters]
    steps = [torch.tensor(0.0) for _ in masters]
    for found in (0.0, 1.0, 0.0):
        scale = torch.tensor(1024.0)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.grad_scale, opt.found_inf = scale, torch.tensor(found)
        opt.step()
        fused_adamw_(masters, grads, exp_avgs, exp_avg_sqs, steps, steps_to_increment=steps,
                     hyper=_hyper(None, scale, torch.tensor(found)))
        for i, p in enumerate(params):
            st = opt.state[p]
            assert torch.equal(p.detach(), masters[i]) and torch.equal(st["exp_avg"], exp_avgs[i])
            assert torch.equal(st["exp_avg_sq"], exp_avg_sqs[i]) and torch.equal(st["step"], steps[i])
    assert steps[0].item() == 2.0  # the overflow step did not count


@pytest.mark.parametrize("path", ["torch", "native-f32", "native-mp"])
def test_found_inf_skips_the_update_and_the_step(request, path) -> None:
    if path != "torch":
        request.getfixturevalue("kernel")
    dtype = torch.bfloat16 if path == "native-mp" else torch.float32
    gen = torch.Generator().manual_seed(11)
    grads = _grads(dtype, gen)[:3]
    state = _state(grads, gen)
    steps = [torch.tensor(4.0)] * len(grads)
    coef, scale = _transform("both")
    got = _run(path, grads, *state, _hyper(coef, scale, torch.tensor(1.0)), steps)
    assert steps[0].item() == 4.0
    _assert_same(got, state, f"{path} with found_inf=1")


@pytest.mark.parametrize(
    ("hyper", "message"),
    [
        (_hyper(coef=torch.tensor(0.5, dtype=torch.float64)),
         "Hyper.grad_coef is a torch.float64 tensor of shape () on cpu: expected a one-element "
         "torch.float32 CPU tensor"),
        (_hyper(scale=torch.ones(2)), "Hyper.grad_scale is a torch.float32 tensor of shape (2,)"),
        (_hyper(found_inf=torch.tensor(2.0)), "Hyper.found_inf is 2.0: expected 0.0 or 1.0"),
    ],
)
@pytest.mark.parametrize("path", ["torch", "native-f32"])
def test_bad_transforms_raise_before_any_write(request, path, hyper, message) -> None:
    if path != "torch":
        request.getfixturevalue("kernel")
    gen = torch.Generator().manual_seed(3)
    grads = _grads(torch.float32, gen)[:2]
    masters, exp_avgs, exp_avg_sqs = _state(grads, gen)
    before = [t.clone() for t in (*masters, *exp_avgs, *exp_avg_sqs)]
    step = torch.tensor(1.0)
    fn = fused_adamw_ if path == "torch" else native_adamw_f32_
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fn(masters, grads, exp_avgs, exp_avg_sqs, [step, step], steps_to_increment=[step],
           hyper=hyper)
    assert step.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip((*masters, *exp_avgs, *exp_avg_sqs), before))


def test_grad_dtypes_must_match_the_gradients() -> None:
    g = [torch.ones(3), torch.ones(4)]
    with pytest.raises(ValueError, match="grad_dtypes has 1 entries: expected 2"):
        fused_adamw_([torch.zeros(3), torch.zeros(4)], g, [torch.zeros(3), torch.zeros(4)],
                     [torch.zeros(3), torch.zeros(4)], [torch.tensor(1.0)] * 2,
                     steps_to_increment=(), hyper=_hyper(torch.tensor(0.5)),
                     grad_dtypes=[torch.bfloat16])


def test_kernel_set_carries_grad_stats() -> None:
    calls = []

    def spy(tensors, *, norm_type=2.0):
        calls.append(len(tensors))
        return torch.zeros(len(tensors), dtype=torch.float64), torch.zeros(len(tensors), dtype=torch.int64)

    kernels = KernelSet(grad_stats=spy)
    kernels.grad_stats([torch.ones(2)])
    assert calls == [1]
