"""FSDP2 (DTensor) parameters seen as plain tensors: each rank's local shard, and back.

Under ``torch.distributed.fsdp.fully_shard`` every parameter is a DTensor sharded ``Shard(0)`` on
a 1-D mesh, and its gradient (after FSDP's reduce-scatter) is a DTensor of the same layout. The
optimizer updates only this rank's shard, so it never needs the DTensor machinery: it works on
``to_local()``, a plain tensor that *is* the shard's storage (FSDP all-gathers from that storage
before the next forward, so writing it in place is how weights reach the model, as for torch's own
AdamW). The host slabs are laid out for the local shapes. Only ``state_dict()`` turns the state
back into DTensors (same mesh, placements, global shape) so ``torch.distributed.checkpoint`` can
save and reshard it.

The local tensor is looked up at every use, never cached: FSDP replaces a shard's local tensor
object when it pads it at lazy initialisation (first forward) and on ``load_state_dict``.

Supported: ``(Shard(0),)`` on a 1-D mesh, even or uneven, including ranks whose shard is empty.
Anything else (another dim, ``Replicate``, ``Partial``, a 2-D mesh such as HSDP's) raises at
construction: the optimizer would silently update a replicated tensor from one rank's gradient
or a partial sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["ShardLayout", "as_dtensor", "is_dtensor", "layout_of", "local", "reduce_norm_terms"]


#: Tensor classes that are never DTensors: the step's per-parameter checks answer these without
#: an import or isinstance (a model of ~19,000 tensors spent ~40 ms per step in the slow path).
_PLAIN = (Tensor, torch.nn.Parameter)
_DTENSOR: list[type | None] = []  # the DTensor class once looked up (None: no torch.distributed)


def _dtensor_type() -> type | None:
    if not _DTENSOR:
        cls = None
        if torch.distributed.is_available():
            from torch.distributed.tensor import DTensor as cls
        _DTENSOR.append(cls)
    return _DTENSOR[0]


def is_dtensor(t: Any) -> bool:
    if type(t) in _PLAIN:
        return False
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """How one DTensor parameter is sharded: what ``state_dict()`` needs to rebuild DTensor state."""

    mesh: Any
    """The parameter's ``DeviceMesh`` (1-D)."""
    placements: tuple[Any, ...]
    """``(Shard(0),)``."""
    shape: torch.Size
    """Global shape."""
    stride: tuple[int, ...]
    """Global (contiguous) stride."""
    max_local_numel: int
    """The largest shard of any rank (``ceil(dim0 / ranks)`` rows): the same number on every rank."""


def layout_of(p: Tensor, name: str) -> ShardLayout | None:
    """The layout of a DTensor parameter (None for a plain tensor); ``ValueError`` if unsupported."""
    if not is_dtensor(p):
        return None
    from torch.distributed.tensor import Shard

    mesh, placements = p.device_mesh, tuple(p.placements)
    if mesh.ndim != 1 or len(placements) != 1:
        raise ValueError(
            f"{name} is a DTensor on a {mesh.ndim}-D mesh with placements {placements!r}: expected "
            "(Shard(dim=0),) on a 1-D mesh (fully_shard over one mesh dimension)"
        )
    pl = placements[0]
    if type(pl) is not Shard or pl.dim != 0:
        raise ValueError(
            f"{name} is a DTensor with placement {pl!r}: expected Shard(dim=0) (what fully_shard "
            "makes); Replicate, Partial and other shard dims are not supported"
        )
    if p.dim() == 0:
        raise ValueError(f"{name} is a 0-d DTensor: expected at least one dim to shard")
    rows = math.ceil(p.shape[0] / mesh.size())
    return ShardLayout(
        mesh=mesh,
        placements=placements,
        shape=p.shape,
        stride=tuple(p.stride()),
        max_local_numel=rows * math.prod(p.shape[1:]),
    )


def local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (its storage, not a copy), or ``t`` itself."""
    if type(t) in _PLAIN or not is_dtensor(t):
        return t
    with torch.no_grad():  # under no_grad, to_local() is the local tensor object itself
        return t.to_local()


def as_dtensor(t: Tensor, layout: ShardLayout) -> Tensor:
    """A DTensor over ``t`` (this rank's shard, shared, not copied) with the parameter's layout."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t, layout.mesh, layout.placements, run_check=False,
                              shape=layout.shape, stride=layout.stride)


def reduce_norm_terms(params: list[Tensor], terms: Tensor, norm_type: float) -> Tensor:
    """The global norm term over ``params`` from each one's local term (``terms[i]``: the sum of
    ``|g|**norm_type`` over this rank's shard of ``params[i]``'s gradient, float64; for
    ``norm_type=inf`` its max ``|g|``): summed (max for inf) over all parameters and over every
    rank holding a different shard; a replicated mesh dimension counts once. Returns a float64
    0-d tensor on the CPU (``**(1/norm_type)`` is the caller's).

    1-D ``Shard(0)`` meshes only for now: one all-reduce per distinct mesh.
    """
    inf = math.isinf(norm_type)
    plain = [i for i, p in enumerate(params) if not is_dtensor(p)]
    total = terms.new_zeros(())
    if plain:
        sel = terms[plain]
        total = sel.max() if inf else sel.sum()
    by_mesh: dict[int, tuple[Any, list[int]]] = {}
    for i, p in enumerate(params):
        if is_dtensor(p):
            by_mesh.setdefault(id(p.device_mesh), (p.device_mesh, []))[1].append(i)
    import torch.distributed as dist

    for mesh, idx in by_mesh.values():
        part = terms[idx]
        part = part.max() if inf else part.sum()
        part = part.reshape(1).to(mesh.device_type)
        dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=mesh.get_group())
        part = part.cpu()[0]
        total = torch.maximum(total, part) if inf else total + part
    return total
