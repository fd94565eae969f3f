"""The trainer's parallel layouts: tensor parallel (``--tp N``) and HSDP (``--hsdp R``) under FSDP2.

The ranks form one ``DeviceMesh`` of shape ``(R, world / (R * N), N)`` named ``("replicate",
"shard", "tp")`` (rank-major: the N ranks of a TP group are neighbours, so on one node they share
the fast links, as torchtitan lays them out). Tensor parallel is the Megatron plan for the
reference GPT (:mod:`bench.train.model`): per block ``qkv`` and ``fc`` column-parallel
(``ColwiseParallel``: weight ``Shard(0)``), ``proj`` and ``out`` row-parallel (``RowwiseParallel``:
weight ``Shard(1)``, output all-reduced), on the ``tp`` dimension; then ``fully_shard``
(:mod:`bench.train._fsdp`) on the data dimensions: ``shard`` (FSDP) or ``(replicate, shard)`` (HSDP,
gradients reduce-scattered within a replica group and all-reduced across them). The optimizer
sees DTensors such as ``(Replicate(), Shard(0), Shard(1))`` or ``(_StridedShard(0, sf=N), Shard(0))``,
all of which ``offload.CPUOffloadAdamW`` steps on their local tensors.

``qkv``'s rows are reordered before sharding, from ``[q; k; v]`` to per-TP-rank ``[q_r; k_r; v_r]``
blocks, so each rank's column shard holds the q, k and v of its own heads and the block's
``chunk(3)`` splits it locally: the TP model computes the same function as the unsharded one (a
TP checkpoint's ``qkv`` rows are in this order). The ranks of a TP group must see the same batch:
:func:`parallelize` returns this rank's data-parallel index, the trainer's data stream.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from bench.train._fsdp import shard_model

logger = logging.getLogger(__name__)

__all__ = ["layout_mesh", "parallelize", "tp_plan"]


def layout_mesh(world: int, *, tp: int, hsdp: int, device_type: str) -> Any:
    """The ``(replicate, shard, tp)`` mesh of ``world`` ranks; ``ValueError`` if it does not divide."""
    if tp < 1 or hsdp < 1 or world % (tp * hsdp):
        raise ValueError(f"--tp {tp} --hsdp {hsdp} on {world} ranks: expected tp * hsdp to divide the "
                         "world size (mesh replicate x shard x tp)")
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (hsdp, world // (tp * hsdp), tp),
                            mesh_dim_names=("replicate", "shard", "tp"))


def _interleave_qkv(linear: nn.Linear, tp: int) -> None:
    """Rows ``[q; k; v]`` -> ``[q_0; k_0; v_0; q_1; ...]`` (per TP rank r its ``d / tp`` rows of each)."""
    d = linear.out_features // 3
    c = d // tp
    idx = torch.cat([torch.arange(r * c, (r + 1) * c) + j * d for r in range(tp) for j in range(3)])
    with torch.no_grad():
        linear.weight.copy_(linear.weight[idx.to(linear.weight.device)])
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[idx.to(linear.bias.device)])


def tp_plan(model: nn.Module, tp_mesh: Any) -> None:
    """The Megatron plan on every block of ``model.blocks`` (``qkv``, ``fc`` colwise; ``proj``,
    ``out`` rowwise); ``ValueError`` where the heads do not split over the TP ranks."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    for i, block in enumerate(model.blocks):
        heads, d = block.n_heads, block.qkv.in_features
        if heads % tp or d % tp:
            raise ValueError(f"--tp {tp}: block {i} has {heads} heads of width {d}: expected both divisible by {tp}")
        _interleave_qkv(block.qkv, tp)
        parallelize_module(block, tp_mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                            "fc": ColwiseParallel(), "out": RowwiseParallel()})


def parallelize(model: nn.Module, *, tp: int = 1, hsdp: int = 1, param_dtype: torch.dtype | None = None,
                cpu_offload: bool = False) -> int:
    """Tensor parallel over ``tp`` ranks (``tp > 1``), then FSDP2 (HSDP with ``hsdp > 1``
    replica groups) over the rest; returns this rank's data-parallel index (the ranks of a TP
    group share it). ``tp == hsdp == 1``: plain ``shard_model`` over all ranks."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if tp == 1 and hsdp == 1:
        shard_model(model, param_dtype=param_dtype, cpu_offload=cpu_offload)
        return rank
    device_type = next(model.parameters()).device.type
    try:
        mesh = layout_mesh(world, tp=tp, hsdp=hsdp, device_type=device_type)
        if tp > 1:
            tp_plan(model, mesh["tp"])
    except ValueError as exc:  # the trainer's one-line error, not a traceback
        raise SystemExit(f"error: {exc}") from None
    dp_mesh = mesh["replicate", "shard"] if hsdp > 1 else mesh["shard"]
    shard_model(model, param_dtype=param_dtype, cpu_offload=cpu_offload, mesh=dp_mesh)
    logger.info("layout: %s (tp %d, hsdp %d)", mesh, tp, hsdp)
    return rank // tp
