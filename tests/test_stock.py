"""``offload.tune_step_threads``: a stock optimizer whose CPU step runs under a tuned thread count.

The wrapper must behave as the wrapped optimizer for everything that reads or writes optimizer data
(state_dict, hooks, LR schedulers, torch.distributed.checkpoint helpers), give bitwise the
unwrapped results at every thread count it probes, and refuse what it cannot tune with one clear
error. Tuning decisions use an injected clock (fixed step times per thread count), so the winner
is certain; the real clock is only exercised by the benchmark.
"""

from __future__ import annotations

import logging

import copy
import io
import json
import pickle
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

from autotune import AutotuneConfig, fingerprint
from conftest import assert_bitwise, batch, make_model, param_groups
from offload import (
    CPUOffloadAdamW,
    StepThreadsError,
    ThreadPlan,
    ThreadTunedOptimizer,
    thread_limit,
    tune_step_threads,
)
from offload._stock import THREAD_INVARIANT_OPTIMIZERS, step_threads_space, step_threads_workload

pytestmark = pytest.mark.usefixtures("single_threaded_main")

#: Fake step seconds per intra-op thread count: 2 threads is fastest, the static plan (4) is not.
COSTS = {1: 3.0, 2: 1.0, 4: 2.0}
CONFIG = dict(probe_steps=26, warmup_steps=1, measure_steps=2, finalists=2, final_rounds=1, timeout_s=30.0)


def plan(threads: int = 4) -> ThreadPlan:
    """A one-rank plan of ``threads`` (the thread ladder is then 1, 2, 4)."""
    return ThreadPlan(threads=threads, reason="test plan", source="plan", cpus=frozenset({0}), local_world_size=1,
                      planned_threads=threads, local_threads=(threads,))


class FakeClock:
    """Each call advances by the cost of the calling step's thread count: a step then lasts ``COSTS[threads]``."""

    def __init__(self, costs: dict[int, float] = COSTS) -> None:
        self.t = 0.0
        self.costs = costs

    def __call__(self) -> float:
        self.t += self.costs[torch.get_num_threads()]
        return self.t


def config(tmp_path: Path, **kw: Any) -> AutotuneConfig:
    return AutotuneConfig(**{**CONFIG, "cache_path": str(tmp_path / "cache.json"), **kw})


def wrap(opt: torch.optim.Optimizer, tmp_path: Path, **kw: Any) -> ThreadTunedOptimizer:
    return tune_step_threads(opt, autotune=config(tmp_path, **kw), plan=plan(), clock=FakeClock())


def wide_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Large enough (310k elements in one weight, odd sizes) that a step splits over threads."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(300, 1031), nn.GELU(), nn.Linear(1031, 29)).to(dtype)


def wide_loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return model(torch.randn(6, 300, generator=g).to(next(model.parameters()).dtype)).float().pow(2).mean()


def tiny_loss(model: nn.Module, step: int) -> torch.Tensor:
    return model(batch(step))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, loss_fn: Callable = tiny_loss,
          first: int = 0) -> None:
    for step in range(first, first + steps):
        loss_fn(model, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def record_threads(opt: torch.optim.Optimizer) -> list[int]:
    seen: list[int] = []
    opt.register_step_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    return seen


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1, fused=True),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1, foreach=True),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=3e-2, momentum=0.9, nesterov=True, weight_decay=1e-4),
}


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_bitwise_equal_to_unwrapped_across_probed_thread_counts(name: str, tmp_path: Path) -> None:
    ref_model, model = wide_model(), wide_model()
    ref = OPTIMIZERS[name](ref_model.parameters())
    opt = wrap(OPTIMIZERS[name](model.parameters()), tmp_path)
    used = record_threads(opt)
    for step in range(30):
        with thread_limit(1):
            train(ref_model, ref, 1, wide_loss, first=step)
        train(model, opt, 1, wide_loss, first=step)
        assert_bitwise(list(model.parameters()), list(ref_model.parameters()), f"{name} step {step}")
    assert opt.tuner is not None and opt.tuner.state == "locked"
    assert set(used) == {1, 2, 4}, used  # every rung of the ladder ran real steps
    assert opt.tuner.summary()["winner"] == {"threads": 2} and opt.threads == 2
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert opt.state[p].keys() == ref.state[q].keys()
        assert_bitwise([v for v in opt.state[p].values() if torch.is_tensor(v)],
                       [v for v in ref.state[q].values() if torch.is_tensor(v)], f"{name} state")


