"""FSDP2 wrapping for the reference trainer: ``fully_shard`` each block, then the root.

Each transformer block is its own FSDP unit (one all-gather before its forward, one reduce-scatter
after its backward), the root takes the rest (embeddings, final norm, head); this is the layout
torchtitan uses. Every parameter becomes a DTensor sharded ``Shard(0)`` on a 1-D mesh over all
ranks, which is what :class:`offload.CPUOffloadAdamW` supports. FSDP2 averages gradients in its
reduce-scatter, so the trainer does not all-reduce them itself.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["shard_model"]


def shard_model(model: nn.Module, *, param_dtype: torch.dtype | None = None,
                cpu_offload: bool = False, mesh: Any = None) -> nn.Module:
    """``fully_shard`` every module of ``model.blocks`` (or none if it has none), then ``model``.

    ``param_dtype`` sets ``MixedPrecisionPolicy(param_dtype=...)``: forward/backward run in that
    dtype on the all-gathered parameters while the sharded parameters (what the optimizer sees)
    keep theirs. ``cpu_offload`` sets FSDP's ``CPUOffloadPolicy()`` (sharded parameters and
    gradients live on the CPU; pinned only where CUDA is available). ``mesh``: the data-parallel
    ``DeviceMesh`` (1-D: FSDP; 2-D ``(replicate, shard)``: HSDP; default: all ranks,
    :mod:`bench.train._parallel` makes the others). Needs an initialised default process group. Returns ``model``.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict = {} if mesh is None else {"mesh": mesh}
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype)
    if cpu_offload:
        # Pinned host memory needs an accelerator; a CPU-only torch build raises without one.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    blocks = getattr(model, "blocks", None)
    for block in blocks if isinstance(blocks, nn.ModuleList) else ():
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    logger.debug("fully_shard: %d blocks and the root (%s)", len(blocks or ()), kwargs or "no policies")
    return model
