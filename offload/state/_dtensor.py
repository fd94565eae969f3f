"""DTensor parameters seen as plain tensors: each rank's local part, and back.

Under ``fully_shard`` (FSDP2), HSDP (``fully_shard`` on a 2-D ``(replicate, shard)`` mesh), tensor
parallel (``parallelize_module``), TP x FSDP and expert parallel layouts every parameter is a
DTensor, and its gradient (after the reductions DTensor and FSDP do in backward) is a DTensor of
the same mesh and placements. AdamW is elementwise: the update of this rank's local tensor is the
local part of the global update, whatever the placements (a ``Replicate`` dimension: each copy
updates itself from its own, identical gradient, as torch's AdamW does on a replicated DTensor).
So the optimizer never needs the DTensor machinery: it works on ``to_local()``, a plain tensor
that *is* the parameter's storage (FSDP all-gathers from it before the next forward, so writing it
in place is how weights reach the model, as for torch's own AdamW). The host slabs are laid out
for the local shapes. Only ``state_dict()`` turns the state back into DTensors (same mesh,
placements, global shape and stride) so ``torch.distributed.checkpoint`` can save and reshard it.

The local tensor is looked up at every use, never cached: FSDP replaces a shard's local tensor
object when it pads it at lazy initialisation (first forward) and on ``load_state_dict``.

Supported: placements ``Shard(d)`` (any ``d``, even or uneven, ranks with an empty shard),
``_StridedShard`` (FSDP over a TP-sharded dim) and ``Replicate`` on a mesh of any dimension.
Refused at construction: a ``Partial`` (or any other) parameter placement: the parameter itself
would be a pending sum, and no elementwise update of its local tensor is the global update.
Refused at ``step()`` (:func:`check_grad_layout`): a gradient whose mesh or placements are not the
parameter's, e.g. a ``Partial`` gradient that nothing reduced (a replicated parameter used on
sequence-sharded activations): its local tensor is one rank's share of the sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["ShardLayout", "as_dtensor", "check_grad_layout", "is_dtensor", "layout_of", "local", "local_part_of",
           "reduce_norm_terms"]


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


def _placement_kinds() -> tuple[type, type, type]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return Shard, _StridedShard, Replicate


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """How one DTensor parameter is laid out: what ``state_dict()`` needs to rebuild DTensor state."""

    mesh: Any
    """The parameter's ``DeviceMesh`` (any number of dimensions)."""
    placements: tuple[Any, ...]
    """One per mesh dimension: ``Shard(d)``, ``_StridedShard`` or ``Replicate()``."""
    shape: torch.Size
    """Global shape."""
    stride: tuple[int, ...]
    """Global stride."""
    max_local_numel: int
    """The largest local tensor of any rank of the mesh (mesh coordinate 0 on every dimension:
    ``torch.chunk``'s first chunk is the largest): the same number on every rank, where the local
    sizes of uneven shards differ by rank (the tuner sizes its search space by it)."""
    sharded_dims: tuple[int, ...]
    """The mesh dimensions that shard the tensor (``Shard``/``_StridedShard``): a gradient norm
    sums its local terms over these and counts the others (``Replicate``) once."""


def layout_of(p: Tensor, name: str) -> ShardLayout | None:
    """The layout of a DTensor parameter (None for a plain tensor); ``ValueError`` if unsupported."""
    if not is_dtensor(p):
        return None
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    shard, strided, replicate = _placement_kinds()
    mesh, placements = p.device_mesh, tuple(p.placements)
    for pl in placements:
        if not isinstance(pl, (shard, strided, replicate)):
            raise ValueError(
                f"{name} is a DTensor with placements {placements!r} on a {mesh.ndim}-D mesh: "
                f"{pl!r} is not supported (expected Shard, _StridedShard or Replicate on every "
                "mesh dimension: a Partial parameter is a pending sum, no elementwise update of "
                "its local tensor is the global update)"
            )
    max_shape, _ = _compute_local_shape_and_global_offset(
        tuple(p.shape), tuple(mesh.shape), [0] * mesh.ndim, placements, skip_offset=True)
    return ShardLayout(
        mesh=mesh,
        placements=placements,
        shape=p.shape,
        stride=tuple(p.stride()),
        max_local_numel=math.prod(max_shape),
        sharded_dims=tuple(i for i, pl in enumerate(placements) if not isinstance(pl, replicate)),
    )