@pytest.mark.parametrize("name,options", THREAD_INVARIANT_OPTIMIZERS,
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for n, o in THREAD_INVARIANT_OPTIMIZERS])
def test_torch_cpu_optimizer_is_thread_count_invariant(name: str, options: dict[str, Any]) -> None:
    """The premise of the wrapper, per optimizer: torch's CPU step gives the same bits at 1-4 threads.
    A torch build where this breaks fails here, naming the optimizer (documented in offload/_stock.py)."""
    results = []
    for threads in (1, 2, 3, 4):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn((1 << 18) + 37)), nn.Parameter(torch.randn(333, 77))]
        opt = getattr(torch.optim, name)(params, lr=1e-2, **options)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            with thread_limit(threads):
                opt.step()
        results.append([p.detach().clone() for p in params])
    for threads, got in zip((2, 3, 4), results[1:]):
        assert_bitwise(got, results[0], f"torch.optim.{name}({options}) at {threads} threads vs 1")


@pytest.mark.parametrize("name,options", THREAD_INVARIANT_OPTIMIZERS,
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for n, o in THREAD_INVARIANT_OPTIMIZERS])
def test_claimed_optimizer_is_invariant_at_language_model_shapes(name: str, options: dict[str, Any]) -> None:
    """Tuned at 1 and at 2 threads, bitwise equal on embedding-like weights: rows past 65536, where
    a reduction over the rows splits over threads (Adafactor's did, on a 50257-row embedding)."""
    results = []
    for threads in (1, 2):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn((1 << 16) + 17, 4)), nn.Parameter(torch.randn(50257, 3))]
        opt = tune_step_threads(getattr(torch.optim, name)(params, lr=1e-2, **options), autotune=False,
                                plan=plan(threads))
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        results.append([p.detach().clone() for p in params])
    assert_bitwise(results[1], results[0], f"tune_step_threads(torch.optim.{name}({options})) at 2 threads vs 1")


def test_refuses_optimizers_whose_step_reduces_across_elements() -> None:
    params = [nn.Parameter(torch.zeros(50257, 3))]
    with pytest.raises(StepThreadsError, match=r"torch\.optim\.Adafactor is not thread-count invariant: "
                                               r"its step averages .* tune an elementwise optimizer"):
        tune_step_threads(torch.optim.Adafactor(params), autotune=False, plan=plan(2))
    hf = pytest.importorskip("transformers.optimization")
    with pytest.raises(StepThreadsError, match=r"transformers\.optimization\.Adafactor is not thread-count invariant"):
        tune_step_threads(hf.Adafactor(params, lr=1e-3, relative_step=False, scale_parameter=False),
                          autotune=False, plan=plan(2))


# --------------------------------------------------------------------------- it is the optimizer


