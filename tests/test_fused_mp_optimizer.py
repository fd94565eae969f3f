"""CPUOffloadAdamW(settings=OffloadSettings(kernel="fused-mp")) against the torch path.

The reference is the same optimizer with ``kernel="torch"`` (itself bitwise equal to stock
``torch.optim.AdamW(fused=True)`` on fp32 masters, see test_optimizer_numerics.py), and that stock
mixed-precision reference directly. Where ``bitwise_matches_torch()`` (torch 2.13 x86-64) every
comparison is bitwise; elsewhere within the kernel's documented per-step tolerance.
"""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
from conftest import assert_bitwise, batch, make_model, param_groups, uses_sometimes
from test_optimizer_numerics import MixedPrecisionReference

from offload import CPUOffloadAdamW, OffloadSettings
from offload.testing import KernelLoader, KernelSet
from offload.pipeline._host_transport import HostTransport
from offload.pipeline._jobs import ChunkJob
from offload.state._items import KIND_MP, Item
from offload.kernels._adamw import Hyper, new_step_tensor
from offload.pipeline._pipeline import Pipeline
from offload.state._slabs import SLAB_KINDS, HostSlabs, plan_chunks
from offload.kernels._fused_mp import STEP_RTOL, bitwise_matches_torch

STEPS = 30
pytestmark = pytest.mark.usefixtures("single_threaded_main")


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.07 * s))


def _settings(kernel: str, chunk: int = 1 << 10, threads: int = 1) -> OffloadSettings:
    # 1 Ki-element chunks split the 48x133 weights over several chunks (and views).
    return OffloadSettings(threads=threads, chunk_numel=chunk, kernel=kernel)  # type: ignore[arg-type]


def _train(model, opt, sched, steps, device: str = "cpu", on_step=None) -> list[str]:
    kernels = []
    for step in steps:
        if on_step is not None:
            on_step(step)
        opt.zero_grad(set_to_none=True)
        model(batch(step, device=device), use_sometimes=uses_sometimes(step)).backward()
        opt.step()
        sched.step()
        if isinstance(opt, CPUOffloadAdamW):
            kernels.append(opt.last_stats.kernel)
    return kernels


def _state(opt: CPUOffloadAdamW, params) -> list[torch.Tensor]:
    out = []
    for p in params:
        st = opt.state[p]
        if st:
            out += [st["master_param"], st["exp_avg"], st["exp_avg_sq"], st["step"]]
    return out


def _assert_matches(actual, expected, what: str) -> None:
    """Bitwise on a verified build; else within the per-step tolerance compounded over the run."""
    if bitwise_matches_torch():
        assert_bitwise(actual, expected, what)
        return
    for i, (a, e) in enumerate(zip(actual, expected)):
        a, e = a.detach().cpu(), e.detach().cpu()
        if a.dtype == torch.float32:
            tol = STEP_RTOL * STEPS
            torch.testing.assert_close(a, e, rtol=tol, atol=tol, msg=f"{what}[{i}]")
        else:  # rounding of masters that straddle a boundary: a low-precision ulp or two
            eps = torch.finfo(a.dtype).eps
            torch.testing.assert_close(a.float(), e.float(), rtol=4 * eps, atol=4 * eps, msg=f"{what}[{i}]")


def _run(dtype, kernel: str, *, chunk: int = 1 << 10, threads: int = 1, overlap: bool = False,
         inspect=None, kernels: KernelSet | None = None):
    model = make_model(dtype)
    opt = CPUOffloadAdamW(
        param_groups(model), settings=_settings(kernel, chunk, threads), overlap_backward=overlap,
        kernels=kernels,
    )
    kernels = _train(model, opt, _schedule(opt), range(STEPS))
    if overlap:  # the early path (kernel during backward, weights staged until step()) ran
        assert opt.last_stats.speculated_chunks > 0
    params = list(model.parameters())
    result = ([p.detach().clone() for p in params], [t.clone() for t in _state(opt, params)])
    if inspect is not None:
        inspect(opt)
    opt.close()
    return result, kernels, opt.settings


