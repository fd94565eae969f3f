"""Weights edited between steps: the parameter is the truth, as in ``torch.optim.AdamW``.

The fp32 master in the host slabs is a copy of the parameter. A user who edits the parameter
between steps (``p.clamp_()``, ``model.load_state_dict()``, ``p.data = ...``, an EMA swap) expects
the next step to start from the edited value, as torch's AdamW does; without this module the next
step would update the stale master and overwrite the edit.

Detection costs two integer reads per parameter per step (check and record together: 0.39 ms
median per step for 1000 parameters, 38 us for 100, on the 2-core VM of the README's Results,
timing ``reseed`` + ``record`` with no edit 200 times): torch bumps a tensor's version counter
on every in-place write (``detach()`` and views share it), and replacing ``.data`` changes the
storage pointer while keeping the counter. We record ``(version, data_ptr)`` in the parameter's record (``ParamRecord.stamp``) (for an FSDP2
parameter, the DTensor's version too: its in-place ops bump only that one) after our own last
write (our writes bump the counter too) and compare before the next update of that parameter.
A parameter whose state is new this step has no stamp yet: its master was just seeded from it.
``load_state_dict`` records nothing either: a loaded master stays unless the parameter changes.

An edited parameter's master is re-seeded element by element: an element whose value differs
from the master rounded to the parameter's dtype takes the parameter's value; the others keep the
master. For fp32 that is a plain copy. For bf16/fp16 the re-seeded elements lose the master's
extra precision (they restart from the low-precision value); unchanged elements keep it, so
loading the same weights back (e.g. model then optimizer checkpoint, in either order) costs
nothing. The moments (``exp_avg``, ``exp_avg_sq``) and ``step`` are kept, as torch keeps them.

Edits these counters cannot see (through ``p.data``, which has a counter of its own) are found
by content: on the host by the kernel, which compares every master with its live weight in its
pass (``offload.kernels._adamw.mixed_precision_adamw_``, ``seen=``); on CUDA by device checksums
of the weights written (``offload.state._device_edits``), whose slots :func:`reseed` takes as
``also``.

A CPU fp32 parameter that is its own master (no master slab place, see offload.state._slabs) has
nothing to re-seed; the optimizer re-makes its state entry (``.data`` may be new storage) and,
if it is no longer fp32, first gives it a master seeded from the fp32 storage it had
(``offload.state._masters``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from offload.state._dtensor import local
from offload.state._params import ParamRecord, check_dtype
from offload.state._rebind import local_part
from offload.state._slabs import HostSlabs

if TYPE_CHECKING:
    from offload.state._layout import HostLayout

logger = logging.getLogger(__name__)

__all__ = ["adopt_entries", "check_edited_dtype", "edited", "record", "replaced_entries", "reseed", "stamp"]


def stamp(rec: ParamRecord) -> tuple[int, int, int]:
    """The parameter's edit stamp now: (version, shard version, data_ptr)."""
    # A DTensor's in-place op (``p.clamp_()`` on an FSDP2 parameter) bumps the DTensor's version
    # counter, not its local shard's; our own writes go to the shard. Watch both.
    p = rec.param
    shard = local(p)
    return p._version, shard._version, shard.data_ptr()


def record(records: Sequence[ParamRecord], slots: Iterable[int]) -> None:
    """The parameters of ``slots`` now agree with their masters (just written or seeded)."""
    for slot in slots:
        rec = records[slot]
        rec.stamp = stamp(rec)


def edited(records: Sequence[ParamRecord], slots: Iterable[int]) -> list[int]:
    """The slots whose parameter was written or replaced by someone else since recorded."""
    out = []
    for s in slots:
        seen = records[s].stamp
        if seen is not None and seen != stamp(records[s]):
            out.append(s)
    return out


def check_edited_dtype(rec: ParamRecord) -> None:
    """``ValueError`` where an edited parameter's ``.data`` now has a dtype the fp32 host state
    cannot step as torch does (``model.double()``: a bf16 parameter was stepped in float32)."""
    check_dtype(f"{rec.name} (its .data was replaced since the last step)", rec.local())