def test_shares_data_with_the_wrapped_optimizer(tmp_path: Path) -> None:
    model = make_model()
    inner = torch.optim.AdamW(param_groups(model), fused=True)
    opt = wrap(inner, tmp_path)
    assert isinstance(opt, torch.optim.Optimizer) and opt.wrapped is inner
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and opt.defaults is inner.defaults
    train(model, opt, 2)
    assert all(p in inner.state for p in model.fc1.parameters())
    opt.param_groups[0]["lr"] = 0.5
    assert inner.param_groups[0]["lr"] == 0.5
    sd = opt.state_dict()
    assert json.dumps(sd["param_groups"]) == json.dumps(inner.state_dict()["param_groups"])
    opt.load_state_dict(copy.deepcopy(sd))  # the wrapped optimizer re-binds state and param_groups
    assert opt.state is inner.state and opt.param_groups is inner.param_groups
    assert opt.param_groups[0]["lr"] == 0.5
    # Unknown attributes are the wrapped optimizer's; attributes set on the wrapper stay there.
    assert opt._zero_grad_profile_name == inner._zero_grad_profile_name
    opt.custom_flag = 1
    assert not hasattr(inner, "custom_flag")
    refused = r"cannot be copied, pickled or saved whole .* checkpoint opt\.state_dict\(\) and load_state_dict\(\)"
    for how in (copy.copy, copy.deepcopy, pickle.dumps, lambda o: torch.save(o, io.BytesIO())):
        with pytest.raises(TypeError, match=refused):
            how(opt)
    assert isinstance(copy.deepcopy(inner), torch.optim.AdamW)  # torch's own optimizer copies


def test_state_dict_round_trip_continues_bitwise(tmp_path: Path) -> None:
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(param_groups(ref_model), fused=True)
    opt = wrap(torch.optim.AdamW(param_groups(model), fused=True), tmp_path)
    train(ref_model, ref, 3)
    train(model, opt, 3)
    sd = copy.deepcopy(opt.state_dict())
    # Into a fresh wrapper (on a copy of the model) and into a plain optimizer: both continue alike.
    model2 = copy.deepcopy(model)
    opt2 = tune_step_threads(torch.optim.AdamW(param_groups(model2), fused=True), autotune=False, plan=plan())
    opt2.load_state_dict(sd)
    plain_model = copy.deepcopy(model)
    plain = torch.optim.AdamW(param_groups(plain_model), fused=True)
    plain.load_state_dict(copy.deepcopy(sd))
    for m, o in ((ref_model, ref), (model, opt), (model2, opt2), (plain_model, plain)):
        train(m, o, 3, first=3)
    for m in (model, model2, plain_model):
        assert_bitwise(list(m.parameters()), list(ref_model.parameters()), "after reload")


def test_hooks_fire_once_and_see_the_step_thread_count(tmp_path: Path) -> None:
    model = make_model()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), tmp_path)
    calls: list[str] = []
    inside = record_threads(opt)
    h = opt.register_step_post_hook(lambda o, a, k: calls.append(f"post:{type(o).__name__}"))
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd-pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("sd-post"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load-pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    torch.set_num_threads(3)
    try:
        train(model, opt, 2)
        assert torch.get_num_threads() == 3  # restored after every step
    finally:
        torch.set_num_threads(1)
    assert calls == ["post:SGD", "post:SGD"] and inside == [opt.tuner.current["threads"]] * 2 == [4, 4]
    opt.load_state_dict(opt.state_dict())
    assert calls[2:] == ["sd-pre", "sd-post", "load-pre", "load-post"]
    h.remove()
    train(model, opt, 1)
    assert calls.count("post:SGD") == 2 and len(inside) == 3


def test_lr_schedulers_drive_the_wrapped_param_groups(tmp_path: Path) -> None:
    def schedulers(o: torch.optim.Optimizer) -> list[Any]:
        return [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
                torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))]

    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(param_groups(ref_model), fused=True)
    opt = wrap(torch.optim.AdamW(param_groups(model), fused=True), tmp_path)
    ref_sched, sched = schedulers(ref), schedulers(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for step in range(6):
            for m, o, s in ((ref_model, ref, ref_sched), (model, opt, sched)):
                train(m, o, 1, first=step)
                for x in s:
                    x.step()
            assert [g["lr"] for g in opt.wrapped.param_groups] == [g["lr"] for g in ref.param_groups]
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "scheduled")
    assert opt.tuner.summary()["steps"] == 6


def test_a_scheduler_made_before_wrapping_does_not_bypass_the_tuned_step(tmp_path: Path) -> None:
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1)  # patches inner.step
    opt = wrap(inner, tmp_path)
    inside = record_threads(opt)
    train(model, opt, 2)
    sched.step()
    assert opt.tuner.summary()["steps"] == 2 and inside == [4, 4]