@pytest.mark.parametrize(
    ("dtype", "chunk", "threads", "overlap"),
    [
        (torch.bfloat16, 1 << 10, 1, False),
        (torch.bfloat16, 3000, 2, True),  # chunk not a multiple of 64; early launches in backward
        (torch.float16, 1 << 20, 1, False),  # whole groups in one chunk
    ],
)
def test_fused_mp_equals_torch_path(kernel, dtype, chunk, threads, overlap) -> None:
    (want_p, want_s), want_k, _ = _run(dtype, "torch", chunk=chunk, threads=threads, overlap=overlap)
    (got_p, got_s), got_k, settings = _run(dtype, "fused-mp", chunk=chunk, threads=threads, overlap=overlap)
    assert settings.kernel == "fused-mp"
    assert set(want_k) == {"torch"} and set(got_k) == {"fused-mp"}
    _assert_matches(got_p, want_p, "params")
    _assert_matches(got_s, want_s, "state")

    # And against the stock reference: torch.optim.AdamW(fused=True) on fp32 masters.
    model = make_model(dtype)
    ref = MixedPrecisionReference(model)
    _train(model, ref, _schedule(ref.opt), range(STEPS))
    _assert_matches(got_p, list(model.parameters()), "params vs torch.optim.AdamW")


def test_fp32_parameters_of_a_mixed_model_keep_the_torch_path(kernel) -> None:
    """A bf16 model whose LayerNorm stays fp32: the norm takes the torch path, the rest fused-mp."""

    def run(kernel_name: str):
        model = make_model(torch.bfloat16)
        model.norm.float()
        opt = CPUOffloadAdamW(param_groups(model), settings=_settings(kernel_name))
        kernels = _train(model, opt, _schedule(opt), range(STEPS))
        params = list(model.parameters())
        return [p.detach().clone() for p in params], _state(opt, params), kernels

    want_p, want_s, _ = run("torch")
    got_p, got_s, kernels = run("fused-mp")
    assert set(kernels) == {"fused-mp"}
    _assert_matches(got_p, want_p, "params")
    _assert_matches(got_s, want_s, "state")
    assert_bitwise([got_p[4], got_p[5]], [want_p[4], want_p[5]], "fp32 norm weight/bias")


def test_chunks_mixing_bf16_and_fp16_parameters(kernel) -> None:
    """bf16 and fp16 parameters in one chunk (one kernel call takes one dtype pair): each dtype's
    views get their own call, and the steps still go up once per parameter."""

    def run(kernel_name: str):
        gen = torch.Generator().manual_seed(7)
        shapes_dtypes = [((300,), torch.bfloat16), ((70, 3), torch.float16), ((129,), torch.bfloat16),
                         ((64,), torch.float16)]
        params = [torch.nn.Parameter((0.1 * torch.randn(s, generator=gen)).to(d)) for s, d in shapes_dtypes]
        opt = CPUOffloadAdamW(params, lr=1e-2, weight_decay=0.1,
                              settings=_settings(kernel_name, chunk=1 << 20))
        kernels = []
        for step in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            opt.step()
            kernels.append(opt.last_stats.kernel)
        assert opt.last_stats.num_chunks == 1
        out = [p.detach().clone() for p in params], _state(opt, params), kernels
        opt.close()
        return out

    want_p, want_s, _ = run("torch")
    got_p, got_s, kernels = run("fused-mp")
    assert set(kernels) == {"fused-mp"}
    assert [t.item() for t in got_s[3::4]] == [5.0] * 4  # step tensors: once per parameter
    _assert_matches(got_p, want_p, "params")
    _assert_matches(got_s, want_s, "state")


class _CountingPrepare(HostTransport):
    """The host transport, noting per submitted job whether its calls were prepared at submit."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared: list[bool] = []

    def prepare(self, job, calls) -> None:
        super().prepare(job, calls)
        self.prepared.append(job.progress.calls is not None)


class _FailingPrepare(HostTransport):
    def prepare(self, job, calls) -> None:
        raise RuntimeError("prepare failed")


def _pipeline_steps(transport: HostTransport, steps: int = 3) -> list[torch.Tensor]:
    """A few steps of fused-mp jobs built as step() builds them (a reused item list per chunk,
    each step's gradients put in), on a pipeline with ``transport``; the resulting tensors."""
    gen = torch.Generator().manual_seed(5)
    params = [(0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16) for n in (3000, 700, 5000)]
    slabs = HostSlabs([[p.shape for p in params]])
    for i, p in enumerate(params):
        slabs.flat("master", i).copy_(p.float())
    chunks = plan_chunks(list(slabs.slots), 3000)
    step_tensors = [new_step_tensor() for _ in params]
    hyper = Hyper(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8)
    items = {c.index: [Item(v, params[v.slot], None, step_tensors[v.slot], KIND_MP) for v in c.views]
             for c in chunks}
    pipe = Pipeline(slabs, transport, name="prepare-test")
    try:
        for _ in range(steps):
            grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]
            for c in chunks:
                for it in items[c.index]:
                    it.grad = grads[it.view.slot]
                pipe.submit(ChunkJob(chunk=c.index, items=items[c.index], hyper=hyper, threads=1,
                                     update=True, materialize=True))
            result = pipe.drain()
            assert result.error is None, result.error
    finally:
        pipe.close()
    return params + [slabs.flat(k, i) for k in SLAB_KINDS for i in range(len(params))] + step_tensors


