"""add_param_group after construction (progressive unfreezing): bitwise equal to torch's AdamW
given the same add_param_group at the same step, the existing state carried over."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from conftest import assert_bitwise, batch, make_model, param_groups, uses_sometimes
from test_optimizer_numerics import MixedPrecisionReference

from autotune import AutotuneConfig
from offload import CPUOffloadAdamW, OffloadSettings

pytestmark = pytest.mark.usefixtures("single_threaded_main")

STEPS, UNFREEZE = 11, 4  # the last step uses model.sometimes (group 2)


class _Reference(MixedPrecisionReference):
    """The mixed-precision reference, with a group added later (fp32 masters of the new params)."""

    def __init__(self, model: torch.nn.Module, groups: list[dict]) -> None:
        self.params = [p for g in groups for p in g["params"]]
        self.master = {p: p.detach().float().clone().requires_grad_(True) for p in self.params}
        self.opt = torch.optim.AdamW(
            [{**g, "params": [self.master[p] for p in g["params"]]} for g in groups], fused=True
        )

    def add_param_group(self, group: dict) -> None:
        for p in group["params"]:
            self.master[p] = p.detach().float().clone().requires_grad_(True)
            self.params.append(p)
        self.opt.add_param_group({**group, "params": [self.master[p] for p in group["params"]]})


class _Accumulating(torch.optim.AdamW):
    def accumulating(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def _run(model, make_opt, *, micro: int = 1):
    """Groups 0 and 1 train from the start; group 2 (frozen until then) is added at UNFREEZE."""
    groups = param_groups(model)
    for p in groups[2]["params"]:
        p.requires_grad_(False)
    opt = make_opt(groups[:2])
    for step in range(STEPS):
        if step == UNFREEZE:
            for p in groups[2]["params"]:
                p.requires_grad_(True)
            opt.add_param_group(groups[2])
        opt.zero_grad(set_to_none=True)
        for m in range(micro):
            loss = model(batch(step, m), use_sometimes=uses_sometimes(step)) / micro
            last = m == micro - 1
            ctx = contextlib.nullcontext() if last else opt.accumulating()
            with ctx:
                loss.backward()
        opt.step()
    return opt


def _state(model, get_state, key: str) -> list[torch.Tensor]:
    return [get_state(p)[key].reshape(p.shape if key != "step" else ()) for p in model.parameters()
            if get_state(p)]


@pytest.mark.parametrize(
    ("dtype", "overlap"), [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)]
)
def test_add_param_group_mid_training_is_bitwise_equal_to_torch(dtype, overlap: bool) -> None:
    ref_model, model = make_model(dtype), make_model(dtype)
    micro = 2 if overlap else 1
    if dtype == torch.float32:
        ref = _run(ref_model, lambda g: _Accumulating(g, fused=True), micro=micro)
        ref_state = lambda p: ref.state.get(p)  # noqa: E731
    else:
        ref = _run(ref_model, lambda g: _Reference(ref_model, g), micro=micro)
        ref_state = lambda p: ref.state(p) if p in ref.master else None  # noqa: E731
    settings = OffloadSettings(threads=2, chunk_numel=1024)
    opt = _run(
        model,
        lambda g: CPUOffloadAdamW(g, settings=settings, overlap_backward=overlap),
        micro=micro,
    )
    if overlap:
        assert opt.last_stats.speculated_chunks > 0
        added = opt._layout.registry.of(model.sometimes.weight).slot
        assert opt._layout.registry[added].hooks_expected > 0  # the new parameters' hooks are registered
    assert len(opt.param_groups) == 3
    assert opt.state.get(model.sometimes.weight)  # the added group really trained
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert_bitwise(_state(model, opt.state.get, key), _state(ref_model, ref_state, key), key)
    opt.close()


def test_add_param_group_with_the_tuner_keeps_tuning(tmp_path, caplog) -> None:
    model = make_model()
    groups = param_groups(model)
    config = AutotuneConfig(cache_path=str(tmp_path / "cache.json"), probe_steps=8)
    opt = CPUOffloadAdamW(groups[:2], autotune=config)
    for step in range(3):
        opt.zero_grad()
        model(batch(step)).backward()
        opt.step()
    with caplog.at_level(logging.WARNING, logger="offload._optimizer"):
        opt.add_param_group(groups[2])
    assert "while the tuner is" in caplog.text
    for step in range(3, 6):
        opt.zero_grad()
        model(batch(step), use_sometimes=True).backward()
        opt.step()
    assert opt.state.get(model.sometimes.weight)
    opt.close()