def test_grad_scaler_unscales_in_the_wrapped_fused_step(tmp_path: Path) -> None:
    """GradScaler hands a fused optimizer ``grad_scale``/``found_inf`` as attributes: they must
    reach the wrapped step, or it would apply scaled gradients."""
    ref_model, model = wide_model(), wide_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=3e-3, fused=True)
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True), tmp_path)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2)]
    for step in range(4):
        for m, o, scaler in ((ref_model, ref, scalers[0]), (model, opt, scalers[1])):
            scaler.scale(wide_loss(m, step)).backward()
            scaler.step(o)
            scaler.update()
            o.zero_grad(set_to_none=True)
        assert_bitwise(list(model.parameters()), list(ref_model.parameters()), f"GradScaler step {step}")
    assert not hasattr(opt.wrapped, "grad_scale") and not hasattr(opt.wrapped, "found_inf")  # removed after


def test_distributed_checkpoint_helpers_see_the_wrapped_data(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    ref_model, model = wide_model(), wide_model()
    ref = torch.optim.AdamW(ref_model.parameters(), fused=True)
    opt = wrap(torch.optim.AdamW(model.parameters(), fused=True), tmp_path)
    train(ref_model, ref, 3, wide_loss)
    train(model, opt, 3, wide_loss)
    got, want = get_optimizer_state_dict(model, opt), get_optimizer_state_dict(ref_model, ref)
    assert sorted(got["state"]) == sorted(want["state"]) and "0.weight" in got["state"]
    for fqn, entry in want["state"].items():
        for k, v in entry.items():
            assert torch.equal(got["state"][fqn][k], v), (fqn, k)
    # A fresh wrapper (empty state: the helper initialises it with a zero-lr step(closure=None)) loads it.
    model2 = copy.deepcopy(model)
    opt2 = wrap(torch.optim.AdamW(model2.parameters(), fused=True), tmp_path, use_cache=False)
    set_optimizer_state_dict(model2, opt2, copy.deepcopy(got))
    for m, o in ((ref_model, ref), (model2, opt2)):
        train(m, o, 2, wide_loss, first=3)
    assert_bitwise(list(model2.parameters()), list(ref_model.parameters()), "after set_optimizer_state_dict")


def test_zero_grad_and_add_param_group(tmp_path: Path) -> None:
    model = make_model()
    opt = wrap(torch.optim.SGD(model.fc1.parameters(), lr=0.1), tmp_path)
    tiny_loss(model, 0).backward()
    opt.zero_grad(set_to_none=True)
    assert model.fc1.weight.grad is None and model.fc2.weight.grad is not None
    opt.add_param_group({"params": list(model.fc2.parameters()), "lr": 0.2})
    assert len(opt.wrapped.param_groups) == 2 and opt.wrapped.param_groups[1]["lr"] == 0.2
    with pytest.raises(StepThreadsError, match="mixed devices"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, device="meta"))]})


def test_autotune_false_runs_the_plan_untuned() -> None:
    model = make_model()
    opt = tune_step_threads(torch.optim.SGD(model.parameters(), lr=0.1), autotune=False, plan=plan(3))
    inside = record_threads(opt)
    train(model, opt, 2)
    assert opt.tuner is None and inside == [3, 3] and torch.get_num_threads() == 1
    assert tune_step_threads(torch.optim.SGD(model.parameters(), lr=0.1), autotune=False, threads=2).threads == 2


# --------------------------------------------------------------------------- what it refuses