def test_kernel_calls_prepared_at_submit_or_by_the_worker_agree(kernel, caplog) -> None:
    """On the CPU, step()'s fused-mp jobs get their kernel arguments from the submitting thread;
    when that fails the worker builds them itself (and would report a real problem)."""
    seen = {}

    def inspect(opt: CPUOffloadAdamW) -> None:
        seen["prepared"] = dict(opt._pipeline.calls.templates)
        seen["chunks"] = opt.last_stats.num_chunks

    _run(torch.bfloat16, "fused-mp", chunk=3000, inspect=inspect)
    assert len(seen["prepared"]) >= seen["chunks"] > 1  # an entry per chunk a step ran
    assert all(e.direct for e in seen["prepared"].values()), "step()'s fused-mp jobs were not prepared at submit"

    counting = _CountingPrepare()
    want = _pipeline_steps(counting)
    assert counting.prepared and all(counting.prepared), "fused-mp step jobs were not prepared at submit"
    with caplog.at_level(logging.WARNING, logger="offload.pipeline._pipeline"):
        got = _pipeline_steps(_FailingPrepare())
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "the worker prepares it instead" in warnings[0], warnings
    assert_bitwise(got, want, "params and state")


@pytest.mark.parametrize("kernel_name", ["torch", "fused-mp"])
def test_parameter_made_non_contiguous_is_refused_before_any_update(kernel, kernel_name) -> None:
    """A parameter whose .data became non-contiguous after construction (e.g. a memory-format
    change) is an error naming it, raised before anything is written: never an update written
    into a temporary copy while the parameter keeps its old value."""
    weight = torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16))
    bias = torch.nn.Parameter(torch.randn(64).to(torch.bfloat16))
    opt = CPUOffloadAdamW([weight, bias], lr=1e-2, settings=_settings(kernel_name))
    for p in (weight, bias):
        p.grad = torch.randn_like(p)
    opt.step()
    weight.data = weight.data.t().contiguous().t()  # same values, transposed strides
    assert not weight.is_contiguous()
    before = [t.clone() for t in (weight, bias, *_state(opt, [weight, bias]))]
    with pytest.raises(RuntimeError, match=r"parameter 0 \(as the optimizer reads it: shape \(64, 64\), strides "
                                           r"\(1, 64\)\) no longer lies in memory as it did when the optimizer was built"):
        opt.step()
    after = [weight, bias, *_state(opt, [weight, bias])]
    assert_bitwise(after, before, "parameters and state after the refused step")
    opt.close()


def test_fp32_model_with_fused_mp_set_is_torch_exact(kernel) -> None:
    """fp32 parameters go to the kernel's fp32 entry point, bitwise equal to stock fused AdamW."""
    model = make_model(torch.float32)
    reference = copy.deepcopy(model)
    opt = CPUOffloadAdamW(param_groups(model), settings=_settings("fused-mp"))
    assert opt.settings.kernel == "fused-mp"
    kernels = _train(model, opt, _schedule(opt), range(STEPS))
    assert set(kernels) == {"fused-mp"}
    ref = torch.optim.AdamW(param_groups(reference), fused=True)
    _train(reference, ref, _schedule(ref), range(STEPS))
    assert_bitwise(list(model.parameters()), list(reference.parameters()), "fp32 params")
    opt.close()