def check_grad_layout(name: str, param: Tensor, grad: Tensor) -> None:
    """``RuntimeError`` unless the gradient of the DTensor parameter ``param`` is a DTensor of its
    mesh and placements (a ``Partial`` gradient was never reduced: its local tensor is one rank's
    share of the sum, and the step would silently apply it)."""
    if type(grad) is not type(param) and not is_dtensor(grad):  # both DTensor: the hot path
        raise RuntimeError(
            f"{name} is a DTensor with placements {tuple(param.placements)!r} but its gradient is a "
            f"plain {type(grad).__name__}: expected a DTensor gradient of the same placements"
        )
    # The DTensorSpecs: FSDP gives a gradient its parameter's (0.04 us); comparing placements
    # costs ~2 us a parameter (measured on the loaded 2-core VM), so only where they differ.
    gs, ps = grad._spec, param._spec
    if gs is ps or (gs.placements == ps.placements and (gs.mesh is ps.mesh or gs.mesh == ps.mesh)):
        return
    partial = any(pl.is_partial() for pl in gs.placements)
    raise RuntimeError(
        f"{name} has placements {ps.placements!r} on mesh {ps.mesh!r} but its gradient has "
        f"{gs.placements!r} on mesh {gs.mesh!r}: expected the parameter's mesh and placements"
        + (" (a Partial gradient is an unreduced sum: reduce it, e.g. with "
           "grad.redistribute(placements=param.placements), or let FSDP/DDP reduce it)" if partial else "")
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


def local_part_of(full: Tensor, layout: ShardLayout) -> Tensor:
    """This rank's local part of ``full`` (the whole tensor of a parameter of ``layout``, the same
    on every rank), as a copy: chunked as DTensor chunks (``Replicate`` -> ``layout.placements`` is
    a local split, no communication)."""
    from torch.distributed.tensor import DTensor, Replicate

    whole = DTensor.from_local(full.reshape(layout.shape), layout.mesh, [Replicate()] * layout.mesh.ndim,
                               run_check=False)
    return whole.redistribute(layout.mesh, layout.placements).to_local().clone()


def reduce_norm_terms(params: list[Tensor], terms: Tensor, norm_type: float) -> Tensor:
    """The global norm term over ``params`` from each one's local term (``terms[i]``: the sum of
    ``|g|**norm_type`` over this rank's local tensor of ``params[i]``'s gradient, float64; for
    ``norm_type=inf`` its max ``|g|``): summed (max for inf) over all parameters and, for a
    DTensor, over the mesh dimensions that shard it; a ``Replicate`` dimension counts once (its
    copies are equal). Returns a float64 0-d tensor on the CPU (``**(1/norm_type)`` is the
    caller's). Every rank must call it with the same parameters (the collectives match up).

    One all-reduce per (mesh, sharded dimension) over the parameters that shard that mesh
    dimension, in one fixed order on every rank: the parameters are grouped by their mesh and set
    of sharded dimensions, each group's terms summed locally, then reduced over each sharded
    dimension's process group in turn (a sum over dims a then b is the sum over the a x b ranks).
    ``ValueError`` for a DTensor parameter whose placements :func:`layout_of` refuses.
    """
    import torch.distributed as dist

    inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = terms.new_zeros(())
    classes: dict[tuple[int, tuple[int, ...]], tuple[Any, tuple[int, ...], list[int]]] = {}
    plain: list[int] = []
    for i, p in enumerate(params):
        if not is_dtensor(p):
            plain.append(i)
            continue
        layout = layout_of(p, f"parameter {i}")
        assert layout is not None
        if not layout.sharded_dims:
            plain.append(i)  # replicated on every mesh dim: one copy counts
            continue
        key = (id(layout.mesh), layout.sharded_dims)
        classes.setdefault(key, (layout.mesh, layout.sharded_dims, []))[2].append(i)
    if plain:
        sel = terms[plain]
        total = sel.max() if inf else sel.sum()
    for mesh, dims, idx in classes.values():
        part = terms[idx]
        part = (part.max() if inf else part.sum()).reshape(1).to(mesh.device_type)
        for d in dims:
            dist.all_reduce(part, op=op, group=mesh.get_group(d))
        part = part.cpu()[0]
        total = torch.maximum(total, part) if inf else total + part
    return total
