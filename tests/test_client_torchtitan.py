"""torchtitan's optimizer components (a real client, CPU) with ``CPUOffloadAdamW`` swapped in.

torchtitan's models cannot train on CPU (CUDA device calls; FlexAttention has no CPU backward), so
its trainer is not run. What a torchtitan run does to the optimizer is run here, with torchtitan's
own code: ``OptimizersContainer`` built from ``default_adamw`` (``fused=True, foreach=False`` and
``param_names`` in every group), its ``clip_grad_norm_`` before ``step()``, its flat FQN-keyed
``state_dict()`` (which first runs ``init_optim_state``: a zero-gradient, zero-lr step) and
``load_state_dict``, ``torch.save`` and, on 2 FSDP2 ranks, ``dcp.save``/``dcp.load``. Each run's
weights and norms equal the stock container's (``torch.optim.AdamW``) bitwise, across checkpoints
in either direction.

torchtitan 0.3.0 pins packages it needs only for its trainer (datasets, wandb, tensorboard, ...):
.ci/run installs it with ``--no-deps`` plus what its optimizer and config modules import (tyro,
spmd_types); see docs/integrations.md.
"""

from __future__ import annotations

import copy
import io
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from _client_util import require
from _dist_util import run_workers
from offload import CPUOffloadAdamW

require("torchtitan")
from torchtitan.components.optimizer import OptimizersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import default_adamw  # noqa: E402
from torchtitan.distributed.utils import clip_grad_norm_  # noqa: E402


def _recipe() -> type:
    """docs/integrations.md's recipe, as written there: its torchtitan block up to the model."""
    doc = (Path(__file__).absolute().parents[1] / "docs" / "integrations.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S) if "OptimizersContainer" in b)
    namespace: dict[str, Any] = {}
    exec(compile(block[: block.index("\nmodel = ")], "docs/integrations.md", "exec"), namespace)
    return namespace["OffloadOptimizersContainer"]


OffloadOptimizersContainer = _recipe()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _container(kind: str, model: torch.nn.Module, **factory: Any) -> OptimizersContainer:
    config = default_adamw(lr=1e-2)  # torchtitan's defaults: betas (0.9, 0.95), weight decay 0.1, fused
    if factory:
        config.optimizer_factory_kwargs_by_name = {"AdamW": factory}
    cls = OffloadOptimizersContainer if kind == "ours" else OptimizersContainer
    return cls(config, model_parts=[model])


def _train(model: torch.nn.Module, opt: OptimizersContainer, steps: int, seed: int) -> list[float]:
    """torchtitan's loop: backward, its clip_grad_norm_ (a max norm that clips every step), step."""
    gen = torch.Generator().manual_seed(seed)
    norms = []
    for _ in range(steps):
        model(torch.randn(16, 8, generator=gen)).square().mean().backward()
        norms.append(clip_grad_norm_(list(model.parameters()), 0.05).item())
        opt.step()
        opt.zero_grad()
    return norms


def _close(*containers: OptimizersContainer) -> None:
    for container in containers:
        for opt in container.optimizers:
            if isinstance(opt, CPUOffloadAdamW):
                opt.close()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _via_torch_save(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_container_trains_and_checkpoints_like_stock_adamw(overlap: bool) -> None:
    stock_model, our_model = _model(), _model()
    stock = _container("stock", stock_model)
    ours = _container("ours", our_model, overlap_backward=overlap)
    assert [type(o) for o in ours.optimizers] == [CPUOffloadAdamW]

    # A checkpoint before the first step: init_optim_state steps at lr 0 on zero gradients.
    before_stock, before_ours = stock.state_dict(), ours.state_dict()
    assert set(before_ours) == set(before_stock)
    assert _same(stock_model, our_model) and _same(stock_model, _model())
    for key, value in before_stock.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(before_ours[key], value), key

    assert _train(our_model, ours, 4, seed=1) == _train(stock_model, stock, 4, seed=1)
    assert _same(stock_model, our_model)

    # Resume from each other's checkpoints through torch.save, and from our own.
    saved_stock, saved_ours = _via_torch_save(stock.state_dict()), _via_torch_save(ours.state_dict())
    resumed = {}
    for name, kind, state in (("ours<-ours", "ours", saved_ours), ("ours<-stock", "ours", saved_stock),
                              ("stock<-ours", "stock", saved_ours)):
        model = copy.deepcopy(our_model)
        container = _container(kind, model, **({"overlap_backward": overlap} if kind == "ours" else {}))
        container.load_state_dict(state)
        resumed[name] = (model, container)
    reference = _train(stock_model, stock, 4, seed=2)
    for name, (model, container) in resumed.items():
        assert _train(model, container, 4, seed=2) == reference, name
        assert _same(stock_model, model), name
    _close(ours, *(c for _, c in resumed.values()))


def _fsdp_worker(rank: int, world_size: int, *, workdir: str, overlap: bool = False) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))

    def sharded() -> torch.nn.Module:
        model = _model()
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def local(model: torch.nn.Module) -> list[torch.Tensor]:
        return [p.to_local().clone() for p in model.parameters()]

    stock_model, our_model = sharded(), sharded()
    stock, ours = _container("stock", stock_model), _container("ours", our_model, overlap_backward=overlap)
    norms_equal = _train(our_model, ours, 3, seed=rank) == _train(stock_model, stock, 3, seed=rank)
    weights_equal = all(torch.equal(a, b) for a, b in zip(local(our_model), local(stock_model), strict=True))
    dcp.save(ours.state_dict(), checkpoint_id=f"{workdir}/ours")
    dcp.save(stock.state_dict(), checkpoint_id=f"{workdir}/stock")

    resumed = {}
    for name, kind, source in (("ours<-ours", "ours", "ours"), ("ours<-stock", "ours", "stock"),
                               ("stock<-ours", "stock", "ours")):
        model = sharded()
        model.load_state_dict(our_model.state_dict())
        container = _container(kind, model, **({"overlap_backward": overlap} if kind == "ours" else {}))
        state = container.state_dict()  # the keys and tensors dcp.load fills in place
        dcp.load(state, checkpoint_id=f"{workdir}/{source}")
        container.load_state_dict(state)
        resumed[name] = (model, container)
    reference = _train(stock_model, stock, 3, seed=10 + rank)
    after = {name: _train(model, container, 3, seed=10 + rank) == reference
             and all(torch.equal(a, b) for a, b in zip(local(model), local(stock_model), strict=True))
             for name, (model, container) in resumed.items()}
    _close(ours, *(c for _, c in resumed.values()))
    return {"norms_equal": norms_equal, "weights_equal": weights_equal, "resumed_equal": after}


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_fsdp2_container_clips_and_checkpoints_through_dcp_like_stock_adamw(tmp_path: Path, overlap: bool) -> None:
    """docs/integrations.md: ``optimizer_factory_kwargs_by_name={"AdamW": {"overlap_backward": True}}``
    in the FSDP2 case too (torchtitan's clip runs after backward, the early chunks must be redone)."""
    results = run_workers(_fsdp_worker, world_size=2, kwargs={"workdir": str(tmp_path), "overlap": overlap},
                          timeout_s=300)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)
    for r in results:
        assert r.value["norms_equal"] and r.value["weights_equal"], r.value
        assert r.value["resumed_equal"] == {"ours<-ours": True, "ours<-stock": True, "stock<-ours": True}, r.value


