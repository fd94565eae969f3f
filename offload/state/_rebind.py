"""Parameters re-bound in ``param_groups`` after construction: the optimizer follows them.

torch's optimizers read ``param_groups`` at every step, and frameworks rely on it: accelerate's
FSDP2 preparation builds the optimizer on the plain parameters, shards the model
(``fully_shard`` makes new DTensor parameters) and then replaces ``group["params"]`` with the
sharded ones. An optimizer that kept only its construction-time list would step nothing (no
gradient on the old tensors) and say nothing. So every ``step()``, ``zero_grad()``,
``state_dict()``, ``load_state_dict()``, ``add_param_group()`` and ``apply_settings()`` first
compares the groups' parameters with those it laid its slabs out for (:class:`BoundParams`: one
identity comparison per parameter in C, ``map(operator.is_, ...)``, about 0.2 ms for 10,000
tensors) and, when they differ, lays the slabs out again (``HostLayout.build``).

Which state a re-bound parameter gets (:func:`plan_sources`), in this order:

* a parameter still bound keeps its record and state (its slot may move);
* a parameter with an entry in ``optimizer.state`` keeps that entry (torch's way to say that a
  new tensor is an old one: ``opt.state[new] = opt.state.pop(old)``);
* a parameter that took the place (same group and position) of one no longer bound, with the
  same global shape and dtype, takes that one's state: the one-to-one swap of accelerate or of a
  framework re-wrapping. A plain tensor replaced by its ``Shard(0)`` DTensor takes the rows of
  this rank's shard (:func:`local_part`);
* any other parameter starts fresh, at its first gradient.

torch's AdamW restarts the moments in the one-to-one case (its state is keyed by the tensor), and
keeps the old key, which then makes its ``state_dict()`` raise ``KeyError``; we keep the moments,
as the swap means the same parameter, and drop the keys of parameters no longer bound (their
slab places are gone). Where torch's AdamW is given the state by key, or the swap comes before
the first step (accelerate), the two agree bitwise.

A migrated master follows the parameter as an edit does (``offload.state._edits``): elements whose
master no longer rounds to the parameter's value take the parameter's.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from offload.state._groups import check_param_group
from offload.state._dtensor import local, local_part_of
from offload.kernels._adamw import new_step_tensor
from offload.state._params import ParamRecord
from offload.state._slabs import HostSlabs

logger = logging.getLogger(__name__)

__all__ = ["BoundParams", "Source", "check_rebound", "copy_sources", "local_part", "plan_sources"]


class BoundParams:
    """The parameters the slabs are laid out for, group by group (a snapshot of the lists)."""

    __slots__ = ("groups",)

    def __init__(self, param_groups: Sequence[dict[str, Any]]) -> None:
        self.groups: list[list[Tensor]] = [list(g["params"]) for g in param_groups]
        """Each group's parameters when the slabs were laid out."""

    def changed(self, param_groups: Sequence[dict[str, Any]]) -> bool:
        """Some group's parameters differ from the snapshot (identity, order, count)."""
        bound = self.groups
        if len(param_groups) != len(bound):
            return True
        is_ = operator.is_
        for g, b in zip(param_groups, bound):
            params = g["params"]
            if len(params) != len(b) or not all(map(is_, params, b)):
                return True
        return False

    def at(self, group: int, index: int) -> Tensor | None:
        """The parameter bound at ``(group, index)``, or None."""
        if group < len(self.groups) and index < len(self.groups[group]):
            return self.groups[group][index]
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Source:
    """Where the state of one slot of the new layout comes from."""

    old_slot: int | None = None
    """The slot the same parameter had (a parameter still bound)."""
    entry: dict[str, Any] | None = None
    """A state entry to migrate (the parameter's own, or that of the one it replaced)."""
    key: Tensor | None = None
    """The parameter ``entry`` was keyed by (dropped from ``optimizer.state`` after the copy)."""


def check_rebound(bound: BoundParams, param_groups: Sequence[dict[str, Any]], defaults: dict[str, Any],
                  *, launched: bool) -> None:
    """Before a re-layout: ``RuntimeError`` if chunks started during backward (they read the
    old parameters), ``ValueError`` for a bad option or hyper-parameter of a group appended
    to ``param_groups`` directly (``add_param_group`` checks its own)."""
    if launched:
        raise RuntimeError("CPUOffloadAdamW: param_groups were re-bound after backward started "
                           "chunks early (overlap_backward=True): re-bind before backward")
    for i in range(len(bound.groups), len(param_groups)):
        check_param_group(f" in param group {i}", {**defaults, **param_groups[i]}, defaults)


