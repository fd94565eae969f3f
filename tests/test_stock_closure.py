"""``tune_step_threads``: ``step(closure)`` (Lightning's automatic optimization) for torch's
optimizers, which evaluate the closure once before updating: the closure runs under the caller's
thread count with grad enabled, the step under the tuned count; LBFGS is still refused."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_bitwise, batch, make_model, param_groups

from offload import StepThreadsError, ThreadPlan, tune_step_threads

pytestmark = pytest.mark.usefixtures("single_threaded_main")

TUNED = 2  # the wrapper's thread count; the caller runs with 1


def _plan() -> ThreadPlan:
    return ThreadPlan(threads=TUNED, reason="test plan", source="plan", cpus=frozenset({0}),
                      local_world_size=1, planned_threads=TUNED, local_threads=(TUNED,))


@pytest.mark.parametrize(("cls", "kwargs"), [(torch.optim.AdamW, {"fused": True}),
                                             (torch.optim.Adam, {}),
                                             (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})])
def test_step_closure_evaluates_it_under_the_callers_threads(cls, kwargs) -> None:
    ref_model, model = make_model(), make_model()
    ref = cls(param_groups(ref_model), **kwargs)
    opt = tune_step_threads(cls(param_groups(model), **kwargs), autotune=False, plan=_plan())
    in_closure, in_step = [], []
    opt.wrapped.register_step_pre_hook(lambda *_: in_step.append(torch.get_num_threads()))
    torch.set_num_threads(1)
    for step in range(4):
        def closure(m=model, step=step):
            in_closure.append((torch.get_num_threads(), torch.is_grad_enabled()))
            opt.zero_grad()
            loss = m(batch(step))
            loss.backward()
            return loss

        def ref_closure(m=ref_model, step=step):
            ref.zero_grad()
            loss = m(batch(step))
            loss.backward()
            return loss

        with torch.no_grad():  # Lightning's loop may call step() under no_grad
            loss = opt.step(closure)
        ref_loss = ref.step(ref_closure)
        assert isinstance(loss, torch.Tensor) and torch.equal(loss, ref_loss), step
    assert in_closure == [(1, True)] * 4  # the caller's threads, grad enabled
    assert in_step == [TUNED] * 4  # the step itself under the tuned count
    assert torch.get_num_threads() == 1
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")
    for p, q in zip(model.parameters(), ref_model.parameters()):
        for key, value in ref.state[q].items():
            assert_bitwise([opt.state[p][key]], [value], key)
    opt.close()


def test_lbfgs_is_still_refused() -> None:
    with pytest.raises(StepThreadsError, match="LBFGS.step requires a closure"):
        tune_step_threads(torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(3))]))
