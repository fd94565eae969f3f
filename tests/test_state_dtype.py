"""``state_dtype=torch.bfloat16``: the moments live in host memory as bf16 (issue 26).

The stated reference, bitwise: per step, upcast ``exp_avg`` and ``exp_avg_sq`` to fp32, run
exactly today's update in fp32 (torch's ``AdamW(fused=True)`` on an fp32 master), then round both
moments to bf16, nearest-even. :class:`Bf16MomentsReference` is that, as test code. Checked for
fp32, bf16 and fp16 models, overlap off and on, both kernels, several thread counts and chunk
sizes; then the kernel alone (in place and out of place), the host bytes, checkpoints both ways.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import assert_bitwise

from offload import CPUOffloadAdamW, OffloadSettings
from offload.kernels._adamw import Hyper, mixed_precision_adamw_, native_adamw_f32_
from test_optimizer_numerics import MixedPrecisionReference

pytestmark = pytest.mark.usefixtures("single_threaded_main")

LR, WD = 1e-2, 0.1


class Bf16MomentsReference(MixedPrecisionReference):
    """fp32 master copies stepped by ``torch.optim.AdamW(fused=True)``; after every step both
    moments are rounded to bf16 (and kept as the fp32 values of those bf16 numbers); the master is
    cast back into the model (for an fp32 model the master is the parameter's value)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, groups=[{"params": list(model.parameters()), "lr": LR, "weight_decay": WD}])

    def after_step(self) -> None:
        for st in self.opt.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                st[key].copy_(st[key].to(torch.bfloat16))


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 40)).to(dtype)


def _train(model, opt, dtype, steps=range(6)) -> None:
    for step in steps:
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step)).to(dtype)
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


def _ours(model, **kwargs) -> CPUOffloadAdamW:
    settings = OffloadSettings(threads=kwargs.pop("threads", 2), chunk_numel=kwargs.pop("chunk_numel", 1024),
                               kernel=kwargs.pop("kernel", "auto"))
    return CPUOffloadAdamW(model.parameters(), lr=LR, weight_decay=WD, state_dtype=torch.bfloat16,
                           settings=settings, **kwargs)


def _check(model, opt, ref_model, ref) -> None:
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")
    for key in ("exp_avg", "exp_avg_sq"):
        got = [opt.state[p][key] for p in model.parameters()]
        assert all(t.dtype == torch.bfloat16 for t in got), key
        assert_bitwise([t.float() for t in got], [ref.state(r)[key] for r in ref_model.parameters()], key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("overlap", [False, True], ids=["off", "overlap"])
@pytest.mark.parametrize("kernel", ["fused-mp", "torch"])
def test_bf16_moments_are_the_stated_reference_bitwise(dtype: torch.dtype, overlap: bool, kernel: str) -> None:
    ref_model, model = _model(dtype), _model(dtype)
    ref = Bf16MomentsReference(ref_model)
    opt = _ours(model, overlap_backward=overlap, kernel=kernel)
    _train(ref_model, ref, dtype)
    _train(model, opt, dtype)
    if overlap:
        assert opt.last_stats.committed_chunks > 0
    _check(model, opt, ref_model, ref)
    opt.close()


@pytest.mark.parametrize(("threads", "chunk_numel"), [(1, 1024), (2, 4096), (2, 1 << 20)])
def test_any_thread_count_and_chunk_size_gives_the_same_bits(threads: int, chunk_numel: int) -> None:
    ref_model, model = _model(torch.bfloat16), _model(torch.bfloat16)
    ref = Bf16MomentsReference(ref_model)
    opt = _ours(model, threads=threads, chunk_numel=chunk_numel)
    _train(ref_model, ref, torch.bfloat16)
    _train(model, opt, torch.bfloat16)
    _check(model, opt, ref_model, ref)
    opt.close()


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("out_of_place", [False, True], ids=["in_place", "into"])
@pytest.mark.parametrize("n", [1, 17, 1000, 16384 * 2 + 9, 1 << 19])
def test_kernel_with_bf16_moments_is_the_fp32_kernel_then_rounded(param_dtype, out_of_place, n) -> None:
    """The native kernels read and write bf16 moments in their single pass; the result is the
    fp32-moment kernel's, moments rounded to nearest-even (a GradScaler scale included)."""
    g = torch.Generator().manual_seed(n)
    master = torch.randn(n, generator=g) * 0.1
    grad = (torch.randn(n, generator=g) * 1e-2).to(param_dtype)
    exp_avg = (torch.randn(n, generator=g) * 1e-3).to(torch.bfloat16)
    exp_avg_sq = (torch.rand(n, generator=g) * 1e-5).to(torch.bfloat16)
    hyper = Hyper(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, grad_scale=torch.tensor(1024.0))

    def run(m, ea, eas, **kw):
        step = torch.tensor(4.0)
        if param_dtype == torch.float32:
            native_adamw_f32_([m], [grad], [ea], [eas], [step], steps_to_increment=[step], hyper=hyper, **kw)
            return m
        p = kw.pop("out", master.to(param_dtype))
        mixed_precision_adamw_([p], [grad], [m], [ea], [eas], [step], steps_to_increment=[step], hyper=hyper, **kw)
        return p

    want_m, want_ea, want_eas = master.clone(), exp_avg.float(), exp_avg_sq.float()
    want_p = run(want_m, want_ea, want_eas)
    got_m, got_ea, got_eas = master.clone(), exp_avg.clone(), exp_avg_sq.clone()
    if out_of_place:
        into = [torch.empty(n), torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)]
        got_p = run(got_m, got_ea, got_eas, into=into)
        assert torch.equal(got_m, master) and torch.equal(got_ea, exp_avg)  # the committed state only read
        got_m, got_ea, got_eas = into
        got_p = got_m if param_dtype == torch.float32 else got_p
    else:
        got_p = run(got_m, got_ea, got_eas)
    assert_bitwise([got_m, got_ea, got_eas, got_p],
                   [want_m, want_ea.to(torch.bfloat16), want_eas.to(torch.bfloat16), want_p], "state")