def plan_sources(bound: BoundParams, param_groups: Sequence[dict[str, Any]],
                 old_slot: Mapping[int, int], new_records: Sequence[ParamRecord],
                 state: Mapping[Tensor, dict[str, Any]]) -> dict[int, Source]:
    """Per new slot with state to carry over, its :class:`Source` (the module doc's rules).
    ``old_slot``: ``id(parameter) -> slot`` in the old layout, taken before the new registry
    (which moves the records it keeps to their new slots) was made."""
    still = {id(r.param) for r in new_records}
    sources: dict[int, Source] = {}
    slot = 0
    for gi, g in enumerate(param_groups):
        for i, p in enumerate(g["params"]):
            if id(p) in old_slot:
                sources[slot] = Source(old_slot=old_slot[id(p)])
            elif state.get(p):
                sources[slot] = Source(entry=state[p], key=p)
            else:
                prev = bound.at(gi, i)
                if (prev is not None and id(prev) not in still and state.get(prev)
                        and prev.shape == p.shape and prev.dtype == p.dtype):
                    sources[slot] = Source(entry=state[prev], key=prev)
            slot += 1
    return sources


def local_part(t: Tensor, rec: ParamRecord, what: str) -> Tensor | None:
    """``t`` (a state tensor) as the flat local part of ``rec``'s parameter: itself where it has
    the local size, this rank's local part where it is the whole tensor of a DTensor
    parameter; None where it is neither (a shard of another layout)."""
    t = local(t).detach()
    t = (rec.dense(t) if t.shape == rec.param.shape else t).reshape(-1)
    shard = rec.local()
    if t.numel() == shard.numel():
        return t
    layout = rec.layout
    if layout is None or t.numel() != math.prod(layout.shape):
        return None
    part = local_part_of(t, layout).reshape(-1)  # any placements, any mesh (offload.state._dtensor)
    if part.numel() != shard.numel():
        raise RuntimeError(f"{what}: this rank's part ({part.numel()} elements) of {tuple(layout.shape)} "
                           f"is not its local tensor {tuple(shard.shape)}")
    return part


def copy_sources(old: HostSlabs, new: HostSlabs, records: Sequence[ParamRecord],
                 sources: Mapping[int, Source], state: Mapping[Tensor, dict[str, Any]],
                 seeds: Mapping[int, Tensor]) -> dict[int, Tensor]:
    """Moments and masters into ``new`` from their sources; returns the step tensor of every
    slot that has state now (a migration that does not fit the new layout starts fresh). A slot
    that was its own master and has a master place in ``new`` takes ``seeds[slot]`` where given
    (its fp32 value before a dtype change, a loaded master), else the parameter."""
    steps: dict[int, Tensor] = {}
    for slot, src in sources.items():
        rec = records[slot]
        if src.old_slot is not None:
            if not state.get(rec.param):
                continue  # bound, never stepped: nothing to carry
            for kind in ("exp_avg", "exp_avg_sq"):
                new.flat(kind, slot).copy_(old.flat(kind, src.old_slot))
            if not new.slots[slot].own_master:
                if not old.slots[src.old_slot].own_master:
                    master = old.flat("master", src.old_slot)
                elif slot in seeds:
                    master = seeds[slot]
                else:  # its own master until now: its fp32 value is what its entry's master_param
                    # holds (the storage it had: after model.to(torch.bfloat16) the parameter is
                    # bf16 and has lost those bits)
                    held = state[rec.param].get("master_param")
                    fp32 = isinstance(held, Tensor) and held.dtype == torch.float32
                    master = rec.dense(held) if fp32 and held.numel() == rec.local().numel() else rec.local()
                new.flat("master", slot).copy_(master.detach().reshape(-1))
            steps[slot] = state[rec.param]["step"]
            continue
        assert src.entry is not None
        what = f"parameter {slot}"
        parts = {k: local_part(src.entry[k], rec, what) if k in src.entry else None
                 for k in ("exp_avg", "exp_avg_sq", "master_param")}
        step = src.entry.get("step")
        if parts["exp_avg"] is None or parts["exp_avg_sq"] is None or not isinstance(step, Tensor):
            logger.warning("CPUOffloadAdamW: %s was re-bound in param_groups to a tensor of another "
                           "layout (%s): its state starts fresh", what, tuple(rec.local().shape))
            continue
        new.flat("exp_avg", slot).copy_(parts["exp_avg"])
        new.flat("exp_avg_sq", slot).copy_(parts["exp_avg_sq"])
        if not new.slots[slot].own_master:
            new.flat("master", slot).copy_(_followed_master(parts["master_param"], rec.local()))
        if step.device.type != "cpu" or step.dtype != torch.float32 or step.dim() != 0:
            step = new_step_tensor(float(step))  # e.g. a capturable torch AdamW's device step
        steps[slot] = step
    return steps


def _followed_master(master: Tensor | None, param: Tensor) -> Tensor:
    """The migrated master where it still rounds to the parameter's value, else the parameter's
    value (fp32: the parameter; no master: the parameter upcast)."""
    value = param.detach().reshape(-1).to("cpu")
    if master is None or param.dtype == torch.float32:
        return value.to(torch.float32)
    master = master.to(torch.float32)
    return torch.where(master.to(param.dtype) == value, master, value.to(torch.float32))
