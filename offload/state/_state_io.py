"""``state_dict`` / ``load_state_dict`` of ``CPUOffloadAdamW``: torch AdamW's layout, both ways.

Saved (:func:`torch_shaped`): the keys of ``torch.optim.AdamW(fused=True).state_dict()``, so
either optimizer loads the other's checkpoint, also through ``dcp.load`` with the default planner
(which needs every key of the destination in the checkpoint): per parameter ``step``,
``exp_avg``, ``exp_avg_sq``, live views of the host slabs (as torch's optimizers return their
state by reference); per group torch's flags, with ``fused=True`` and
``decoupled_weight_decay=True`` (the step is torch's fused AdamW kernel or its bitwise twin, so a
torch AdamW that loads the state keeps running fused: torch's ``load_state_dict`` takes the
loaded group's flags). ``master_param`` (fp32) only for a parameter that is not fp32: an fp32
weight is its own master (equal after every step), a bf16/fp16 one lacks the master's bits.
For a DTensor parameter (FSDP2, HSDP, TP, EP: any layout ``offload.state._dtensor`` supports) the
tensors are DTensors with its mesh, placements, global shape and stride
(:func:`as_dtensor_state`; ``step`` stays a plain tensor) over standalone aliases of the
slab views (:func:`standalone`): a DTensor over a view with a storage offset cannot be pickled
(``torch.save``, ``copy.deepcopy``: "invalid python storage"). Clones would cost the state's
size at each ``state_dict()``: measured on a 25.2M-parameter fp32 FSDP2 model (1 gloo rank, the
2-core VM), clones +7.99 B/param RSS and 207 ms, aliases +0.01 B/param and 3 ms.

Loaded (:func:`load_state`): a state dict of this class or of ``torch.optim.AdamW`` (then
without ``master_param``: the master is the current parameter), plain or DTensor (this rank's
local tensor is taken; a DTensor of another layout than the parameter's raises: DCP reshards).
Everything is checked before anything is written: group and parameter counts, each group's
options and hyper-parameters, each tensor's layout and element count. Loaded masters with bits
their parameter lacks get a master place first (``offload.state._masters``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from copy import deepcopy
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from offload.state._groups import check_hyper, check_options
from offload.state._dtensor import as_dtensor, is_dtensor, local
from offload.kernels._adamw import new_step_tensor
from offload.state._masters import load_master
from offload.state._params import ParamRecord, ParamRegistry
from offload.state._layout import HostLayout
from offload.state._slabs import HostSlabs

logger = logging.getLogger(__name__)

__all__ = ["LoadedState", "as_dtensor_state", "check_loaded", "load_state", "merged_groups", "standalone",
           "torch_shaped"]

#: Group flags of ``torch.optim.AdamW(fused=True).state_dict()`` that differ from our groups' own.
TORCH_FLAGS = {"fused": True, "decoupled_weight_decay": True}

LoadedState = list[tuple[int, dict[str, Any]]]
"""(slot, loaded state of that parameter with plain local tensors), in the state dict's order."""


def torch_shaped(sd: dict[str, Any], records: Sequence[ParamRecord]) -> dict[str, Any]:
    """``Optimizer.state_dict()``'s ``sd`` with torch AdamW(fused=True)'s keys (see module doc)."""
    state = {}
    for key, entry in sd["state"].items():
        # torch.optim keeps any key a user or a hook put into ``state`` ("test": 1) as it is.
        if _param_index(key, records) and records[key].local().dtype == torch.float32:
            entry = {k: v for k, v in entry.items() if k != "master_param"}
        state[key] = entry
    groups = [{**g, **TORCH_FLAGS} for g in sd["param_groups"]]
    return {**sd, "state": state, "param_groups": groups}


def _param_index(key: Any, records: Sequence[ParamRecord]) -> bool:
    """``key`` of a state dict's ``state`` is a parameter's index (not a key a user put there)."""
    return isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(records)


def standalone(t: Tensor) -> Tensor:
    """A tensor over ``t``'s memory with a storage of its own at offset 0 (so a DTensor over it
    pickles); a CPU tensor numpy can alias shares the memory, anything else is cloned."""
    if t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64, torch.float16) and t.is_contiguous():
        return torch.from_numpy(t.detach().numpy())  # keeps ``t``'s memory alive through numpy
    return t.detach().clone()


def as_dtensor_state(sd: dict[str, Any], records: Sequence[ParamRecord]) -> dict[str, Any]:
    """The state dict ``sd`` with the state of DTensor parameters as DTensors (see module doc)."""
    state = {}
    for key, entry in sd["state"].items():
        layout = records[key].layout if _param_index(key, records) else None
        if layout is not None:
            entry = {k: as_dtensor(standalone(v), layout) if k != "step" and isinstance(v, Tensor) else v
                     for k, v in entry.items()}
        state[key] = entry
    return {**sd, "state": state}