@pytest.mark.parametrize(("dtype", "bytes_per_param"), [(torch.float32, 4.0), (torch.bfloat16, 8.0)], ids=str)
def test_host_state_bytes_per_parameter(dtype: torch.dtype, bytes_per_param: float) -> None:
    """fp32 CPU model: the parameter is its master, 2 + 2 B of moments; bf16: 4 + 2 + 2 (12 with
    fp32 moments)."""
    model = _model(dtype)
    opt = _ours(model)
    _train(model, opt, dtype, range(1))
    storages = {}
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            t = opt.state[p][key]
            if t.data_ptr() != p.data_ptr():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    numel = sum(p.numel() for p in model.parameters())
    assert sum(storages.values()) / numel == pytest.approx(bytes_per_param, rel=0.02)  # (64-element alignment)
    opt.close()


def test_checkpoints_move_between_fp32_and_bf16_moments(caplog: pytest.LogCaptureFixture) -> None:
    fp32_model, bf16_model = _model(torch.bfloat16), _model(torch.bfloat16)
    fp32_opt = CPUOffloadAdamW(fp32_model.parameters(), lr=LR, weight_decay=WD)
    _train(fp32_model, fp32_opt, torch.bfloat16, range(3))
    saved = fp32_opt.state_dict()
    bf16_model.load_state_dict(fp32_model.state_dict())
    opt = _ours(bf16_model)
    with caplog.at_level(logging.INFO, logger="offload.state._state_io"):
        opt.load_state_dict(saved)
    assert "loaded moments rounded to torch.bfloat16" in caplog.text
    mine = opt.state_dict()["state"]
    for i, st in saved["state"].items():
        assert mine[i]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(mine[i]["exp_avg"], st["exp_avg"].to(torch.bfloat16))  # nearest-even
        assert torch.equal(mine[i]["master_param"], st["master_param"])
    # and back: bf16 moments into an fp32-moment optimizer are exact
    back = CPUOffloadAdamW(_model(torch.bfloat16).parameters(), lr=LR, weight_decay=WD)
    back.load_state_dict(opt.state_dict())
    for i, st in back.state_dict()["state"].items():
        assert st["exp_avg"].dtype == torch.float32 and torch.equal(st["exp_avg"], mine[i]["exp_avg"].float())
    for o in (fp32_opt, opt, back):
        o.close()


def test_a_state_dtype_other_than_fp32_or_bf16_is_refused() -> None:
    with pytest.raises(ValueError, match=r"state_dtype=torch.float16: expected torch.float32 or torch.bfloat16"):
        CPUOffloadAdamW(_model(torch.float32).parameters(), state_dtype=torch.float16)


# ---------------------------------------------------------------- stochastic rounding
def _splitmix64(x: int) -> int:
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def _bits(seed: int, step: int, slot: int, n: int) -> "np.ndarray":
    """The documented random bits of elements 0..n-1 of parameter ``slot`` at ``step``: numpy
    uint32 arithmetic (wrapping products), written apart from the library's."""
    import numpy as np

    key = _splitmix64(seed ^ _splitmix64(((step << 32) ^ slot) & ((1 << 64) - 1))) & 0xFFFFFFFF
    x = np.arange(n, dtype=np.uint32) ^ np.uint32(key)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x85EBCA6B)
        x ^= x >> np.uint32(13)
        x *= np.uint32(0xC2B2AE35)
        x ^= x >> np.uint32(16)
    return x