def test_refuses_what_it_cannot_tune(tmp_path: Path) -> None:
    cpu = [nn.Parameter(torch.zeros(4))]
    meta = [nn.Parameter(torch.zeros(4, device="meta"))]
    with pytest.raises(TypeError, match=r"expected a torch\.optim\.Optimizer"):
        tune_step_threads(object())  # type: ignore[arg-type]
    with pytest.raises(StepThreadsError, match="not on the CPU: their step would run on meta"):
        tune_step_threads(torch.optim.SGD(meta, lr=0.1))
    with pytest.raises(StepThreadsError, match=r"mixed devices: cpu \(1 tensor\), meta \(1 tensor\)"):
        tune_step_threads(torch.optim.SGD(cpu + meta, lr=0.1))
    with pytest.raises(StepThreadsError, match="LBFGS.step requires a closure"):
        tune_step_threads(torch.optim.LBFGS(cpu))
    with pytest.raises(StepThreadsError, match="CPUOffloadAdamW tunes its own threads"):
        tune_step_threads(CPUOffloadAdamW(cpu, lr=0.1))
    opt = tune_step_threads(torch.optim.SGD(cpu, lr=0.1), autotune=False, plan=plan())
    with pytest.raises(StepThreadsError, match="already wrapped"):
        tune_step_threads(opt)
    with pytest.raises(StepThreadsError, match="pass one of them"):
        tune_step_threads(torch.optim.SGD(cpu, lr=0.1), threads=2, plan=plan())
    with pytest.raises(TypeError, match="autotune="):
        tune_step_threads(torch.optim.SGD(cpu, lr=0.1), autotune="yes")  # type: ignore[arg-type]
    cpu[0].grad = torch.ones(4)

    class OwnStep(torch.optim.SGD):  # a step that is not torch's may use its closure otherwise
        def step(self, closure=None):  # type: ignore[override]
            return super().step(closure)

    own = tune_step_threads(OwnStep(cpu, lr=0.1), autotune=False, plan=plan())
    with pytest.raises(StepThreadsError, match=r"call the closure yourself \(loss = closure\(\)\), then opt.step\(\)"):
        own.step(lambda: 0.0)
    opt.step(closure=None)  # what torch.distributed.checkpoint calls: fine
    assert torch.equal(cpu[0].detach(), torch.full((4,), -0.1))


# --------------------------------------------------------------------------- cache, trace, CLI


def test_second_run_hits_the_cache_and_the_cli_shows_it(tmp_path: Path) -> None:
    from autotune.report._cli import main as cli

    def run() -> ThreadTunedOptimizer:
        model = wide_model()
        opt = wrap(torch.optim.AdamW(model.parameters(), fused=True), tmp_path, trace_dir=str(tmp_path / "runs"))
        for step in range(30):
            train(model, opt, 1, wide_loss, first=step)
            if opt.tuner.state == "locked":
                break
        opt.close()
        return opt

    first = run().tuner.summary()
    assert first["state"] == "locked" and first["cache_status"] == "miss" and first["winner"] == {"threads": 2}
    second = run().tuner.summary()
    assert second["cache_hit"] and second["probe_steps"] == 0 and second["winner"] == {"threads": 2}
    assert second["cache_key"] == first["cache_key"]
    # each run its own folder of the trace directory: the first run's trace is still there
    assert sorted(p.name for p in (tmp_path / "runs").iterdir() if p.name.startswith("run-")) == ["run-1", "run-2"]
    summary = json.loads((tmp_path / "runs" / "run-1" / "summary.json").read_text())
    assert summary["winner"] == {"threads": 2} and (tmp_path / "runs" / "run-1" / "trace.jsonl").read_text().count("\n") >= 8
    assert json.loads((tmp_path / "runs" / "run-2" / "summary.json").read_text())["cache_hit"]
    out = io.StringIO()
    assert cli(["show", "--json", "--cache", str(tmp_path / "cache.json")], stdout=out) == 0
    entries = json.loads(out.getvalue())
    text = json.dumps(entries)
    assert first["cache_key"] in text and "torch.optim.adamw.AdamW" in text


