"""The fused-mp AdamW kernel against the torch path (upcast grad, torch._fused_adamw_, downcast).

The first test that needs the kernel builds it (about 20 s on 2 cores); later runs reuse the cached
build. Tests that need it skip when there is no C++ compiler or ninja, and fail when the build
itself fails: a broken kernel on a machine that can build it is a defect, not a skip.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload.testing import KernelLoader, KernelSet
from offload.kernels._fused_mp import (
    STEP_RTOL,
    FusedMPUnavailable,
    StepOptions,
    bitwise_matches_torch,
    fused_mp_adamw_steps_,
    fused_mp_available,
)
from offload.kernels._build import build_spec, pip_ninja_on_path
from offload.kernels._adamw import Hyper, fused_adamw_, new_step_tensor
from offload.kernels._mp_reference import torch_mp_adamw_

REPO = Path(__file__).resolve().parents[1]
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
# Sizes: empty, below one vector, around the 8-element tail block and the 16-float vector, around
# the 64-element parallel unit, large enough to be split across threads.
SIZES = (0, 1, 7, 8, 9, 15, 16, 17, 24, 31, 33, 63, 64, 65, 1000, 4097, 100_003)


def _state(sizes, pdtype, gen):
    masters = [torch.randn(n, generator=gen) for n in sizes]
    exp_avgs = [0.1 * torch.randn(n, generator=gen) for n in sizes]
    exp_avg_sqs = [0.01 * torch.rand(n, generator=gen) for n in sizes]
    params = [m.to(pdtype) for m in masters]
    return params, masters, exp_avgs, exp_avg_sqs


def _grads(sizes, gdtype, gen):
    # Magnitudes over five decades, so both moments see large and tiny gradients.
    return [
        (torch.randn(n, generator=gen) * 10 ** (5 * torch.rand(n, generator=gen) - 4)).to(gdtype)
        for n in sizes
    ]


def _clone(tensors):
    return [t.clone() for t in tensors]


def _fused_at_step(params, grads, masters, exp_avgs, exp_avg_sqs, *, step, **kwargs):
    """The native step with every tensor at step ``step`` (``torch_mp_adamw_``'s signature): one
    fresh step tensor holding it, nothing incremented."""
    steps = [torch.tensor(float(step))] * len(masters)
    fused_mp_adamw_steps_(params, grads, masters, exp_avgs, exp_avg_sqs, steps, **kwargs)


def _assert_same(got, want, *, what: str, lr: float) -> None:
    """Bitwise on a verified build; else within the documented per-step tolerance."""
    if bitwise_matches_torch():
        assert torch.equal(got, want), f"{what}: differs from the torch path on a verified build"
    elif got.dtype != torch.float32:  # one low-precision ulp: fp32 masters may straddle a boundary
        torch.testing.assert_close(got, want, rtol=2 * torch.finfo(got.dtype).eps, atol=0, msg=what)
    else:
        torch.testing.assert_close(got, want, rtol=STEP_RTOL, atol=STEP_RTOL * 10 * lr, msg=what)


@pytest.mark.parametrize(
    ("pdtype", "gdtype", "hyper"),
    [
        (torch.bfloat16, torch.bfloat16, HYPER),
        (torch.bfloat16, torch.bfloat16, {**HYPER, "beta1": 0.3, "weight_decay": 0.0}),
        (torch.float16, torch.float16, HYPER),
        (torch.bfloat16, torch.float16, {**HYPER, "beta2": 0.95}),
    ],
    ids=["bf16", "bf16-beta1<0.5-nodecay", "fp16", "bf16param-fp16grad"],
)
def test_each_step_matches_torch_path(kernel, pdtype, gdtype, hyper) -> None:
    gen = torch.Generator().manual_seed(0)
    params, masters, exp_avgs, exp_avg_sqs = _state(SIZES, pdtype, gen)
    ref = [_clone(x) for x in (params, masters, exp_avgs, exp_avg_sqs)]
    steps = [torch.tensor(0.0) for _ in SIZES]  # each tensor's own, incremented by the kernel
    for step in range(1, 6):
        grads = _grads(SIZES, gdtype, gen)
        grads_before = _clone(grads)
        fused_mp_adamw_steps_(params, grads, masters, exp_avgs, exp_avg_sqs, steps,
                              steps_to_increment=steps, **hyper)
        torch_mp_adamw_(*ref[:1], grads, *ref[1:], step=step, **hyper)
        assert all(s.item() == step for s in steps)
        assert all(torch.equal(g, b) for g, b in zip(grads, grads_before)), "grads were written"
        for i, n in enumerate(SIZES):
            for name, got, want in zip(
                ("params_lowp", "masters", "exp_avgs", "exp_avg_sqs"),
                (params, masters, exp_avgs, exp_avg_sqs),
                ref,
            ):
                _assert_same(got[i], want[i], what=f"step {step} {name}[{i}] (numel {n})",
                             lr=hyper["lr"])
        # Next step starts from the reference state: each step is compared on equal inputs.
        for got, want in zip((params, masters, exp_avgs, exp_avg_sqs), ref):
            for g, w in zip(got, want):
                g.copy_(w)


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_large_call_with_streaming_stores_matches_torch_path(kernel, offset) -> None:
    """Calls of >= 2 Mi elements write the bf16 parameter with non-temporal stores when aligned."""
    gen = torch.Generator().manual_seed(4)
    n = (1 << 21) + 37
    params, masters, exp_avgs, exp_avg_sqs = _state((n + offset,), torch.bfloat16, gen)
    state = [[t[0][offset:]] for t in (params, masters, exp_avgs, exp_avg_sqs)]
    aligned = state[0][0].data_ptr() % 64 == 0
    assert aligned == (offset == 0), "the test needs one aligned and one misaligned bf16 view"
    ref = [_clone(x) for x in state]
    grads = _grads((n,), torch.bfloat16, gen)
    for step in (1, 2):
        _fused_at_step(state[0], grads, *state[1:], step=step, **HYPER)
        torch_mp_adamw_(ref[0], grads, *ref[1:], step=step, **HYPER)
    for name, got, want in zip(("params_lowp", "masters", "exp_avgs", "exp_avg_sqs"), state, ref):
        _assert_same(got[0], want[0], what=name, lr=HYPER["lr"])


def test_thread_counts_give_identical_results(kernel) -> None:
    sizes = (200_003, 70_001, 5, 131_072)  # ~6,300 units of 64: split across threads
    gen = torch.Generator().manual_seed(1)
    start = _state(sizes, torch.bfloat16, gen)
    grads = _grads(sizes, torch.bfloat16, gen)
    results = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):  # 3 > cores here: blocks go to whichever thread runs
            torch.set_num_threads(threads)
            state = [_clone(x) for x in start]
            steps = [torch.tensor(0.0) for _ in sizes]
            for _ in (1, 2, 3):
                fused_mp_adamw_steps_(state[0], grads, *state[1:], steps,
                                      steps_to_increment=steps, **HYPER)
            results.append(state)
    finally:
        torch.set_num_threads(previous)
    for other in results[1:]:
        for one, two in zip(results[0], other):
            for a, b in zip(one, two):
                assert torch.equal(a, b)


def test_torch_thread_count_governs_the_kernel(kernel) -> None:
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert kernel.threads_used(64) == threads
    finally:
        torch.set_num_threads(previous)


def test_empty_lists_are_a_no_op(kernel) -> None:
    fused_mp_adamw_steps_([], [], [], [], [], [], **HYPER)


def test_state_steps_match_one_call_per_tensor_at_its_step(kernel) -> None:
    """One call over tensors of different step tensors == one call per tensor at the step its
    step tensor holds after increments applied like torch._foreach_add_ (a tensor listed twice
    goes up by two)."""
    sizes = (100_003, 33, 4097, 65)
    gen = torch.Generator().manual_seed(5)
    params, masters, exp_avgs, exp_avg_sqs = _state(sizes, torch.bfloat16, gen)
    grads = _grads(sizes, torch.bfloat16, gen)
    ref = [_clone(x) for x in (params, masters, exp_avgs, exp_avg_sqs)]
    a, b, c = torch.tensor(3.0), torch.tensor(0.0), torch.tensor(7.0)
    state_steps = [a, b, b, c]  # tensors 1 and 2 are views of one parameter: one step tensor
    fused_mp_adamw_steps_(params, grads, masters, exp_avgs, exp_avg_sqs, state_steps,
                          steps_to_increment=[a, b, a], **HYPER)
    assert (a.item(), b.item(), c.item()) == (5.0, 1.0, 7.0)
    for i, step in enumerate((5, 1, 1, 7)):
        _fused_at_step(*([x[i]] for x in ref[:1]), [grads[i]], *([x[i]] for x in ref[1:]),
                       step=step, **HYPER)
    for name, got, want in zip(("params_lowp", "masters", "exp_avgs", "exp_avg_sqs"),
                               (params, masters, exp_avgs, exp_avg_sqs), ref):
        for i in range(len(sizes)):
            assert torch.equal(got[i], want[i]), f"{name}[{i}]"


def test_state_steps_alias_by_storage_not_by_tensor_object(kernel) -> None:
    """Two views of one step element listed for increment go up twice (as with _foreach_add_),
    and a lazily cloned (copy-on-write) step tensor keeps its own value."""
    a = torch.tensor(1.0)
    fused_mp_adamw_steps_([], [], [], [], [], [], steps_to_increment=[a, a.view(1)], **HYPER)
    assert a.item() == 3.0

    gen = torch.Generator().manual_seed(8)
    params, masters, exp_avgs, exp_avg_sqs = _state((40,), torch.bfloat16, gen)
    grads = _grads((40,), torch.bfloat16, gen)
    ref = [_clone(x) for x in (params, masters, exp_avgs, exp_avg_sqs)]
    original = torch.tensor(4.0)
    lazy = torch._lazy_clone(original) if hasattr(torch, "_lazy_clone") else original.clone()
    fused_mp_adamw_steps_(params, grads, masters, exp_avgs, exp_avg_sqs, [lazy],
                          steps_to_increment=[original], **HYPER)
    assert (original.item(), lazy.item()) == (5.0, 4.0)
    _fused_at_step(ref[0], grads, *ref[1:], step=4, **HYPER)  # the clone's own step
    for got, want in zip((params, masters, exp_avgs, exp_avg_sqs), ref):
        assert torch.equal(got[0], want[0])


def test_state_steps_only_increment_when_there_is_nothing_to_update(kernel) -> None:
    step = torch.tensor(2.0)
    fused_mp_adamw_steps_([], [], [], [], [], [], steps_to_increment=[step], **HYPER)
    assert step.item() == 3.0


@pytest.mark.parametrize(
    ("case", "error", "message"),
    [
        ("step-below-one", ValueError, "state_steps[1] is 0 after the increments"),
        ("step-nan", ValueError, "state_steps[0] is nan after the increments"),
        ("step-fp64", TypeError, "state_steps[1] has dtype torch.float64: expected torch.float32"),
        ("step-shape", ValueError, "state_steps[0] has shape [2]: expected a one-element step"),
        ("increment-fp64", TypeError, "steps_to_increment[0] has dtype torch.float64"),
        ("steps-length", ValueError, "state_steps has 1 tensors: expected 2 like masters"),
        ("moment-size", ValueError, "exp_avg_sqs[1] has 41 elements"),
    ],
)
def test_bad_state_steps_raise_before_touching_memory(kernel, case, error, message) -> None:
    gen = torch.Generator().manual_seed(6)
    sizes = (33, 40)
    params, masters, exp_avgs, exp_avg_sqs = _state(sizes, torch.bfloat16, gen)
    grads = _grads(sizes, torch.bfloat16, gen)
    steps = [torch.tensor(1.0), torch.tensor(1.0)]
    increment = [steps[0]]
    if case == "step-below-one":
        steps[1] = torch.tensor(0.0)  # not incremented: stays 0
    elif case == "step-nan":
        steps[0].fill_(float("nan"))
    elif case == "step-fp64":
        steps[1] = torch.tensor(1.0, dtype=torch.float64)
    elif case == "step-shape":
        steps[0] = torch.ones(2)
        increment = []
    elif case == "increment-fp64":
        increment = [torch.tensor(1.0, dtype=torch.float64)]
    elif case == "steps-length":
        steps = steps[:1]
    elif case == "moment-size":
        exp_avg_sqs[1] = torch.zeros(41)
    watched = [*params, *grads, *masters, *exp_avgs, *exp_avg_sqs, *steps, *increment]
    before = _clone(watched)
    with pytest.raises(error, match=re.escape(message)):
        fused_mp_adamw_steps_(params, grads, masters, exp_avgs, exp_avg_sqs, steps,
                              steps_to_increment=increment, **HYPER)
    for now, was in zip(watched, before):
        assert torch.equal(now, was) or (now.isnan().all() and was.isnan().all()), (
            f"{case}: a tensor changed before the error")


def _bad_case(name: str):
    """Two valid parameters, then one argument made bad at index 1 (or globally)."""
    gen = torch.Generator().manual_seed(2)
    sizes = (33, 40)
    params, masters, exp_avgs, exp_avg_sqs = _state(sizes, torch.bfloat16, gen)
    grads = _grads(sizes, torch.bfloat16, gen)
    steps = [torch.tensor(0.0), torch.tensor(0.0)]
    args = {"params_lowp": params, "grads_lowp": grads, "masters": masters,
            "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "state_steps": steps}
    hyper = {"steps_to_increment": steps, **HYPER}
    if name == "non-contiguous":
        args["exp_avgs"][1] = torch.zeros(80)[::2]
        return args, hyper, ValueError, "exp_avgs[1] is not contiguous"
    if name == "size-mismatch":
        args["exp_avg_sqs"][1] = torch.zeros(41)
        return args, hyper, ValueError, "exp_avg_sqs[1] has 41 elements"
    if name == "fp32-master-as-bf16":
        args["masters"][1] = masters[1].bfloat16()
        return args, hyper, TypeError, "masters[1] has dtype torch.bfloat16: expected torch.float32"
    if name == "fp32-grads":
        args["grads_lowp"] = [g.float() for g in grads]
        return args, hyper, TypeError, "grads_lowp[0] has dtype torch.float32"
    if name == "fp32-params":
        args["params_lowp"] = [p.float() for p in params]
        return args, hyper, TypeError, "params_lowp[0] has dtype torch.float32"
    if name == "mixed-param-dtypes":
        args["params_lowp"][1] = params[1].half()
        return (args, hyper, TypeError,
                "params_lowp[1] has dtype torch.float16: expected torch.bfloat16")
    if name == "length-mismatch":
        args["exp_avgs"] = exp_avgs[:1]
        return args, hyper, ValueError, "exp_avgs has 1 tensors: expected 2"
    if name == "aliased":
        args["exp_avgs"][1] = masters[1]
        return args, hyper, ValueError, "masters[1] and exp_avgs[1] share memory"
    if name == "wrong-device":
        args["grads_lowp"][1] = torch.zeros(40, dtype=torch.bfloat16, device="meta")
        return args, hyper, ValueError, "grads_lowp[1] is on device meta"
    if name == "not-a-tensor":
        args["masters"][1] = [0.0] * 40
        return args, hyper, TypeError, "masters[1] is a list"
    if name == "not-a-list":
        args["masters"] = masters[0]
        return args, hyper, TypeError, "masters is a Tensor"
    if name == "beta1-one":
        return args, {**hyper, "beta1": 1.0}, ValueError, "beta1=1.0"
    if name == "lr-nan":
        return args, {**hyper, "lr": float("nan")}, ValueError, "lr=nan"
    raise AssertionError(name)


@pytest.mark.parametrize(
    "case",
    ["non-contiguous", "size-mismatch", "fp32-master-as-bf16", "fp32-grads", "fp32-params",
     "mixed-param-dtypes", "length-mismatch", "aliased", "wrong-device", "not-a-tensor",
     "not-a-list", "beta1-one", "lr-nan"],
)
def test_bad_inputs_raise_before_touching_memory(kernel, case) -> None:
    args, hyper, error, message = _bad_case(case)
    watched = [t for lst in args.values() if isinstance(lst, list) for t in lst
               if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    before = _clone(watched)
    with pytest.raises(error, match=re.escape(message)):
        fused_mp_adamw_steps_(**args, **hyper)
    for now, was in zip(watched, before):
        assert torch.equal(now, was), f"{case}: a buffer changed before the error"


def test_loss_curves_match_over_200_steps(kernel) -> None:
    """A bf16 GPT trained 200 steps with each backend from one init: the same loss curve."""
    from bench.train.model import GPTConfig

    # The reference trainer's model class, narrowed so 2 x 200 steps take about a second.
    cfg = GPTConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=2, max_seq_len=32)
    curves = []
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: thread start-up would dominate on a shared machine
    try:
        for update in (torch_mp_adamw_, _fused_at_step):
            curves.append(_train(cfg, update))
    finally:
        torch.set_num_threads(previous)
    reference, fused = curves
    assert reference[-20:].mean() < reference[:20].mean() - 0.5, "the model did not train"
    if bitwise_matches_torch():
        assert torch.equal(fused, reference)
    else:  # tail roundings may differ by an ulp per step; training noise must not amplify them
        torch.testing.assert_close(fused, reference, rtol=1e-2, atol=1e-2)


def _train(cfg, update) -> torch.Tensor:
    """200 steps of a bf16 GPT whose fp32 master weights and moments ``update`` steps."""
    from bench.train.model import GPT, SyntheticTokens

    torch.manual_seed(0)
    model = GPT(cfg)
    masters = [p.detach().clone().view(-1) for p in model.parameters()]
    model = model.to(torch.bfloat16)
    params = list(model.parameters())
    exp_avgs = [torch.zeros_like(m) for m in masters]
    exp_avg_sqs = [torch.zeros_like(m) for m in masters]
    data = SyntheticTokens(vocab_size=cfg.vocab_size, batch_size=4, seq_len=32, seed=0)
    losses = []
    for step in range(1, 201):
        x, y = data.next_batch()
        loss = model(x, y)
        loss.backward()
        with torch.no_grad():
            update([p.view(-1) for p in params], [p.grad.view(-1) for p in params], masters,
                   exp_avgs, exp_avg_sqs, step=step, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                   weight_decay=0.1)
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses)


# ---- build, cache and fallback --------------------------------------------------------------


def test_build_is_cached_across_processes(kernel) -> None:
    spec = build_spec()
    libs = list(spec.build_dir.glob("*.so"))
    assert len(libs) == 1, f"expected one built library in {spec.build_dir}, found {libs}"
    mtime = libs[0].stat().st_mtime_ns
    code = (
        "import time; t = time.perf_counter()\n"
        "from offload.kernels._fused_mp import fused_mp_available\n"
        "ok, reason = fused_mp_available()\n"
        "print(ok, round(time.perf_counter() - t, 2), reason)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": _pythonpath()})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True"), out.stdout + out.stderr
    assert str(spec.build_dir) in out.stdout
    assert libs[0].stat().st_mtime_ns == mtime, "a second process rebuilt the cached extension"


def _pythonpath() -> str:
    parts = [str(REPO), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)


def _expect_fallback(caplog, loader, reason_part: str) -> str:
    gen = torch.Generator().manual_seed(3)
    params, masters, exp_avgs, exp_avg_sqs = _state((20,), torch.bfloat16, gen)
    grads = _grads((20,), torch.bfloat16, gen)
    before = _clone(masters)
    with caplog.at_level(logging.WARNING, logger="offload.kernels._build"):
        ok, reason = fused_mp_available(loader)
        assert fused_mp_available(loader) == (ok, reason)
        with pytest.raises(FusedMPUnavailable, match="unavailable"):
            _fused_at_step(params, grads, masters, exp_avgs, exp_avg_sqs, step=1, **HYPER, loader=loader)
        # A kernel set on that loader: the same answer, and its native kernels run on it (fail).
        kernels = KernelSet(loader=loader)
        assert kernels.available() == (ok, reason)
        hyper = Hyper(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)
        with pytest.raises(FusedMPUnavailable, match="unavailable"):
            kernels.mixed_precision_adamw(params, grads, masters, exp_avgs, exp_avg_sqs,
                                          [new_step_tensor()], steps_to_increment=[], hyper=hyper)
        with pytest.raises(FusedMPUnavailable, match="unavailable"):
            kernels.native_adamw_f32(masters, [g.float() for g in grads], exp_avgs, exp_avg_sqs,
                                     [new_step_tensor()], steps_to_increment=[], hyper=hyper)
    assert not ok
    assert reason_part in reason, reason
    # One warning for the fallback (besides the one that announces a build, when one starts).
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING
                and "building the native AdamW kernel" not in r.getMessage()]
    assert len(warnings) == 1 and reason in warnings[0].getMessage()
    assert all(torch.equal(m, b) for m, b in zip(masters, before))
    return reason


def test_fallback_when_the_build_fails(caplog, tmp_path, kernel) -> None:
    broken = tmp_path / "fused_mp_adamw.cpp"
    broken.write_text('#error "deliberately broken kernel source"\n')
    reason = _expect_fallback(caplog, KernelLoader(broken, tmp_path / "cache"),
                              "build of fused_mp_adamw.cpp failed")
    assert "deliberately broken" in reason


def test_fallback_without_a_compiler(monkeypatch, caplog, tmp_path) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "get_cxx_compiler", lambda: "no-such-cxx-compiler")
    _expect_fallback(caplog, KernelLoader(cache_root=tmp_path),
                     "no C++ compiler: 'no-such-cxx-compiler' is not on PATH")


def test_fallback_without_ninja(monkeypatch, caplog, tmp_path) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    _expect_fallback(caplog, KernelLoader(cache_root=tmp_path),
                     "ninja is not installed")


def test_build_key_tracks_source_and_flags(tmp_path) -> None:
    source = tmp_path / "k.cpp"
    source.write_text("// one\n")
    first = build_spec(source, tmp_path)
    assert first == build_spec(source, tmp_path)
    source.write_text("// two\n")
    second = build_spec(source, tmp_path)
    assert second.name != first.name and second.build_dir != first.build_dir
    assert second.build_dir.parent == tmp_path / "ext"
    assert "-march=native" not in first.cflags and "-ffp-contract=off" in first.cflags


def test_pip_ninja_is_put_on_path_only_during_the_build(monkeypatch) -> None:
    ninja = pytest.importorskip("ninja", reason="the pip 'ninja' package is not installed")
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "ninja" else real_which(name))
    before = os.environ.get("PATH", "")
    with pip_ninja_on_path():
        assert os.environ["PATH"].split(os.pathsep)[0] == str(ninja.BIN_DIR)
    assert os.environ.get("PATH", "") == before


# ---- fp32 entry point (the parameter is its own master) -------------------------------------


def _f32_state(sizes, gen):
    params = [torch.randn(n, generator=gen) for n in sizes]
    exp_avgs = [0.1 * torch.randn(n, generator=gen) for n in sizes]
    exp_avg_sqs = [0.01 * torch.rand(n, generator=gen) for n in sizes]
    return params, exp_avgs, exp_avg_sqs


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("hyper", [HYPER, {**HYPER, "weight_decay": 0.0, "beta1": 0.6}])
def test_f32_entry_equals_torch_fused_adamw(kernel, threads, hyper) -> None:
    """Odd sizes (every vector/tail/unit boundary), per-tensor steps, several steps with a changing
    lr: bitwise equal to torch._fused_adamw_ (the same arithmetic as the bf16 master update)."""
    gen = torch.Generator().manual_seed(11)
    sizes = SIZES
    params, exp_avgs, exp_avg_sqs = _f32_state(sizes, gen)
    ref_p, ref_m, ref_v = _clone(params), _clone(exp_avgs), _clone(exp_avg_sqs)
    steps = [new_step_tensor(float(i % 3)) for i in range(len(sizes))]
    ref_steps = _clone(steps)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in range(3):
            grads = _grads(sizes, torch.float32, gen)
            lr = hyper["lr"] / (1 + k)
            outs = [torch.full((n,), float("nan")) for n in sizes] if k == 1 else []
            kernel.adamw_f32_steps_(params, grads, exp_avgs, exp_avg_sqs, steps, outs=outs,
                                    steps_to_increment=steps, options=StepOptions(**{**hyper, "lr": lr}))
            fused_adamw_(ref_p, grads, ref_m, ref_v, ref_steps, steps_to_increment=ref_steps,
                          hyper=Hyper(lr=lr, beta1=hyper["beta1"], beta2=hyper["beta2"],
                                      weight_decay=hyper["weight_decay"], eps=hyper["eps"]))
            for got, want, what in ((params, ref_p, "param"), (exp_avgs, ref_m, "exp_avg"),
                                    (exp_avg_sqs, ref_v, "exp_avg_sq"), (steps, ref_steps, "step")):
                for i, (g, w) in enumerate(zip(got, want)):
                    _assert_same(g, w, what=f"{what}[{i}] step {k}", lr=lr)
            for o, p in zip(outs, params):
                assert torch.equal(o, p), "outs hold a copy of the updated parameters"
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize(
    ("case", "error", "message"),
    [
        ("grad-bf16", TypeError, "adamw_f32_steps_: grads[1] has dtype torch.bfloat16: expected torch.float32"),
        ("alias", ValueError, "params[0] and grads[0] share memory"),
        ("outs-length", ValueError, "outs has 1 tensors: expected 2 like params (or none)"),
        ("steps-length", ValueError, "state_steps has 1 tensors: expected 2 like params"),
        ("moment-size", ValueError, "exp_avg_sqs[1] has 41 elements"),
    ],
)
def test_f32_entry_bad_inputs_raise_before_touching_memory(kernel, case, error, message) -> None:
    gen = torch.Generator().manual_seed(5)
    params, exp_avgs, exp_avg_sqs = _f32_state([33, 40], gen)
    grads = _grads([33, 40], torch.float32, gen)
    steps = [new_step_tensor(), new_step_tensor()]
    outs: list[torch.Tensor] = []
    if case == "grad-bf16":
        grads[1] = grads[1].bfloat16()
    elif case == "alias":
        grads[0] = params[0]
    elif case == "outs-length":
        outs = [torch.empty(33)]
    elif case == "steps-length":
        steps = steps[:1]
    elif case == "moment-size":
        exp_avg_sqs[1] = torch.zeros(41)
    before = [t.clone() for t in (*params, *exp_avgs, *exp_avg_sqs, *steps)]
    with pytest.raises(error, match=re.escape(message)):
        kernel.adamw_f32_steps_(params, grads, exp_avgs, exp_avg_sqs, steps, outs=outs,
                                steps_to_increment=steps, options=StepOptions(**HYPER))
    after = [*params, *exp_avgs, *exp_avg_sqs, *steps]
    assert all(torch.equal(a, b) for a, b in zip(after, before)), "memory was written"


@pytest.mark.parametrize("entry", ["fused_mp_adamw_steps_", "adamw_f32_steps_"])
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lr": "0.1"}, "options.lr is '0.1': expected a float"),
        ({"grad_coef": [1.0]}, "options.grad_coef is [1.0]: expected a float or None"),
        ({"rounding": (1, [0])}, "options.rounding is (1, [0]): expected None or (seed, slots, starts)"),
        (None, "options has no field lr: expected an offload.kernels._fused_mp.StepOptions"),
    ],
    ids=["lr-str", "coef-list", "rounding-short", "not-a-record"],
)
def test_a_bad_options_record_raises_before_touching_memory(kernel, entry, options, message) -> None:
    """Both native entry points take their tensors and one StepOptions record, read once before
    any check of the tensors: a field of the wrong type, or a record that is not one, is a
    TypeError naming the field; nothing is written (the step tensors included)."""
    gen = torch.Generator().manual_seed(9)
    params, masters, exp_avgs, exp_avg_sqs = _state((33,), torch.bfloat16, gen)
    steps = [torch.tensor(0.0)]
    record = object() if options is None else StepOptions(**{**HYPER, **options})
    if entry == "fused_mp_adamw_steps_":
        grads = _grads((33,), torch.bfloat16, gen)
        call = lambda: kernel.fused_mp_adamw_steps_(  # noqa: E731
            params, grads, masters, exp_avgs, exp_avg_sqs, steps, steps_to_increment=steps, options=record)
    else:
        grads = _grads((33,), torch.float32, gen)
        call = lambda: kernel.adamw_f32_steps_(  # noqa: E731
            masters, grads, exp_avgs, exp_avg_sqs, steps, outs=[], steps_to_increment=steps, options=record)
    watched = [*params, *masters, *exp_avgs, *exp_avg_sqs, *steps]
    before = _clone(watched)
    with pytest.raises(TypeError, match=re.escape(f"{entry}: {message}")):
        call()
    assert all(torch.equal(a, b) for a, b in zip(watched, before)), "memory was written"
