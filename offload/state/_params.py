"""The optimizer's parameters: one :class:`ParamRecord` per parameter, in param_groups order.

Every fact the optimizer keeps about one parameter lives in its record (as torch's FSDP2 keeps a
parameter's sharding in one ``FSDPParam``): the model's tensor, its shard layout (a DTensor of an
FSDP2 model, see ``offload.state._dtensor``), its slot (position over all groups, the index of its
slab places, chunk views and ``state_dict()`` key), the step tensor its cached Items hold, whether
it keeps an fp32 master of its own, its edit stamp and its backward-hook counts. The records
survive a relayout (``add_param_group``, a master given or dropped): a new group comes last, so
every existing parameter keeps its slot and its record.

The step's hot path reads records by slot (``registry[slot]``); per-step Python per parameter is
a cost that grows with the model (models with ~20,000 tensors), so a record is a plain class
with ``__slots__``, not a dataclass with properties.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from offload.state._dtensor import ShardLayout, check_grad_layout, layout_of, local

__all__ = ["SUPPORTED_DTYPES", "ParamRecord", "ParamRegistry", "check_dtype", "check_grad", "check_params",
           "dense_perm", "param_names", "raise_bad_grad"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ParamRecord:
    """What the optimizer knows about one parameter (mutable: updated as the run goes)."""

    __slots__ = ("param", "layout", "slot", "name", "step", "views", "real_master", "stamp", "hooks_fired",
                 "hooks_expected", "perm")

    def __init__(self, param: Tensor, layout: ShardLayout | None, slot: int) -> None:
        self.param = param
        """The model's parameter (a DTensor for FSDP2): the key of ``optimizer.state``."""
        self.layout = layout
        """Its shard layout, or None for a plain tensor."""
        self.slot = slot
        """Position over all param groups: slab places, chunk views and state_dict keys use it."""
        self.name = f"parameter {slot}"
        """``parameter i`` with its name where the groups carry ``param_names`` (for errors)."""
        self.step: Tensor | None = None
        """The step tensor of its state entry when its cached Items were made (offload.state._items);
        a user who replaces ``state[p]["step"]`` (as torch's AdamW allows) invalidates them."""
        self.views: tuple[Tensor, Tensor, Tensor | None] | None = None
        """The ``exp_avg``, ``exp_avg_sq`` and (where it has a master place) ``master_param`` slab
        views its state entry was given: a user who puts other tensors there replaced them
        (``offload.state._edits.replaced_entries``)."""
        self.real_master = False
        """It keeps a master slab place where it could be its own master (offload.state._masters)."""
        self.stamp: tuple[int, int, int] | None = None
        """(version, shard version, data_ptr) after our last write or seed (offload.state._edits)."""
        self.hooks_fired = 0
        """Post-accumulate-grad hook firings in this backward (offload.overlap._hooks)."""
        self.hooks_expected = 0
        """Firings per backward learned from the last calibration (offload.overlap._hooks)."""
        self.perm = dense_perm(param) if layout is None else None
        """None for a contiguous parameter; for one that covers its memory in another order
        (``channels_last``), the order of its dimensions in memory (:func:`dense_perm`): the step
        works on ``param.permute(perm)``, a contiguous view of the same storage (:meth:`local`)."""

    def local(self) -> Tensor:
        """The tensor the step reads and writes: the parameter itself, or its local shard
        (looked up at every use: FSDP2 replaces a shard's local tensor at lazy init and load); a
        ``channels_last`` parameter as its dimensions lie in memory (a contiguous view, ``perm``),
        so that a flat view of it is its memory, which every kernel and slab works in."""
        if self.perm is not None:
            return self.param.permute(self.perm)
        return self.param if self.layout is None else local(self.param)

    def param_tensor(self) -> Tensor:
        """The parameter as the user sees it: itself, or its local shard (not permuted)."""
        return self.param if self.layout is None else local(self.param)

    def dense(self, t: Tensor) -> Tensor:
        """``t``, shaped like the parameter (a gradient, a state tensor, a loaded master), in the
        order :meth:`local` has: ``t.reshape(-1)`` then matches the slabs element for element."""
        return t if self.perm is None else t.permute(self.perm)

    def grad_of(self, grad: Tensor) -> Tensor:
        """The parameter's gradient (or this rank's shard of it) in the order of :meth:`local`."""
        g = local(grad)
        return g if self.perm is None else g.permute(self.perm)

    def __repr__(self) -> str:
        return f"ParamRecord(slot={self.slot}, shape={tuple(self.param.shape)}, sharded={self.layout is not None})"


def dense_perm(t: Tensor) -> tuple[int, ...] | None:
    """None where ``t`` is contiguous; the order of its dimensions in memory (outermost first)
    where it covers one dense block in another order (``channels_last``, a transposed
    parameter: ``t.permute(perm)`` is then contiguous); ``ValueError`` where it does not (gaps,
    overlaps, stride 0)."""
    if t.is_contiguous():
        return None
    perm = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d])))
    if not t.permute(perm).is_contiguous():
        raise ValueError(f"(shape {tuple(t.shape)}, strides {t.stride()}) does not cover one dense block of "
                         "memory: expected a contiguous tensor or a permutation of one (channels_last)")
    return perm


def param_names(param_groups: Sequence[dict[str, Any]]) -> list[str]:
    """``parameter i`` (with its name when the groups carry ``param_names``), for errors."""
    names = []
    for g in param_groups:
        given = g.get("param_names") or [None] * len(g["params"])
        for name in given:
            i = len(names)
            names.append(f"parameter {i}" if name is None else f"parameter {i} ({name!r})")
    return names


