"""Lightning ``Trainer`` (a real client, CPU) with ``configure_optimizers`` returning
``CPUOffloadAdamW`` or ``tune_step_threads(torch.optim.AdamW(...))``, under automatic optimization:
Lightning always calls ``optimizer.step(closure)`` (the closure runs forward and backward) and clips
with ``gradient_clip_val`` inside it. Each run's weights equal the same Trainer with
``torch.optim.AdamW(fused=True)`` bitwise: 1 process, ``strategy="ddp"`` on 2 gloo ranks, and
``ModelParallelStrategy`` (FSDP2 via ``configure_model``) on 2 gloo ranks. The 2-rank runs start in
``_dist_util`` workers (torchrun's environment): Lightning sees an external launcher and joins the
process group that is already there, so nothing is spawned. The clip is shown to bite: the same
1-process fit without ``gradient_clip_val`` ends with other weights.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _dist_util import run_workers

from _client_util import require

L = require("lightning")

STEPS = 5


class _Regression(L.LightningModule):
    def __init__(self, kind: str, *, shard: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.kind, self.shard = kind, shard

    def configure_model(self) -> None:
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net[0], mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        from offload import CPUOffloadAdamW, tune_step_threads

        if self.kind == "ours":
            return CPUOffloadAdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        stock = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
        return tune_step_threads(stock) if self.kind == "tuned" else stock


def _data(seed: int = 0) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8)


def _fit(kind: str, *, seed: int = 0, gradient_clip_val: float | None = 1.0, **trainer_kw) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    module = _Regression(kind, shard="strategy" in trainer_kw and not isinstance(trainer_kw["strategy"], str))
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", enable_checkpointing=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=gradient_clip_val, **trainer_kw)
    trainer.fit(module, _data(seed))
    for opt in trainer.optimizers:
        getattr(opt, "close", lambda: None)()
    return [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in module.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def stock(single_threaded_main) -> list[torch.Tensor]:
    return _fit("torch", devices=1)


@pytest.mark.parametrize("kind", ["ours", "tuned"])
def test_one_process_matches_stock_adamw(kind: str, stock, single_threaded_main) -> None:
    got = _fit(kind, devices=1)
    assert not _same(got, [p.detach() for p in _Regression("torch").parameters()])  # it trained
    assert _same(got, stock)


def test_gradient_clip_val_is_active(stock, single_threaded_main) -> None:
    # Without this the bitwise match above would also pass if Lightning's clip never ran.
    assert not _same(_fit("ours", devices=1, gradient_clip_val=None), stock)


def _worker(rank: int, world_size: int, *, strategy: str, kind: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    if strategy == "ddp":
        make = lambda: dict(strategy="ddp", devices=world_size)  # noqa: E731
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        make = lambda: dict(strategy=ModelParallelStrategy(data_parallel_size=world_size,  # noqa: E731
                                                           tensor_parallel_size=1),
                            devices=world_size)
    stock = _fit("torch", seed=rank, **make())
    return {"bitwise": _same(_fit(kind, seed=rank, **make()), stock)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ours", "tuned"])
@pytest.mark.parametrize("strategy", ["ddp", "model_parallel"])
def test_two_ranks_match_stock_adamw(strategy: str, kind: str) -> None:
    results = run_workers(_worker, world_size=2, kwargs={"strategy": strategy, "kind": kind},
                          timeout_s=300)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)
    assert all(r.value["bitwise"] for r in results), [r.value for r in results]