def test_resume_from_state_dict(kernel) -> None:
    """12 fused-mp steps, save, a new model and optimizer load and run 18 more: equals 30 steps of
    the torch path without the interruption."""
    (want_p, want_s), _, _ = _run(torch.bfloat16, "torch")

    model = make_model(torch.bfloat16)
    opt = CPUOffloadAdamW(param_groups(model), settings=_settings("fused-mp"))
    sched = _schedule(opt)
    _train(model, opt, sched, range(12))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    opt.close()
    buf.seek(0)
    saved = torch.load(buf)

    model2 = make_model(torch.bfloat16, seed=123)  # different init: everything comes from the file
    model2.load_state_dict(saved["model"])
    opt2 = CPUOffloadAdamW(param_groups(model2), settings=_settings("fused-mp", chunk=2048))
    sched2 = _schedule(opt2)  # before loading: its constructor resets the groups' lr
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    _train(model2, opt2, sched2, range(12, STEPS))
    params = list(model2.parameters())
    _assert_matches([p.detach() for p in params], want_p, "params after resume")
    _assert_matches(_state(opt2, params), want_s, "state after resume")
    opt2.close()


def test_switching_kernel_mid_run(kernel) -> None:
    (want_p, want_s), _, _ = _run(torch.bfloat16, "torch")

    model = make_model(torch.bfloat16)
    opt = CPUOffloadAdamW(param_groups(model), settings=_settings("torch"))
    order = ["fused-mp", "torch", "fused-mp"]

    def switch(step: int) -> None:
        if step % 10 == 0:
            opt.apply_settings(_settings(order[step // 10], chunk=(1 << 10) + 64 * step))

    kernels = _train(model, opt, _schedule(opt), range(STEPS), on_step=switch)
    assert kernels == ["fused-mp"] * 10 + ["torch"] * 10 + ["fused-mp"] * 10
    params = list(model.parameters())
    _assert_matches([p.detach() for p in params], want_p, "params")
    _assert_matches(_state(opt, params), want_s, "state")
    opt.close()


def test_fallback_when_the_kernel_is_unavailable(caplog, tmp_path) -> None:
    """A build that cannot happen (missing source): one WARNING with the reason, torch path, same
    results as kernel="torch"."""
    missing = KernelSet(loader=KernelLoader(source=tmp_path / "missing.cpp", cache_root=tmp_path))
    (want_p, want_s), _, _ = _run(torch.bfloat16, "torch")
    with caplog.at_level(logging.WARNING):
        (got_p, got_s), kernels, settings = _run(torch.bfloat16, "fused-mp", kernels=missing)
        model = make_model(torch.bfloat16)
        opt = CPUOffloadAdamW(param_groups(model), settings=_settings("torch"), kernels=missing)
        opt.apply_settings(_settings("fused-mp"))
        assert opt.settings.kernel == "torch"
        opt.close()
    assert settings.kernel == "torch" and set(kernels) == {"torch"}
    assert_bitwise(got_p, want_p, "params")
    assert_bitwise(got_s, want_s, "state")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "missing.cpp" in warnings[0].getMessage() and "torch path" in warnings[0].getMessage()


class _NoCompiler:
    """An extension loader that cannot build (as without a C++ compiler)."""

    def get(self):
        return None, "no C++ compiler: test"


def test_fallback_when_fused_mp_available_says_no() -> None:
    model = make_model(torch.bfloat16)
    opt = CPUOffloadAdamW(param_groups(model), settings=_settings("fused-mp"),
                          kernels=KernelSet(loader=_NoCompiler()))
    assert opt.settings.kernel == "torch"
    assert set(_train(model, opt, _schedule(opt), range(2))) == {"torch"}
    opt.close()


def test_bad_kernel_name_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"kernel='fused'.*expected one of \('torch', 'fused-mp'\)"):
        OffloadSettings(kernel="fused")  # type: ignore[arg-type]


def test_loss_curves_match_over_200_steps_of_the_reference_trainer_model(kernel) -> None:
    """The reference trainer's GPT (narrowed so it runs in seconds), bf16, 200 steps with each
    kernel from one init: the same loss curve."""
    from bench.train.model import GPT, GPTConfig, SyntheticTokens

    cfg = GPTConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=2, max_seq_len=32)

    def curve(kernel_name: str) -> torch.Tensor:
        torch.manual_seed(0)
        model = GPT(cfg).to(torch.bfloat16)
        opt = CPUOffloadAdamW(
            model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
            settings=_settings(kernel_name, chunk=4096),
        )
        data = SyntheticTokens(vocab_size=cfg.vocab_size, batch_size=4, seq_len=32, seed=0)
        losses = []
        for _ in range(200):
            x, y = data.next_batch()
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        assert opt.last_stats.kernel == kernel_name
        opt.close()
        return torch.tensor(losses)

    reference, fused = curve("torch"), curve("fused-mp")
    assert reference[-20:].mean() < reference[:20].mean() - 0.5, "the model did not train"
    if bitwise_matches_torch():
        assert torch.equal(fused, reference)
    else:  # an ulp per step at most; training noise must not amplify it
        torch.testing.assert_close(fused, reference, rtol=1e-2, atol=1e-2)


# ---- CUDA: pinned low-precision staging in both directions ------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_fused_mp_equals_torch_path(kernel, dtype, overlap) -> None:
    def run(kernel_name: str):
        model = make_model(dtype, device="cuda")
        opt = CPUOffloadAdamW(
            param_groups(model), settings=_settings(kernel_name, chunk=3000), overlap_backward=overlap
        )
        kernels = _train(model, opt, _schedule(opt), range(12), device="cuda")
        torch.cuda.synchronize()
        params = list(model.parameters())
        out = [p.detach().cpu() for p in params], [t.clone() for t in _state(opt, params)]
        opt.close()
        return out, kernels

    (want_p, want_s), _ = run("torch")
    (got_p, got_s), kernels = run("fused-mp")
    assert set(kernels) == {"fused-mp"}
    _assert_matches(got_p, want_p, "cuda params")
    _assert_matches(got_s, want_s, "cuda state")


# ---- autotuner: the kernel knob ---------------------------------------------------------------


class _FakeAgreement:
    """All-gather answers of a node whose other rank says ``others``."""

    def __init__(self, others: bool) -> None:
        self.others = others
        self.calls = 0

    def all_gather(self, obj, *, step, what):
        self.calls += 1
        return [obj, self.others]


def test_agreed_kernels_needs_every_rank(kernel) -> None:
    from offload.tuning._glue import agreed_kernels

    yes = lambda: (True, "ok")  # noqa: E731
    assert agreed_kernels(has_lowp=True, timeout_s=5, available=yes, bitwise=lambda: True,
                          agreement=_FakeAgreement(True)) == ("torch", "fused-mp")
    other_fails = _FakeAgreement(False)
    assert agreed_kernels(has_lowp=True, timeout_s=5, available=yes, bitwise=lambda: True,
                          agreement=other_fails) == ()
    assert other_fails.calls == 1
    # Rank-identical conditions false: no exchange at all (every rank skips it alike).
    for has_lowp, bitwise in ((False, True), (True, False)):
        fake = _FakeAgreement(True)
        assert agreed_kernels(has_lowp=has_lowp, timeout_s=5, available=yes,
                              bitwise=lambda b=bitwise: b, agreement=fake) == ()
        assert fake.calls == 0


def test_search_space_has_a_kernel_knob_and_fewer_chunks() -> None:
    from offload.tuning._glue import MAX_CHUNK_CANDIDATES_WITH_KERNEL, offload_search_space

    args = dict(max_threads=16, baseline_threads=16, largest_slab=200 << 20,
                baseline_chunk=4 << 20, fixed_threads=False)
    plain = offload_search_space(**args)
    with_kernel = offload_search_space(**args, kernels=("torch", "fused-mp"))
    assert "kernel" not in plain.names
    knobs = dict(zip(with_kernel.names, with_kernel.knobs))
    assert knobs["kernel"].values == ("torch", "fused-mp") and knobs["kernel"].prefer == "low"
    chunks = knobs["chunk_numel"].values
    assert len(chunks) <= MAX_CHUNK_CANDIDATES_WITH_KERNEL + 1 and 4 << 20 in chunks
    assert len(with_kernel) < 2 * len(plain)
    with pytest.raises(ValueError, match="kernel 'fast'"):
        offload_search_space(**args, kernels=("torch", "fast"))


def _tuned_run(dtype, *, settings: OffloadSettings, steps: int = 34, tmp_path=None):
    from autotune import AutotuneConfig

    model = make_model(dtype)
    config = AutotuneConfig(probe_steps=30, use_cache=False, finalists=2, final_rounds=1)
    opt = CPUOffloadAdamW(param_groups(model), settings=settings, autotune=config)
    kernels = _train(model, opt, _schedule(opt), range(steps))
    out = [p.detach().clone() for p in model.parameters()]
    space, summary = opt.tuner.space, opt.tuner.summary()
    opt.close()
    return out, kernels, space, summary


def test_tuner_probes_the_kernel_on_bf16_and_never_changes_the_math(kernel) -> None:
    if not bitwise_matches_torch():
        pytest.skip("the kernel knob exists only where fused-mp is bitwise equal to the torch path")
    got, kernels, space, summary = _tuned_run(
        torch.bfloat16, settings=OffloadSettings(chunk_numel=1 << 10, kernel="torch"))
    assert "kernel" in space.names
    assert summary["baseline"]["kernel"] == "torch", "the baseline is the kernel the user set"
    assert set(kernels) == {"torch", "fused-mp"}, "both kernels were probed"
    model = make_model(torch.bfloat16)
    opt = CPUOffloadAdamW(param_groups(model), settings=_settings("torch"))
    _train(model, opt, _schedule(opt), range(34))
    assert_bitwise(got, list(model.parameters()), "tuned params vs untuned torch path")
    opt.close()


def test_tuner_keeps_the_users_kernel_as_baseline_and_fp32_has_no_knob(kernel) -> None:
    if bitwise_matches_torch():
        _, _, space, summary = _tuned_run(
            torch.bfloat16, settings=OffloadSettings(chunk_numel=1 << 10, kernel="fused-mp"), steps=2
        )
        assert summary["baseline"]["kernel"] == "fused-mp"
    # fp32: no knob (both kernels are in place and equal); the kernel set ("auto") just runs.
    _, kernels, space, _ = _tuned_run(
        torch.float32, settings=OffloadSettings(chunk_numel=1 << 10, kernel="fused-mp"), steps=2
    )
    assert "kernel" not in space.names and set(kernels) == {"fused-mp"}


def _agree_worker(rank: int, world_size: int, *, unavailable_rank: int) -> list[str]:
    from offload.tuning._glue import agreed_kernels

    return list(agreed_kernels(
        has_lowp=True, timeout_s=30, available=lambda: (rank != unavailable_rank, "test"),
        bitwise=lambda: True,
    ))


@pytest.mark.slow
def test_agreed_kernels_over_gloo_ranks() -> None:
    """Two real ranks: when the kernel cannot run on one, neither gets the knob."""
    from _dist_util import run_workers

    for unavailable_rank, expected in ((-1, ["torch", "fused-mp"]), (1, [])):
        results = run_workers(_agree_worker, world_size=2, kwargs={"unavailable_rank": unavailable_rank},
                              timeout_s=90)
        assert all(r.ok for r in results), [r.describe() for r in results]
        assert [r.value for r in results] == [expected, expected]


# ---- bench flags --------------------------------------------------------------------------------


def test_trainer_kernel_flag_gives_the_same_parameters(kernel, tmp_path, monkeypatch) -> None:
    import json

    from bench.train import _main as train

    monkeypatch.delenv("OFFLOAD_AUTOTUNE_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    threads = torch.get_num_threads()
    tiny = ["--model-size", "tiny", "--device", "cpu", "--batch-size", "4", "--seq-len", "32",
            "--optim-cpu-offload", "--dtype", "bf16", "--steps", "4"]
    summaries = {}
    try:
        for name in ("torch", "fused-mp"):
            out = tmp_path / f"{name}.json"
            assert train.main([*tiny, "--kernel", name, "--summary-json", str(out)]) == 0
            summaries[name] = json.loads(out.read_text())
    finally:
        torch.set_num_threads(threads)
    assert [s["ranks"][0]["kernel"] for s in summaries.values()] == ["torch", "fused-mp"]
    if bitwise_matches_torch():
        assert summaries["torch"]["ranks"][0]["param_sha256"] == summaries["fused-mp"]["ranks"][0]["param_sha256"]
    with pytest.raises(SystemExit):
        train.main(["--model-size", "tiny", "--kernel", "fused-mp"])  # needs --optim-cpu-offload


def test_bandwidth_byte_accounting_per_kernel() -> None:
    from bench.membus import bandwidth

    assert bandwidth.step_bytes_per_param("bf16", "fused-mp") == {
        "d2h": 0, "adam_kernel": 28, "materialize": 0, "total": 28}
    assert bandwidth.step_bytes_per_param("bf16", "torch")["total"] == 40
    assert bandwidth.step_bytes_per_param("fp32", "fused-mp")["total"] == 28  # fp32 on the CPU: in place
