"""``HostLayout``: the one owner of the optimizer's host state and of how it is laid out.

It holds the parameter records (``ParamRegistry``), the flat slabs of fp32 masters and moments
(``HostSlabs``), their chunks, the parameters they were laid out for (``BoundParams``), the
per-chunk work items (``ItemCache``) and the slots whose loaded master is re-checked at the next
step. ``CPUOffloadAdamW``'s engine (``offload._engine.HostEngine``) owns one layout; the pipeline
and the overlap with backward are handed it and read it, and nothing else writes its fields.

One constructor, :meth:`HostLayout.build`, makes every layout: the first (no ``previous``), and
every later one (``add_param_group``, a parameter given or losing a master place, parameters
re-bound in ``param_groups``). A later layout takes each new slot's state from where
:func:`~offload.state._rebind.plan_sources` maps it (the same parameter's old slot, an entry of
``optimizer.state``, the parameter it replaced one-to-one) and returns the new state entries; the
optimizer puts them in ``optimizer.state`` (torch's ``Optimizer`` owns that dict).

The slabs hold two generations of the state where the overlap with backward may speculate: the
committed one, which ``state`` and ``state_dict()`` show, and the next one, which a chunk started
during backward writes (``offload.state._slabs``); a step commits by swapping them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable

import torch
from torch import Tensor

from offload.kernels._adamw import new_step_tensor
from offload.state._device_edits import DeviceWeightSums
from offload.state._dtensor import local
from offload.state._items import ItemCache
from offload.state._masters import init_state, own_master_flags, state_entry
from offload.state._params import ParamRecord, ParamRegistry
from offload.state._rebind import BoundParams, Source, copy_sources, plan_sources
from offload.state._slabs import Chunk, HostSlabs, plan_chunks

logger = logging.getLogger(__name__)

__all__ = ["HostLayout", "Relaid", "SlabAllocator"]

SlabAllocator = Callable[..., HostSlabs]
"""``allocate(shapes, own_master, *, speculable, strides=None, moments=float32)``: the slabs for the groups' local shapes
(``HostSlabs``, or ``NumaPlacement.allocate`` for slabs whose pages are first touched on the
worker)."""

NO_SEEDS: Mapping[int, Tensor] = MappingProxyType({})


@dataclass(eq=False, slots=True)
class Relaid:
    """What :meth:`HostLayout.build` made."""

    layout: HostLayout
    """The new layout."""
    entries: dict[Tensor, dict[str, Any]]
    """The whole of the new ``optimizer.state``: an entry per parameter with state, over the new
    slabs (an entry's other keys are kept); empty for a first layout."""
    migrated: list[int]
    """Slots whose state came from another parameter's entry (their masters were just seeded from
    them)."""


@dataclass(eq=False, slots=True)
class HostLayout:
    """The host state of one optimizer and its layout (see the module doc)."""

    registry: ParamRegistry
    """One record per parameter, in param_groups order."""
    slabs: HostSlabs
    """Flat fp32 masters and moments (the committed generation)."""
    chunks: tuple[Chunk, ...]
    """The pipeline's chunks of the slabs (``plan_chunks``)."""
    bound: BoundParams
    """The parameters the slabs are laid out for (a re-bind is a difference from these)."""
    overlap_backward: bool
    """Chunks may start during backward: every parameter has a master place (it must not change
    before ``step()``)."""
    speculable: int | None = 0
    """Elements that may speculate (``HostSlabs``' argument: the last parameters' places, 0: none,
    None: all); a relayout keeps it."""
    state_dtype: torch.dtype = torch.float32
    """The moments' dtype (``CPUOffloadAdamW(state_dtype=)``); a relayout keeps it."""
    rounding_seed: int | None = None
    """bf16 moments rounded stochastically with this seed (``state_rounding="stochastic"``), or
    None: nearest-even; a relayout keeps it."""
    items: ItemCache = field(default_factory=ItemCache)
    """The Items of every chunk, reused from step to step."""
    recheck_masters: set[int] = field(default_factory=set)
    """Slots given a master by ``load_state_dict``: re-checked at the next step."""
    device_weights: DeviceWeightSums = field(default_factory=DeviceWeightSums)
    """The device checksums of the weights last written (CUDA: ``.data`` edits found by content)."""

    @classmethod
    def build(cls, param_groups: Sequence[dict[str, Any]], state: Mapping[Tensor, dict[str, Any]], *,
              chunk_numel: int, overlap_backward: bool, previous: HostLayout | None = None,
              seeds: Mapping[int, Tensor] = NO_SEEDS, registry: ParamRegistry | None = None,
              allocate: SlabAllocator = HostSlabs, speculable: int | None = 0,
              state_dtype: torch.dtype = torch.float32, rounding_seed: int | None = None) -> Relaid:
        """The layout of ``param_groups``, with ``previous``'s state carried over (the module doc).

        ``seeds``: the fp32 values of slots that were their own master and now get a master place;
        ``registry``: the records, when the caller needed them before the slabs (the first layout,
        bound to a NUMA node first); ``allocate``: makes the slabs; ``speculable``: elements
        that may speculate (:attr:`speculable`). ``previous``'s slabs and
        ``state`` are not written (the records it shares with the new layout move to their new
        slots): the caller switches to the new layout and puts its entries in ``optimizer.state``.
        """
        # The old slots first: the new registry moves the records it keeps to their new slots.
        old_slot = {id(r.param): r.slot for r in previous.records} if previous is not None else {}
        if registry is None:
            registry = ParamRegistry(param_groups, previous.registry if previous else None)
        records = registry.records
        own = own_master_flags(param_groups, records, device_type=registry.device.type,
                               overlap_backward=overlap_backward)
        strides = [[None if local(p).is_contiguous() else local(p).stride() for p in g["params"]]
                   for g in param_groups]  # channels_last: the state takes the parameter's strides
        slabs = allocate([[local(p).shape for p in g["params"]] for g in param_groups], own,
                         speculable=speculable if overlap_backward else 0,
                         strides=strides, moments=state_dtype)
        slabs.rounding_seed = rounding_seed
        recheck: set[int] = set()
        steps: dict[int, Tensor] = {}
        sources: dict[int, Source] = {}
        if previous is not None:
            rechecked = {id(previous.registry[s]) for s in previous.recheck_masters}  # by identity
            recheck = {rec.slot for rec in records if id(rec) in rechecked}
            sources = plan_sources(previous.bound, param_groups, old_slot, records, state)
            steps = copy_sources(previous.slabs, slabs, records, sources, state, seeds)
        layout = cls(registry=registry, slabs=slabs, chunks=plan_chunks(list(slabs.slots), chunk_numel),
                     bound=BoundParams(param_groups), overlap_backward=overlap_backward, recheck_masters=recheck,
                     speculable=speculable, state_dtype=state_dtype, rounding_seed=rounding_seed)
        entries = {records[s].param: {**state[records[s].param], **layout.entry(s, st)} for s, st in steps.items()}
        return Relaid(layout, entries, [s for s in steps if sources[s].old_slot is None])

    # ------------------------------------------------------------ state entries
    def entry(self, slot: int, step: Tensor) -> dict[str, Tensor]:
        """The state entry of ``slot`` over these slabs, counting ``step``. Every new entry starts
        a new state generation of the items (cached Items hold step tensors)."""
        self.items.new_state()
        rec = self.registry.records[slot]
        rec.step = step
        self.slabs.used[slot] = 1
        entry = state_entry(self.slabs, rec, step)
        own = self.slabs.slots[slot].own_master
        rec.views = (entry["exp_avg"], entry["exp_avg_sq"], None if own else entry["master_param"])
        return entry

    def replace_step(self, rec: ParamRecord, step: Tensor) -> None:
        """The user replaced the step tensor of ``rec``'s state entry (as torch's AdamW allows):
        the record counts ``step``, and the cached Items, which hold the old one, are made again."""
        rec.step = step
        self.items.new_state()

    def first_entry(self, rec: ParamRecord) -> dict[str, Tensor]:
        """The first state of ``rec``: its master seeded from the parameter, zero moments, step 0."""
        init_state(self.slabs, rec)
        return self.entry(rec.slot, new_step_tensor())

    def rechunk(self, chunk_numel: int) -> None:
        """New chunks of the same slabs (another ``chunk_numel``); cached views and Items of the
        old chunks are dropped (a tuner tries several layouts: none should pile up)."""
        self.chunks = plan_chunks(list(self.slabs.slots), chunk_numel)
        self.slabs.forget_views()
        self.items.clear()

    def host_regions(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of the host state every step streams: the slabs (both generations)
        and the CPU parameters that are their own masters (a NUMA page move covers them all)."""
        own = [rec.local() for rec in self.records if self.slabs.slots[rec.slot].own_master]
        return self.slabs.regions() + [(t.data_ptr(), t.numel() * t.element_size())
                                       for t in own if t.device.type == "cpu" and t.numel()]

    @property
    def records(self) -> list[ParamRecord]:
        """The parameter records in slot order."""
        return self.registry.records