def _stochastic(values: torch.Tensor, r16: "np.ndarray") -> torch.Tensor:
    import numpy as np

    b = values.reshape(-1).numpy().view(np.uint32).astype(np.uint64)
    t = torch.from_numpy((((b + r16.astype(np.uint64)) & 0xFFFF0000).astype(np.uint32)).view(np.float32))
    return torch.where(torch.isnan(values.reshape(-1)), values.reshape(-1), t).reshape(values.shape)


class StochasticReference(Bf16MomentsReference):
    """The stated reference with ``state_rounding="stochastic"``: moments of parameter ``slot``
    (its position in the optimizer's parameters) rounded with the documented bits."""

    def __init__(self, model: torch.nn.Module, seed: int) -> None:
        super().__init__(model)
        self.seed = seed

    def after_step(self) -> None:
        for slot, p in enumerate(self.params):
            st = self.opt.state[self.master[p]]
            h = _bits(self.seed, int(st["step"]), slot, p.numel())
            st["exp_avg"].copy_(_stochastic(st["exp_avg"], h & 0xFFFF))
            st["exp_avg_sq"].copy_(_stochastic(st["exp_avg_sq"], (h >> 16) & 0xFFFF))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("overlap", [False, True], ids=["off", "overlap"])
@pytest.mark.parametrize(("kernel", "threads", "chunk_numel"),
                         [("fused-mp", 2, 1024), ("fused-mp", 1, 4096), ("torch", 2, 1024)])
def test_stochastic_rounding_is_the_documented_function_bitwise(dtype, overlap, kernel, threads, chunk_numel) -> None:
    ref_model, model = _model(dtype), _model(dtype)
    ref = StochasticReference(ref_model, seed=7)
    opt = _ours(model, overlap_backward=overlap, kernel=kernel, threads=threads, chunk_numel=chunk_numel,
                state_rounding="stochastic", state_rounding_seed=7)
    _train(ref_model, ref, dtype)
    _train(model, opt, dtype)
    _check(model, opt, ref_model, ref)
    opt.close()


def test_stochastic_rounding_differs_from_nearest_and_is_unbiased() -> None:
    """The same loop with nearest and with stochastic rounding gives other moments; and rounding
    one value many times averages to it (within 1% of a bf16 step: 2**20 draws)."""
    from offload.kernels._rounding import round_moments_, sr_key

    runs = []
    for rounding in ("nearest", "stochastic"):
        model = _model(torch.bfloat16)
        opt = _ours(model, state_rounding=rounding)
        _train(model, opt, torch.bfloat16, range(3))
        runs.append([opt.state[p]["exp_avg"].clone() for p in model.parameters()])
        opt.close()
    assert any(not torch.equal(a, b) for a, b in zip(*runs))
    x = torch.full((1 << 20,), 1.0 + 3 * 2.0 ** -10)  # between two bf16 numbers: 1 + 2**-7 * (0.375)
    ea, eas = torch.empty(x.numel(), dtype=torch.bfloat16), torch.empty(x.numel(), dtype=torch.bfloat16)
    round_moments_(ea, eas, x, x, key=sr_key(3, 1.0, 0), start=0)
    ulp = 2.0 ** -7
    for t in (ea, eas):
        assert set(t.float().unique().tolist()) == {1.0, 1.0 + ulp}
        assert abs(t.float().mean().item() - x[0].item()) < 0.01 * ulp


def test_stochastic_rounding_needs_bf16_moments() -> None:
    with pytest.raises(ValueError, match=r"state_rounding='stochastic' rounds bf16 moments"):
        CPUOffloadAdamW(_model(torch.float32).parameters(), state_rounding="stochastic")
    with pytest.raises(ValueError, match=r"state_rounding='up': expected 'nearest' or 'stochastic'"):
        CPUOffloadAdamW(_model(torch.float32).parameters(), state_dtype=torch.bfloat16, state_rounding="up")


def test_the_tuner_keys_its_cache_on_bf16_moments() -> None:
    """bf16 moments move fewer bytes per step (another optimum): the tuner's workload, and so its
    cache key, says so; fp32 moments add nothing, so cache entries written before still match."""
    from autotune import AutotuneConfig

    keys = {}
    for state_dtype in (torch.float32, torch.bfloat16):
        opt = CPUOffloadAdamW(_model(torch.bfloat16).parameters(), state_dtype=state_dtype,
                              autotune=AutotuneConfig(use_cache=False, probe_steps=16))
        keys[state_dtype] = opt.tuner.workload
        opt.close()
    assert "state_dtype" not in keys[torch.float32]
    assert keys[torch.bfloat16] == {**keys[torch.float32], "state_dtype": "torch.bfloat16"}