def reseed(records: Sequence[ParamRecord], slabs: HostSlabs, slots: Iterable[int], *,
           also: Iterable[int] = ()) -> list[int]:
    """Re-seed the masters of the edited parameters among ``slots`` (see the module doc), and of
    ``also`` (edited by content, whatever their stamps: ``offload.state._device_edits``).

    Returns the slots re-seeded; they are recorded as agreeing with their masters.
    """
    found = edited(records, slots)
    found += [s for s in also if s not in found]
    for slot in found:  # before any write (also from a backward hook: overlap_backward)
        check_edited_dtype(records[slot])
    for slot in found:
        p = records[slot].local()  # (channels_last: in memory order, as the master)
        if p.numel() != slabs.slots[slot].numel:
            raise RuntimeError(
                f"parameter {slot} now has shape {tuple(p.shape)}: expected "
                f"{tuple(slabs.slots[slot].shape)}, the shape the optimizer's host slabs were "
                "laid out for (was its .data replaced by a tensor of another shape?)"
            )
        if slabs.slots[slot].own_master:
            continue  # the parameter is its master (a CPU fp32 parameter): nothing to follow
        master = slabs.flat("master", slot)
        value = p.detach().reshape(-1).to("cpu")
        if p.dtype == torch.float32:
            master.copy_(value)
        else:
            keep = master.to(p.dtype) == value
            master.copy_(torch.where(keep, master, value.to(torch.float32)))
        logger.debug("CPUOffloadAdamW: parameter %d was edited since the last step; "
                     "its master follows the parameter", slot)
    record(records, found)
    return found


# ---------------------------------------------------------------- state entries replaced
#: The keys of a state entry whose tensors are slab views, in ``ParamRecord.views`` order.
_VIEW_KEYS = ("exp_avg", "exp_avg_sq", "master_param")


def replaced_entries(records: Sequence[ParamRecord], state: Mapping[Tensor, dict[str, Any]]) -> list[int]:
    """The slots whose state entry no longer holds the slab views it was given: a moment (or a
    master) replaced by assignment (``opt.state[p]["exp_avg"] = torch.zeros_like(p)``, or a new
    ``opt.state[p] = {...}``, as recipes reset a re-initialised layer). torch's AdamW steps with
    the new tensors; so must we. Three identity tests per parameter with state."""
    out = []
    get = state.get
    for rec in records:
        views = rec.views
        if views is None or not (st := get(rec.param)):
            continue  # no state (deleted: the next step starts it fresh, as torch's does)
        get_key = st.get
        if (get_key("exp_avg") is not views[0] or get_key("exp_avg_sq") is not views[1]
                or (views[2] is not None and get_key("master_param") is not views[2])):
            out.append(rec.slot)
    return out


def adopt_entries(layout: HostLayout, state: dict[Tensor, dict[str, Any]], slots: Iterable[int]) -> None:
    """Copy the tensors put into the state entries of ``slots`` into the slabs, and give the
    entries slab views again (holding those values). ``TypeError``/``ValueError`` naming the
    parameter and the key for a tensor that cannot be a moment of it (not a floating-point tensor,
    or not its shape: the whole tensor, or this rank's local part of a DTensor parameter)."""
    for slot in slots:
        rec = layout.records[slot]
        st = state[rec.param]
        assert rec.views is not None
        for key, view in zip(_VIEW_KEYS, rec.views):
            value = st.get(key)
            if view is None or value is view or (value is None and key == "master_param"):
                continue  # (a new entry without master_param, as torch's AdamW makes: ours stays)
            what = f"optimizer.state[{rec.name}][{key!r}]"
            if not isinstance(value, Tensor) or not value.is_floating_point():
                raise TypeError(f"{what} is {type(value).__name__ if not isinstance(value, Tensor) else value.dtype}: "
                                f"expected a floating-point tensor of the parameter's shape {tuple(rec.param.shape)}")
            part = local_part(value.detach(), rec, what)
            if part is None:
                raise ValueError(f"{what} has shape {tuple(value.shape)}: expected the parameter's shape "
                                 f"{tuple(rec.param.shape)} (or its local shard {tuple(rec.local().shape)})")
            rec.dense(view).view(-1).copy_(part)  # (channels_last: the view has the parameter's strides)
        if "step" not in st:
            raise ValueError(f"optimizer.state[{rec.name}] has no 'step': expected the step tensor with "
                             "the moments (as torch's AdamW)")
        # A new dict: a state_dict() returned earlier shares the old one (torch's packs entries by
        # reference) and keeps what it showed.
        state[rec.param] = {**st, **layout.entry(slot, st["step"])}  # type: ignore[index]
    logger.debug("CPUOffloadAdamW: state entries replaced by assignment were taken into the slabs")
