"""A tiny FSDP2 model and its references, shared by the FSDP2 tests' worker processes.

The shapes are chosen for 1, 2 and 3 ranks: dim 0 of 72, 50, 5, 2 and 1 rows gives even and
uneven shards and, on 2 and 3 ranks, ranks whose shard of ``tiny`` or ``scale`` is empty.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bench.train._fsdp import shard_model
from offload.state._dtensor import local

D = 50


class Net(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank
        self.blocks = nn.ModuleList([nn.Linear(D, 72), nn.Linear(72, D)])
        self.norm = nn.LayerNorm(D)
        self.tiny = nn.Parameter(torch.randn(2, D) * 0.1)
        self.scale = nn.Parameter(torch.ones(1))
        self.head = nn.Linear(D, 5)
        self.to(dtype)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.blocks[0](x.to(self.head.weight.dtype)))
        h = self.blocks[1](h) + self.tiny.sum(0)
        logits = self.head(self.norm(h) * self.scale)
        return F.cross_entropy(logits.float(), y)


def sharded(dtype: torch.dtype = torch.float32, param_dtype: torch.dtype | None = None) -> Net:
    return shard_model(Net(dtype), param_dtype=param_dtype)


def batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(8, D, generator=g), torch.randint(0, 5, (8,), generator=g)


def groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two param groups: matrices with weight decay, the rest without."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 2e-3}]


def make_pair(kind: str) -> tuple[Net, Any]:
    """A sharded model and its optimizer: "torch" (AdamW(fused=True)), "ours", and their bf16
    models "torch-bf16", "ours-bf16"."""
    from offload import CPUOffloadAdamW, OffloadSettings

    model = sharded(torch.bfloat16 if kind.endswith("-bf16") else torch.float32)
    if kind.startswith("torch"):
        return model, torch.optim.AdamW(groups(model), lr=1e-3, fused=True)
    return model, CPUOffloadAdamW(groups(model), lr=1e-3, settings=OffloadSettings(threads=1, chunk_numel=1024))


def train_plain(model: nn.Module, opt: Any, rank: int, steps: range) -> None:
    """``steps`` of backward, step, zero_grad on this rank's batches (no scheduler)."""
    for step in steps:
        model(*batch(rank, step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))


class ShardMixedPrecisionReference:
    """Per local shard: an fp32 master updated by torch's fused AdamW from the upcast gradient,
    cast back into the shard (the mixed-precision reference of tests/test_optimizer_numerics.py)."""

    def __init__(self, model: nn.Module, param_groups: Callable[[nn.Module], list] | None = None) -> None:
        """``param_groups``: the groups of ``model`` (default :func:`groups`)."""
        self.params = list(model.parameters())
        self.master = {p: local(p).detach().float().clone().requires_grad_(True) for p in self.params}
        self.opt = torch.optim.AdamW([{**g, "params": [self.master[p] for p in g["params"]]}
                                      for g in (param_groups or groups)(model)], lr=1e-3, fused=True)
        self.param_groups = self.opt.param_groups

    def step(self) -> None:
        for p in self.params:
            self.master[p].grad = None if p.grad is None else local(p.grad).float()
        self.opt.step()
        with torch.no_grad():
            for p in self.params:
                local(p).copy_(self.master[p])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state(self, p: torch.Tensor) -> dict:
        return self.opt.state[self.master[p]]


def train(model: nn.Module, opt: Any, sched: Any, rank: int, steps: range, accum: int = 1,
          overlap: bool = False) -> None:
    """``accum`` micro-batches per step; all but the last without FSDP's reduce-scatter (and
    inside ``opt.accumulating()`` with ``overlap``)."""
    import contextlib

    for step in steps:
        for micro in range(accum):
            last = micro == accum - 1
            model.set_requires_gradient_sync(last)
            ctx = opt.accumulating() if overlap and not last else contextlib.nullcontext()
            with ctx:
                model(*batch(rank, step, micro)).div(accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()


def shards(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [local(t).detach().clone() for t in tensors]


def assert_same(actual: list[torch.Tensor], expected: list[torch.Tensor], what: str) -> None:
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        a, e = local(a).detach(), local(e).detach()
        assert a.dtype == e.dtype and a.shape == e.shape, f"{what}[{i}]: {a.dtype}{tuple(a.shape)} vs {e.dtype}{tuple(e.shape)}"
        if not torch.equal(a, e):
            raise AssertionError(f"{what}[{i}] differs in {int((a != e).sum())}/{a.numel()} elements "
                                 f"(max abs diff {(a.float() - e.float()).abs().max().item():.3e})")