def test_recipe_maps_fused_opt_states_bf16_to_bf16_moments() -> None:
    """torchtitan's ``fused_opt_states_bf16`` passes ``fused=True, foreach=False`` (the same kwargs
    as ``"fused"``) and registers a pre-hook that makes the moments bf16 only on
    ``torch.optim.Adam/AdamW`` instances: the recipe maps it to ``state_dtype=torch.bfloat16`` (it
    was refused while CPUOffloadAdamW kept fp32 moments only), keeping the caller's other kwargs."""
    config = default_adamw(lr=1e-2)
    config.implementation = "fused_opt_states_bf16"
    config.optimizer_factory_kwargs_by_name = {"AdamW": {"overlap_backward": True}}
    model = _model()
    container = OffloadOptimizersContainer(config, model_parts=[model])
    model(torch.randn(16, 8)).square().mean().backward()
    container.step()
    opt = container.optimizers[0]
    assert opt._overlap is not None
    assert all(st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq"].dtype == torch.bfloat16
               for st in opt.state.values())
    assert config.implementation == "fused_opt_states_bf16"  # the caller's config is left as it was
    opt.close()


@pytest.mark.parametrize("implementation", ["foreach", "for-loop"])
def test_recipe_refuses_what_it_cannot_match(implementation: str) -> None:
    """``"foreach"``/``"for-loop"`` pass ``fused=False``: refused (CPUOffloadAdamW runs its own kernels)."""
    config = default_adamw(lr=1e-2)
    config.implementation = implementation
    with pytest.raises(ValueError):
        OffloadOptimizersContainer(config, model_parts=[_model()])


def test_stock_bf16_container_checkpoint_loads_into_ours_through_dcp(tmp_path: Path) -> None:
    """review: README's route for a torch AdamW bf16 checkpoint (``MasterParamLoadPlanner``) on
    torchtitan's own path: the containers as DCP Statefuls, whose flat keys are
    ``"state.<fqn>.master_param"``."""
    import torch.distributed.checkpoint as dcp

    from offload import MasterParamLoadPlanner

    stock_model, our_model = _model().to(torch.bfloat16), _model().to(torch.bfloat16)
    stock, ours = _container("stock", stock_model), _container("ours", our_model)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        stock_model(torch.randn(16, 8, generator=gen, dtype=torch.bfloat16)).square().mean().backward()
        stock.step()
        stock.zero_grad()
    dcp.save({"model": stock_model.state_dict(), "optimizer": stock}, checkpoint_id=str(tmp_path / "ck"))
    planner = MasterParamLoadPlanner()
    dcp.load({"model": our_model.state_dict(), "optimizer": ours}, checkpoint_id=str(tmp_path / "ck"), planner=planner)
    opt, ref = ours.optimizers[0], stock.optimizers[0]
    assert len(planner.dropped) == len(list(our_model.parameters()))
    assert _same(our_model, stock_model)
    for p, q in zip(our_model.parameters(), stock_model.parameters(), strict=True):
        assert torch.equal(opt.state[p]["master_param"], p.detach().float())
        assert torch.equal(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"].float())
    _close(ours)