def check_dtype(name: str, p: Tensor) -> None:
    """``ValueError`` unless the fp32 host state steps ``p``'s dtype as torch's AdamW does."""
    if not p.is_floating_point():
        raise ValueError(f"{name} has dtype {p.dtype}: expected a floating point dtype")
    if p.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{name} has dtype {p.dtype}: expected one of {SUPPORTED_DTYPES} (the masters and moments are "
            f"float32, so a {p.dtype} parameter would be stepped in float32, not as torch's AdamW steps it): "
            "step it with torch.optim.AdamW, or cast it to one of those"
        )


def check_params(params: list[Tensor], names: list[str]) -> tuple[torch.device, list[ShardLayout | None]]:
    """The device of the (local) parameters, and each one's shard layout (None: a plain tensor)."""
    if not params:
        raise ValueError("CPUOffloadAdamW got an empty parameter list")
    layouts = [layout_of(p, name) for p, name in zip(params, names)]
    params = [local(p) for p in params]
    device = params[0].device
    for i, p in enumerate(params):
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(f"parameter {i} has layout {p.layout}: expected torch.strided")
        check_dtype(names[i], p)
        if p.device != device:
            raise ValueError(
                f"parameter {i} is on {p.device} but parameter 0 is on {device}: expected "
                "every parameter on one device"
            )
        if layouts[i] is not None and not p.is_contiguous():
            raise ValueError(f"{names[i]} (shape {tuple(p.shape)}, strides {p.stride()}, the local tensor of a "
                             f"DTensor with placements {layouts[i].placements!r}) is not contiguous: expected a "  # type: ignore[union-attr]
                             "contiguous local tensor (the optimizer writes it through a flat view)")
        if layouts[i] is None:
            try:
                dense_perm(p)
            except ValueError as e:
                raise ValueError(f"{names[i]} {e}") from None
    if device.type not in ("cpu", "cuda"):
        if device.type == "meta":  # deferred init: no values yet, so no masters to seed
            raise ValueError("parameters are on the meta device (deferred initialisation): build CPUOffloadAdamW "
                             "after model.to_empty(device=...) and the parameters' initialisation (as FSDP2 and "
                             "torchtitan do), so the host state is seeded from real values")
        raise ValueError(f"parameters are on {device}: expected cpu or cuda")
    return device, layouts


def check_grad(rec: ParamRecord, grad: Tensor) -> None:
    """``RuntimeError`` unless the gradient of a DTensor parameter has its mesh and placements
    (a ``Partial`` gradient: never reduced), naming the parameter (``offload.state._dtensor``).
    Call it only where ``rec.layout is not None`` (the step's hot path skips plain tensors).
    FSDP gives a gradient its parameter's DTensorSpec: that case costs one identity test."""
    if getattr(grad, "_spec", None) is not rec.param._spec:
        check_grad_layout(rec.name, rec.param, grad)


def raise_bad_grad(slot: int, p: Tensor, g: Tensor) -> None:
    """``RuntimeError`` for a gradient the step cannot use, or a parameter no longer contiguous
    (``p``, ``g``: the local tensors of parameter ``slot``)."""
    if g.is_sparse:
        raise RuntimeError(
            f"parameter {slot} has a sparse gradient: CPUOffloadAdamW supports dense only"
        )
    if not p.is_contiguous():  # checked at construction; .data may have been replaced
        raise RuntimeError(
            f"parameter {slot} (as the optimizer reads it: shape {tuple(p.shape)}, strides {p.stride()}) "
            "no longer lies in memory as it did when the optimizer was built: expected its memory "
            "format of then (the optimizer writes it in place through a flat view; was its .data "
            "replaced by a tensor of another memory format?)"
        )
    raise RuntimeError(
        f"parameter {slot} ({tuple(p.shape)} on {p.device}) has a gradient of shape "
        f"{tuple(g.shape)} on {g.device}: expected the parameter's shape and device"
    )


class ParamRegistry:
    """The records of every parameter of the param groups, indexed by slot and by tensor."""

    __slots__ = ("records", "device", "sharded", "_by_id")

    def __init__(self, param_groups: Sequence[dict[str, Any]], previous: ParamRegistry | None = None) -> None:
        """Check the groups' parameters and record them. A parameter of ``previous`` (a relayout:
        a group added, a master place changed, parameters re-bound) keeps its record, moved to its
        new slot; every other parameter gets a new record."""
        params: list[Tensor] = [p for g in param_groups for p in g["params"]]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears twice in the optimizer's param_groups")
        names = param_names(param_groups)
        self.device, layouts = check_params(params, names)
        known = previous._by_id if previous is not None else {}
        records = []
        for slot, (p, layout) in enumerate(zip(params, layouts)):
            rec = known.get(id(p)) or ParamRecord(p, layout, slot)
            rec.slot, rec.layout = slot, layout
            rec.name = names[slot]
            records.append(rec)
        self.records: list[ParamRecord] = records
        self.sharded = any(lay is not None for lay in layouts)
        """Some parameter is a DTensor (FSDP2)."""
        self._by_id = {id(p): rec for p, rec in zip(params, records)}

    def of(self, param: Tensor) -> ParamRecord:
        """The record of the model's parameter ``param``."""
        return self._by_id[id(param)]

    def __getitem__(self, slot: int) -> ParamRecord:
        return self.records[slot]

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[ParamRecord]:
        return iter(self.records)

    def params(self) -> list[Tensor]:
        """The model's parameters in slot order."""
        return [r.param for r in self.records]
