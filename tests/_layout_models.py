"""Tiny models in the DTensor layouts large models train with, for tests/test_layouts.py's workers.

Every layout is built on 4 ranks from the same seeded weights, so two builds of one layout are
the identical model (one trained by torch's AdamW, one by ``CPUOffloadAdamW``):

- ``hsdp``: ``fully_shard`` on a 2-D ``(replicate, shard)`` mesh 2x2: ``(Replicate(), Shard(0))``;
- ``tp4``: ``ColwiseParallel`` fc1, ``RowwiseParallel`` fc2 (``Shard(0)``, ``Shard(1)``) on a 1-D tp
  mesh of 4, every other parameter a ``Replicate()`` DTensor (``distribute_tensor``);
- ``tp2-fsdp2``: the same TP plan on the tp dim of a ``(dp, tp)`` 2x2 mesh, then ``fully_shard``
  on dp: ``(_StridedShard(0, sf=2), Shard(0))``, ``(Shard(0), Shard(1))``, and ``(Shard(0),)`` on
  the 1-D dp mesh for the rest;
- ``ep``: an MoE layer whose stacked expert weights are ``Shard(0)`` over the ep dim of a
  ``(dp, ep)`` 2x2 mesh and ``fully_shard`` on dp, the dense rest ``fully_shard`` over all 4 ranks
  (parameters on two meshes); the routing leaves experts without tokens on some steps;
- ``fsdp4``: plain FSDP2 over 4 ranks; ``single``: ``fully_shard`` on a 1-rank mesh (each rank
  holds the whole model: what a 1-rank run loads).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

D, H, C, E, B = 16, 24, 5, 4, 8
"""Width, hidden width (fc1 out), classes (dim 0 of the head: uneven over 4 ranks), experts, tokens."""

_MESHES: dict[str, Any] = {}


def mesh(kind: str) -> Any:
    """One DeviceMesh per kind per process (each new mesh makes process groups: collective and slow)."""
    from torch.distributed.device_mesh import init_device_mesh

    if kind not in _MESHES:
        shapes = {"hsdp": ((2, 2), ("replicate", "shard")), "tp4": ((4,), ("tp",)),
                  "dp-tp": ((2, 2), ("dp", "tp")), "dp-ep": ((2, 2), ("dp", "ep")),
                  "world": ((4,), ("world",)), "single": ((4, 1), ("all", "one"))}
        shape, names = shapes[kind]
        _MESHES[kind] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[kind]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # FSDP unshards a unit in its forward
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


class LNet(nn.Module):
    """embed, two pre-norm MLP blocks, head; inputs wrapped by ``self.wrap`` (TP4: Replicate DTensors)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(D, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, C)
        self.wrap: Any = None

    def forward(self, x: torch.Tensor, y: torch.Tensor, step: int = 0) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        h = self.embed(x if self.wrap is None else self.wrap(x))
        for b in self.blocks:
            h = b(h)
        out = self.head(h)
        return F.cross_entropy(out.to_local() if isinstance(out, DTensor) else out, y)


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, D, H) * 0.2)
        self.w2 = nn.Parameter(torch.randn(E, H, D) * 0.2)