def test_fingerprint_workload_distinguishes_optimizer_and_parameters() -> None:
    space = step_threads_space(max_threads=4, baseline_threads=4, fixed_threads=False)

    def key(opt: torch.optim.Optimizer) -> str:
        return fingerprint(workload=step_threads_workload(opt), space=space, local_world_size=1).key

    a = wide_model()
    base = key(torch.optim.AdamW(a.parameters(), fused=True))
    assert key(torch.optim.AdamW(wide_model(seed=1).parameters(), fused=True)) == base  # values do not matter
    different = {
        "class": key(torch.optim.SGD(a.parameters(), lr=0.1)),
        "implementation": key(torch.optim.AdamW(a.parameters(), foreach=True)),
        "tensor count": key(torch.optim.AdamW(list(a.parameters())[:-1], fused=True)),
        "dtype": key(torch.optim.AdamW(wide_model(dtype=torch.bfloat16).parameters(), fused=True)),
        "size": key(torch.optim.AdamW(nn.Linear(300, 1030).parameters(), fused=True)),
    }
    assert base not in different.values() and len(set(different.values())) == len(different), different
    workload = step_threads_workload(torch.optim.AdamW(a.parameters(), fused=True))
    assert workload["optimizer"] == "torch.optim.adamw.AdamW" and workload["tensors"] == 4
    assert workload["options"]["fused"] is True and workload["dtypes"] == ["torch.float32"]


# ------------------------------------------------------------------ the spin-wait notice


def _lock_with(costs: dict[int, float], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Steps of a wrapped AdamW whose step times are ``costs`` by thread count, until lock-in and 5
    more; the WARNING lines of ``offload._stock``."""
    model = wide_model()
    opt = tune_step_threads(torch.optim.AdamW(model.parameters(), fused=True), plan=plan(),
                            autotune=config(tmp_path, use_cache=False), clock=FakeClock(costs))
    caplog.set_level(logging.WARNING, logger="offload._stock")
    steps = 0
    while opt.tuner.state != "locked" or steps < 45:
        wide_loss(model, steps).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps += 1
        assert steps < 200, opt.tuner.summary()
    opt.close()
    return [r.getMessage() for r in caplog.records if r.name == "offload._stock" and r.levelno == logging.WARNING]


def test_more_threads_much_slower_than_one_names_the_wait_policy_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """4 threads 3x and 2 threads 2.5x slower than 1 (what spinning OpenMP threads beside other
    work do): one WARNING at lock-in with the slowest count's figures and the setting; none with
    OMP_WAIT_POLICY=PASSIVE, none where more threads are merely a little slower, or faster."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    (line,) = _lock_with({1: 1.0, 2: 2.5, 4: 3.0}, tmp_path / "a", caplog)
    assert line.startswith("tune_step_threads: 4 threads ran 3.0x slower than 1 thread here (mean 3e+03 ms "
                           "against 1e+03 ms a step)"), line
    assert "OMP_WAIT_POLICY=PASSIVE" in line and "docs/environment.md" in line
    caplog.clear()
    assert _lock_with({1: 1.0, 2: 1.5, 4: 1.9}, tmp_path / "b", caplog) == []
    caplog.clear()
    assert _lock_with(COSTS, tmp_path / "c", caplog) == []
    caplog.clear()
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert _lock_with({1: 1.0, 2: 2.5, 4: 3.0}, tmp_path / "d", caplog) == []


def test_the_notice_reads_every_measurement_of_a_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The means pool every measurement of a count (finalists are measured again); a summary
    without a 1-thread measurement, or without measurements (a cache hit), says nothing."""
    from offload._stock import spin_wait_notice

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # tests/conftest.py sets PASSIVE

    def m(threads: int, samples: list[float]) -> dict[str, Any]:
        return {"candidate": {"threads": threads}, "samples": samples}

    pooled = {"measurements": [m(1, [1.0, 1.0]), m(2, [1.0]), m(2, [4.0, 4.0, 3.0])]}
    assert "2 threads ran 3.0x slower" in (spin_wait_notice(pooled) or "")
    assert spin_wait_notice({"measurements": [m(2, [9.0]), m(4, [9.0])]}) is None
    assert spin_wait_notice({"measurements": []}) is None