def check_loaded(state_dict: dict[str, Any], groups: Sequence[dict[str, Any]], defaults: dict[str, Any],
                 registry: ParamRegistry, slabs: HostSlabs) -> tuple[list[dict[str, Any]], LoadedState]:
    """The loaded groups (a copy) and every parameter's loaded state; ``ValueError`` naming the
    first mismatch."""
    saved_groups = deepcopy(state_dict["param_groups"])
    if len(groups) != len(saved_groups):
        raise ValueError(
            f"loaded state dict has {len(saved_groups)} parameter groups: expected {len(groups)}"
        )
    for i, (g, sg) in enumerate(zip(groups, saved_groups)):
        if len(g["params"]) != len(sg["params"]):
            raise ValueError(
                f"loaded state dict's param group {i} has {len(sg['params'])} parameters: "
                f"expected {len(g['params'])}"
            )
        where = f" in loaded param group {i}"
        check_options(where, sg)
        check_hyper(where, {**defaults, **sg})
    id_map = dict(
        zip(
            chain.from_iterable(g["params"] for g in saved_groups),
            chain.from_iterable(g["params"] for g in groups),
        )
    )
    entries: LoadedState = []
    for key, value in state_dict["state"].items():
        if isinstance(value.get("master_param"), dict) and not value["master_param"]:
            # a master MasterParamLoadPlanner dropped from a flat layout: torch unflattens it to {}
            value = {k: v for k, v in value.items() if k != "master_param"}
        if key not in id_map:
            raise ValueError(f"loaded state dict has state for unknown parameter id {key!r}")
        slot = registry.of(id_map[key]).slot
        numel = slabs.slots[slot].numel
        for name in ("step", "exp_avg", "exp_avg_sq"):
            if name not in value:
                raise ValueError(f"loaded state of parameter id {key!r} has no {name!r}")
        # DTensor state (a DCP checkpoint, torch AdamW's of a DTensor model): this rank's local
        # tensor, of the parameter's layout (another layout's local tensor of the same size, e.g.
        # Shard(1) for Shard(0) of a square matrix, would load silently wrong).
        layout = registry.of(id_map[key]).layout
        for name, v in value.items():
            if layout is not None and is_dtensor(v) and (
                    tuple(v.placements) != layout.placements or v.device_mesh != layout.mesh):
                raise ValueError(
                    f"loaded {name} of parameter id {key!r} is a DTensor with placements "
                    f"{tuple(v.placements)!r} on {v.device_mesh!r}: expected the parameter's "
                    f"{layout.placements!r} on {layout.mesh!r} (torch.distributed.checkpoint "
                    "reshards a checkpoint of another layout into this optimizer's state_dict())")
        value = {k: local(v) if isinstance(v, Tensor) else v for k, v in value.items()}
        for name in ("exp_avg", "exp_avg_sq", "master_param"):
            if name in value and value[name].numel() != numel:
                raise ValueError(
                    f"loaded {name} of parameter id {key!r} has {value[name].numel()} "
                    f"elements: expected {numel}"
                )
        entries.append((slot, value))
    return saved_groups, entries


def load_state(entries: LoadedState, layout: HostLayout) -> defaultdict[Tensor, dict[str, Any]]:
    """Copy the loaded masters, moments and steps into the layout's slabs; returns the new
    ``optimizer.state``."""
    records, slabs = layout.records, layout.slabs
    new_state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
    wider = sum(1 for _, value in entries
                if value["exp_avg"].dtype.itemsize > layout.state_dtype.itemsize)
    if wider:  # (the other way, bf16 moments into float32 ones, is exact)
        logger.info("CPUOffloadAdamW: %d parameters' loaded moments rounded to %s (state_dtype) to nearest-even",
                    wider, layout.state_dtype)
    with torch.no_grad():
        for slot, value in entries:
            rec = records[slot]
            load_master(slabs, slot, rec.dense(value["master_param"].detach()) if "master_param" in value
                        else rec.local())
            slabs.flat("exp_avg", slot).copy_(rec.dense(value["exp_avg"].detach()).reshape(-1))
            slabs.flat("exp_avg_sq", slot).copy_(rec.dense(value["exp_avg_sq"].detach()).reshape(-1))
            step = value["step"]
            step = (
                step.detach().to("cpu", torch.float32).reshape(()).clone()
                if isinstance(step, Tensor)
                else new_step_tensor(float(step))
            )
            new_state[rec.param] = layout.entry(slot, step)
    return new_state


def merged_groups(groups: Sequence[dict[str, Any]], saved_groups: list[dict[str, Any]],
                  defaults: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The loaded groups holding this optimizer's parameters (and names), defaults filled in."""
    new_groups = []
    for g, sg in zip(groups, saved_groups):
        sg["params"] = g["params"]
        if "param_names" in g and "param_names" not in sg:
            sg["param_names"] = g["param_names"]
        for k, v in defaults.items():
            sg.setdefault(k, v)
        new_groups.append(sg)
    return new_groups