class MoENet(nn.Module):
    """embed, norm, an expert-parallel MoE layer (tokens gathered over ep, each rank runs its
    experts, outputs summed back), head. Routing is fixed (no router weights): token ``i`` of the
    ep group goes to expert ``(3 i + step) % E``, on odd steps expert ``E-1`` gets none, on steps
    2 mod 3 the experts of ep rank 1 get none."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.experts = Experts()
        self.head = nn.Linear(D, C)
        self.ep: tuple[Any, int, int] = (None, 0, 1)  # (group, rank, size)
        self.idle: list[int] = []  # per forward: how many experts got no token

    def forward(self, x: torch.Tensor, y: torch.Tensor, step: int = 0) -> torch.Tensor:
        from torch.distributed.nn.functional import all_reduce

        group, ep_rank, ep_size = self.ep
        h = self.embed(x)
        z = self.norm(h)
        # all-gather over ep with autograd, as an all-reduce of zero-padded slices (gloo has no
        # autograd all-gather without all-to-all)
        parts = [z if r == ep_rank else torch.zeros_like(z) for r in range(ep_size)]
        allz = all_reduce(torch.cat(parts), group=group)
        eid = (torch.arange(allz.shape[0]) * 3 + step) % E
        if step % 2 == 1:
            eid = torch.where(eid == E - 1, 0, eid)
        if step % 3 == 2:
            eid = eid % (E // ep_size)
        self.idle.append(E - len(set(eid.tolist())))
        w1, w2 = self.experts.w1.to_local(), self.experts.w2.to_local()
        out = torch.zeros_like(allz)
        for j in range(w1.shape[0]):
            idx = (eid == ep_rank * w1.shape[0] + j).nonzero().squeeze(1)
            out = out.index_add(0, idx, F.gelu(allz[idx] @ w1[j]) @ w2[j])
        out = all_reduce(out, group=group)
        mine = out[ep_rank * z.shape[0]:(ep_rank + 1) * z.shape[0]]
        return F.cross_entropy(self.head(h + mine), y)


def _replicate_rest(model: nn.Module, m: Any, skip: tuple[nn.Module, ...]) -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor

    for mod in model.modules():
        if mod in skip:
            continue
        for name, p in list(mod.named_parameters(recurse=False)):
            if not hasattr(p, "placements"):
                setattr(mod, name, nn.Parameter(distribute_tensor(p.data, m, [Replicate()])))


def build(kind: str) -> tuple[nn.Module, int]:
    """The model of layout ``kind`` and this rank's data index (TP ranks of one group see the
    same batch)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rank = dist.get_rank()
    if kind == "ep":
        model = MoENet()
        m = mesh("dp-ep")
        from torch.distributed.tensor import Shard, distribute_tensor

        for name in ("w1", "w2"):
            setattr(model.experts, name, nn.Parameter(distribute_tensor(
                getattr(model.experts, name).data, m["ep"], [Shard(0)])))
        model.ep = (m["ep"].get_group(), m.get_local_rank("ep"), m["ep"].size())
        fully_shard(model.experts, mesh=m["dp"])
        fully_shard(model, mesh=mesh("world")["world"])
        return model, rank
    model = LNet()
    if kind in ("hsdp", "fsdp4", "single"):
        m = {"hsdp": mesh("hsdp"), "fsdp4": mesh("world")["world"], "single": mesh("single")["one"]}[kind]
        for b in model.blocks:
            fully_shard(b, mesh=m)
        fully_shard(model, mesh=m)
        return model, rank
    if kind == "tp4":
        m = mesh("tp4")
        for b in model.blocks:
            parallelize_module(b, m, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(use_local_output=False)})
        _replicate_rest(model, m, ())
        model.wrap = lambda x: DTensor.from_local(x, m, [Replicate()], run_check=False)
        return model, 0
    if kind == "tp2-fsdp2":
        m = mesh("dp-tp")
        for b in model.blocks:
            parallelize_module(b, m["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
            fully_shard(b, mesh=m["dp"])
        fully_shard(model, mesh=m["dp"])
        return model, m.get_local_rank("dp")
    raise ValueError(f"layout {kind!r}: expected hsdp, tp4, tp2-fsdp2, ep, fsdp4 or single")


def batch(data_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * data_rank)
    return torch.randn(B, D, generator=g), torch.randint(0, C, (B,), generator=g)


def groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two param groups: matrices with weight decay, the rest without."""
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named if p.dim() >= 2], "param_names": [n for n, p in named if p.dim() >= 2],
             "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() < 2], "param_names": [n for n, p in named if p.dim() < 2],
             "weight_decay": 0.0, "lr": 2e-3}]
