"""Each parameter's fp32 master: its own storage, or a place in the master slab, and its lifecycle.

An fp32 parameter of a CPU model is its own master (no master slab place, :func:`own_master_flags`):
the kernels update it in place, and a master copy would cost 4 bytes per parameter and two passes
per step (a copy in, a copy out) for nothing. With ``overlap_backward`` too: a chunk started during
backward must not change the weights before ``step()``, so it writes its new master into the
second generation of the slabs (``offload.state._slabs``: a scratch place per such parameter),
which ``step()`` copies into the parameter when it commits; a chunk that runs in ``step()``
updates the parameter in place as without overlap. A state entry's ``master_param`` is the
parameter itself (a live tensor sharing its storage, like the slab views), so saved state dicts
keep their layout.

A parameter that was its own master gets a master place, seeded from its fp32 value, and keeps it
(``ParamRecord.real_master``, :func:`give_masters`) when:

* it stopped being fp32 (``model.to(torch.bfloat16)``): seeded from the fp32 storage it had
  (:func:`cast_seeds`, when the edit is followed);
* ``load_state_dict`` brought a ``master_param`` with bits the parameter lacks (a bf16 run
  resumed in fp32, or the model not loaded yet: :func:`loaded_seeds`). Every loaded master is
  re-checked at the next ``step()`` (:func:`drop_equal_masters`): one that no longer rounds to
  its parameter is stale and the parameter wins (one warning); where an fp32 parameter now equals
  the master (the model was loaded after the optimizer), the parameter is its master again.

Every change of places lays the slabs out again (``HostLayout.relaid`` carries moments and
masters into the new slabs).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from offload.state._params import ParamRecord
from offload.state._slabs import HostSlabs

logger = logging.getLogger(__name__)

__all__ = [
    "cast_seeds",
    "drop_equal_masters",
    "give_masters",
    "init_state",
    "load_master",
    "loaded_seeds",
    "own_master_flags",
    "state_entry",
]

def own_master_flags(param_groups: Sequence[dict[str, Any]], records: Sequence[ParamRecord], *,
                     device_type: str, overlap_backward: bool) -> list[list[bool]]:
    """Per group and parameter: the parameter is its own fp32 master (no master slab place)."""
    own = device_type == "cpu"  # with overlap_backward too: early chunks write a scratch master
    result, slot = [], 0
    for g in param_groups:
        row = []
        for p in g["params"]:
            real = slot < len(records) and records[slot].real_master
            row.append(own and p.dtype == torch.float32 and not real)
            slot += 1
        result.append(row)
    return result


def state_entry(slabs: HostSlabs, rec: ParamRecord, step: Tensor) -> dict[str, Tensor]:
    """The state entry of ``rec``: its step and its slab views; ``master_param`` is the parameter
    itself where it is its own master."""
    own = slabs.slots[rec.slot].own_master
    return {
        "step": step,
        "exp_avg": slabs.shaped("exp_avg", rec.slot),
        "exp_avg_sq": slabs.shaped("exp_avg_sq", rec.slot),
        "master_param": rec.param_tensor().detach() if own else slabs.shaped("master", rec.slot),
    }


def init_state(slabs: HostSlabs, rec: ParamRecord) -> None:
    """First state of ``rec``: the master seeded from the parameter, zero moments."""
    slot = rec.slot
    if not slabs.slots[slot].own_master:
        slabs.flat("master", slot).copy_(rec.local().detach().reshape(-1))
    if slabs.used[slot]:  # the moments of a slot never used are still the slabs' zeros
        slabs.flat("exp_avg", slot).zero_()
        slabs.flat("exp_avg_sq", slot).zero_()
    slabs.used[slot] = 1


def give_masters(records: Sequence[ParamRecord], seeds: Mapping[int, Tensor]) -> None:
    """Slots that were their own master get a master slab place, seeded from ``seeds`` (fp32,
    flat or shaped), and keep it: the caller lays the slabs out again with these seeds
    (``HostLayout.relaid``)."""
    logger.info("CPUOffloadAdamW: %d parameter(s) get an fp32 master of their own (a dtype "
                "change or a loaded master that differs from the parameter)", len(seeds))
    for slot in seeds:
        records[slot].real_master = True


def cast_seeds(records: Sequence[ParamRecord], slabs: HostSlabs, state: Mapping[Tensor, dict[str, Any]],
               slots: Iterable[int]) -> dict[int, Tensor]:
    """Among ``slots`` (edited parameters), those that were their own master and are no longer
    fp32, with their old fp32 tensor (the state entry's ``master_param``) as seed."""
    return {
        slot: state[records[slot].param]["master_param"]
        for slot in slots
        if slabs.slots[slot].own_master and records[slot].local().dtype != torch.float32
    }


def loaded_seeds(records: Sequence[ParamRecord], slabs: HostSlabs,
                 entries: Iterable[tuple[int, dict[str, Any]]]) -> dict[int, Tensor]:
    """Loaded ``master_param`` s (slot, loaded state) with bits their parameter lacks, where the
    parameter is its own master: they need a master place."""
    return {
        slot: value["master_param"]
        for slot, value in entries
        if slabs.slots[slot].own_master and "master_param" in value
        and not torch.equal(records[slot].dense(value["master_param"].detach()).reshape(-1).to(torch.float32),
                            records[slot].local().detach().reshape(-1))
    }


def load_master(slabs: HostSlabs, slot: int, master: Tensor) -> None:
    """A loaded ``master_param`` (in the order of ``ParamRecord.local``: ``ParamRecord.dense``)
    into the master slab. A parameter that is its own master keeps
    its value: its master is the model's weight, restored with the model (``load_state_dict``
    gave a master place to every such parameter whose loaded master differs from it)."""
    if not slabs.slots[slot].own_master:
        slabs.flat("master", slot).copy_(master.detach().reshape(-1))


def _agrees(master: Tensor, param: Tensor) -> bool:
    """The fp32 ``master`` rounds to ``param`` in its dtype, or ``param`` is fp32 and equals the
    master rounded to bf16 or fp16 (a bf16/fp16 run's checkpoint resumed in fp32)."""
    if torch.equal(master.to(param.dtype), param):
        return True
    return param.dtype == torch.float32 and any(
        torch.equal(master.to(low).to(torch.float32), param) for low in (torch.bfloat16, torch.float16))


def drop_equal_masters(records: Sequence[ParamRecord], slabs: HostSlabs, slots: Iterable[int]) -> bool:
    """At the first step after ``load_state_dict``, the slots it loaded a ``master_param`` into
    (the model may have been loaded after the optimizer, so not earlier):

    * a master that no longer agrees with its parameter (:func:`_agrees`; the weights were
      trained or edited since the checkpoint, e.g. by torch's AdamW, which carries a foreign
      ``master_param`` along unchanged) is stale: the parameter wins (the master is re-seeded
      from it), with one warning naming how many;
    * an fp32 parameter that now equals its master (or won over it) is its own master again,
      as before the load.

    Returns whether some parameter is its own master again: the caller lays the slabs out again.
    """
    stale, own = 0, []
    for s in slots:
        rec = records[s]
        if slabs.slots[s].own_master:
            continue  # own masters keep the parameter's value (load_master)
        param = rec.local().detach().reshape(-1).to("cpu")
        master = slabs.flat("master", s)
        if not _agrees(master, param):
            stale += 1
            master.copy_(param)
        if rec.real_master and param.dtype == torch.float32 and torch.equal(master, param):
            own.append(s)
    if stale:
        logger.warning("CPUOffloadAdamW: the loaded master_param of %d parameter(s) no longer rounds to "
                       "the parameter (trained or edited since that checkpoint, e.g. by another "
                       "optimizer): the parameter wins", stale)
    for s in own:
        records[s].real_master = False
    return bool(own)
