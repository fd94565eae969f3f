"""Thread budget for the CPU step: how many intra-op threads this rank may use, and why.

The rule (docs/environment.md explains it to users; :func:`allocate_threads` implements it):

1. Inputs are the affinity masks of all local ranks (exchanged over a dedicated gloo group when
   torch.distributed is initialised; otherwise LOCAL_WORLD_SIZE ranks are assumed to share this
   rank's mask) and the CPU topology (:mod:`offload._topology`).
2. The counted units are physical cores: a core counts once however many of its SMT siblings a
   mask holds, and hyperthreads are never counted unless ``smt=True`` (the AdamW step is
   memory-bandwidth bound; a second hardware thread on a core adds contention, not bandwidth).
3. A unit touched by k local ranks counts 1/k for each. A rank's threads are the floor of its
   share, at least 1. If the one-thread minimum pushes the node's total over the units the masks
   cover, threads are taken back from the ranks with the most threads (deterministically), so the
   total never exceeds the covered CPUs while there are at least as many CPUs as ranks.
4. A cgroup CPU quota caps the total threads of the local ranks in that cgroup at floor(quota)
   (at least one per rank).
5. An explicit override wins: the ``threads=`` argument, then ``OFFLOAD_AUTOTUNE_THREADS``.
   It is clamped, with a warning naming the value used, to the CPUs of this rank's affinity mask
   (more threads than CPUs only time-slice them: issue 12 measured 1000 threads on 2 CPUs 80x
   slower), and
   above ``autotune.knobs.MAX_THREADS`` it is an error (torch.set_num_threads(100000) crashes).

Every rank computes the whole node's allocation from the same gathered masks, so the plans agree.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal, Sequence

import torch

from autotune import knobs
from offload._topology import (
    CgroupCpuLimit,
    CpuTopology,
    format_cpulist,
    parse_cpulist,
    read_cpu_topology,
    read_pci_numa_node,
)

logger = logging.getLogger(__name__)

__all__ = [
    "Allocation",
    "NumaBinding",
    "RankCpus",
    "ThreadPlan",
    "ThreadPlanError",
    "allocate_threads",
    "apply_thread_plan",
    "bind_to_device_numa_node",
    "bind_to_numa_node",
    "plan_cpu_threads",
    "static_rule_threads",
    "thread_limit",
]

#: Seconds the mask exchange may wait for the other local ranks before it raises.
DEFAULT_EXCHANGE_TIMEOUT_S = 120.0

PlanSource = Literal["argument", "environment", "plan"]
MasksFrom = Literal["collective", "agreement", "given", "environment", "single"]


class ThreadPlanError(ValueError):
    """A thread count, mask or process-group layout this module cannot use."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ThreadPlan:
    """Intra-op threads for this rank, and why."""

    threads: int
    """Threads this rank should use (the override when one is given)."""
    reason: str
    """A sentence: mask sizes, sharing, SMT, cgroup caps, static rule, override."""
    source: str  # "argument" | "environment" | "plan"
    """Who chose ``threads``: the ``threads=`` argument, OFFLOAD_AUTOTUNE_THREADS, or the plan."""
    cpus: frozenset[int]
    """This rank's affinity mask."""
    local_world_size: int
    """Local ranks whose masks the plan divided the CPUs between."""
    local_rank: int = 0
    """This rank's index among them."""
    planned_threads: int | None = None
    """What the rule gives this rank, override or not (None when built by hand)."""
    local_threads: tuple[int, ...] = ()
    """The rule's threads for every local rank, in local-rank order (identical on every rank)."""
    local_masks: tuple[frozenset[int], ...] = ()
    """Every local rank's affinity mask, in local-rank order."""
    masks_from: str = "single"
    """"collective" (exchanged over gloo), "agreement" (exchanged through the caller's agreement),
    "given" (handed in with ``masks=``), "environment" (LOCAL_WORLD_SIZE copies of this mask), "single"."""
    smt: bool = False
    """Whether SMT siblings were counted as CPUs."""
    cgroup_cpus: float | None = None
    """The cgroup CPU quota (CPUs) that applied, if any."""
    static_rule_threads: int | None = None
    """The old rule ``min(len(mask), os.cpu_count() // local_world_size)`` for this rank."""
    oversubscribed_by_static_rule: bool = False
    """Whether the old rule, applied on every local rank, totals more threads than the budget."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankCpus:
    """One local rank's input to the allocation."""

    cpus: frozenset[int]
    """Its affinity mask."""
    cgroup: CgroupCpuLimit | None = None
    """Its cgroup CPU quota; ranks reporting the same ``cgroup`` key share one quota."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Allocation:
    """Threads for every local rank, with the numbers that explain them."""

    threads: tuple[int, ...]
    shares: tuple[Fraction, ...]
    """Each rank's share of the counted units (a unit touched by k ranks counts 1/k)."""
    units_in_mask: tuple[Fraction, ...]
    """Counted units each mask touches (physical cores; CPUs with ``smt=True``)."""
    shared_cpus: tuple[int, ...]
    """CPUs of each mask that are also in another local rank's mask."""
    covered_cpus: int
    """Logical CPUs in the union of the masks."""
    counted_units: Fraction
    """Counted units in the union of the masks."""
    capacity: int
    """Most threads the node may run without oversubscribing: counted units (at least one per
    rank), capped by cgroup quotas."""
    raised: tuple[int, ...]
    """Ranks whose share was below 1, raised to one thread."""
    trimmed: tuple[int, ...]
    """Ranks that gave threads back to fit the capacity or a cgroup quota."""
    cgroup_caps: tuple[tuple[str, float, int, tuple[int, ...]], ...] = field(default=())
    """``(cgroup key, quota in CPUs, thread cap, ranks)`` for every quota that applied."""


def _check_threads(value: object, what: str) -> int:
    """``value`` if it is an int from 1 to ``MAX_THREADS``: nothing else reaches set_num_threads."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= knobs.MAX_THREADS:
        raise ThreadPlanError(f"Unable to use {what}={value!r}: expected an int from 1 to {knobs.MAX_THREADS}")
    return value


_WARNED: set[tuple[str, int, frozenset[int]]] = set()


def _warn_once(what: str, requested: int, cpus: frozenset[int], message: str, *args: object) -> None:
    key = (what, requested, cpus)
    with _LOG_LOCK:
        first = key not in _WARNED
        _WARNED.add(key)
    if first:
        logger.warning(message, *args)


def _clamp_to_mask(requested: int, what: str, cpus: frozenset[int]) -> int:
    """``requested`` capped at the CPUs of ``cpus`` (the rank's mask), with a warning once."""
    if requested <= len(cpus):
        return requested
    _warn_once(what, requested, cpus,
               "%s=%d asks for more threads than the %d CPUs of this rank's affinity mask (%s): using %d "
               "(threads beyond the CPUs only time-slice them and slow the step down)",
               what, requested, len(cpus), format_cpulist(cpus), len(cpus))
    return len(cpus)


def _trim(threads: list[int], shares: Sequence[Fraction], members: Sequence[int], limit: int,
          trimmed: set[int]) -> None:
    """Take threads back from ``members`` until they total at most ``limit`` (never below 1):
    from the rank with the most threads, then the most over its share, then the lowest index."""
    while sum(threads[i] for i in members) > limit:
        candidates = [i for i in members if threads[i] > 1]
        if not candidates:
            return
        i = max(candidates, key=lambda j: (threads[j], threads[j] - shares[j], -j))
        threads[i] -= 1
        trimmed.add(i)


def allocate_threads(
    ranks: Sequence[RankCpus | Iterable[int]], topology: CpuTopology, *, smt: bool = False
) -> Allocation:
    """Split the CPUs that the local ranks' masks cover into thread counts, one per rank.

    Pure and deterministic: the same masks and topology give the same allocation on every rank.
    Guarantees: every rank gets at least 1 thread and at most as many as its mask has CPUs; the
    total never exceeds ``max(len(ranks), covered CPUs)``; ranks in one cgroup total at most
    ``max(their count, floor(quota))``.
    """
    local = [r if isinstance(r, RankCpus) else RankCpus(cpus=frozenset(r)) for r in ranks]
    if not local:
        raise ThreadPlanError("allocate_threads: expected the masks of at least one local rank")
    for i, r in enumerate(local):
        if not r.cpus:
            raise ThreadPlanError(f"local rank {i} has an empty affinity mask: expected >= 1 CPU")
    n = len(local)
    core_map = topology.core_map()

    def unit_of(cpu: int) -> tuple[tuple[str, int], Fraction]:
        if smt:
            return ("cpu", cpu), Fraction(1)
        core = core_map.get(cpu)
        if core is not None:
            return ("core", min(core)), Fraction(1)
        return ("cpu", cpu), topology.physical_per_logical

    users: dict[tuple[str, int], set[int]] = {}
    weight: dict[tuple[str, int], Fraction] = {}
    rank_units: list[set[tuple[str, int]]] = [set() for _ in local]
    for i, r in enumerate(local):
        for cpu in r.cpus:
            key, w = unit_of(cpu)
            users.setdefault(key, set()).add(i)
            weight[key] = w
            rank_units[i].add(key)

    shares = tuple(sum((weight[k] / len(users[k]) for k in units), Fraction(0)) for units in rank_units)
    threads = [max(1, math.floor(s)) for s in shares]
    raised = tuple(i for i, s in enumerate(shares) if s < 1)
    counted = sum(weight.values(), Fraction(0))
    budget = max(n, math.floor(counted))
    trimmed: set[int] = set()
    _trim(threads, shares, range(n), budget, trimmed)

    groups: dict[str, list[int]] = {}
    for i, r in enumerate(local):
        if r.cgroup is not None:
            groups.setdefault(r.cgroup.cgroup, []).append(i)
    caps: list[tuple[str, float, int, tuple[int, ...]]] = []
    for key in sorted(groups):
        members = groups[key]
        quota = min(limit.cpus for limit in (local[i].cgroup for i in members) if limit is not None)
        cap = max(len(members), CgroupCpuLimit(cpus=quota, cgroup=key).thread_cap)
        _trim(threads, shares, members, cap, trimmed)
        caps.append((key, quota, cap, tuple(members)))
    capacity = budget
    if sum(len(c[3]) for c in caps) == n:  # every rank is under some quota
        capacity = min(capacity, sum(c[2] for c in caps))

    union = frozenset().union(*(r.cpus for r in local))
    shared = tuple(
        len(r.cpus & frozenset().union(*(o.cpus for j, o in enumerate(local) if j != i)))
        for i, r in enumerate(local)
    )
    return Allocation(
        threads=tuple(threads),
        shares=shares,
        units_in_mask=tuple(sum((weight[k] for k in units), Fraction(0)) for units in rank_units),
        shared_cpus=shared,
        covered_cpus=len(union),
        counted_units=counted,
        capacity=capacity,
        raised=raised,
        trimmed=tuple(sorted(trimmed)),
        cgroup_caps=tuple(caps),
    )


def static_rule_threads(mask_size: int, cpu_count: int, local_world_size: int) -> int:
    """The rule this module replaces: ``min(len(mask), cpu_count // local_world_size)``, >= 1."""
    return max(1, min(mask_size, cpu_count // max(1, local_world_size)))


# --------------------------------------------------------------------------- mask exchange


def _affinity() -> frozenset[int]:
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))  # pragma: no cover - non-Linux


def _payload(me: RankCpus, rank: int) -> dict[str, Any]:
    limit = me.cgroup
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "cpus": format_cpulist(me.cpus),
        "cgroup": None if limit is None else limit.cgroup,
        "cgroup_cpus": None if limit is None else limit.cpus,
    }


def _from_payload(item: object, source_rank: int) -> tuple[str, RankCpus]:
    if not isinstance(item, dict) or not isinstance(item.get("cpus"), str):
        raise ThreadPlanError(f"rank {source_rank} sent {item!r}: expected a thread-plan payload")
    cpus = parse_cpulist(item["cpus"], what=f"affinity mask of rank {source_rank}")
    limit = None
    if item.get("cgroup") is not None and item.get("cgroup_cpus") is not None:
        limit = CgroupCpuLimit(cpus=float(item["cgroup_cpus"]), cgroup=str(item["cgroup"]))
    return str(item.get("host")), RankCpus(cpus=cpus, cgroup=limit)


def _node_ranks(group: Any) -> tuple[list[int], bool, str]:
    """Global ranks to exchange with, whether to keep only this host's, and how they were found."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if group is not None:
        return list(dist.get_process_group_ranks(group)), False, "the given process group"
    size, local = knobs.local_world_size(), knobs.local_rank()
    if size is not None and local is not None:
        first = rank - local
        if local >= size or first < 0 or first + size > world:
            raise ThreadPlanError(
                f"LOCAL_RANK={local}, LOCAL_WORLD_SIZE={size} do not fit rank {rank} of world size "
                f"{world}: expected the ranks of a node to be contiguous, as torchrun assigns them"
            )
        return list(range(first, first + size)), False, "LOCAL_RANK/LOCAL_WORLD_SIZE"
    return list(range(world)), True, "all ranks, filtered by host name"


#: Groups made for the thread plan, keyed by rank set, held by WEAK references: torch's own
#: registry keeps them alive until ``destroy_process_group()``; a strong reference here would keep
#: the process group alive until interpreter teardown, where destroying it crashed a torchrun rank
#: about one run in six ("terminate called without an active exception").
_GROUPS: dict[tuple[int, ...], tuple[Any, Any]] = {}
_GROUPS_LOCK = threading.Lock()


def _gloo_group(ranks: Sequence[int], given: Any, timeout_s: float) -> Any:
    """A gloo group over ``ranks``: ``given`` when it is one, else one made for the thread plan.

    The made group is created once per rank set and default group, then reused: torch names groups
    made with ``use_local_synchronization=True`` after their ranks, and a second group over the
    same ranks would collide with the first (or, once that one is destroyed, with its rendezvous
    keys in the store). Only the members of ``ranks`` need to call. Its collectives time out after
    the ``timeout_s`` of the call that created it.
    """
    import torch.distributed as dist

    if given is not None and str(dist.get_backend(given)).lower() == "gloo":
        return given
    key, world = tuple(ranks), dist.group.WORLD
    with _GROUPS_LOCK:
        cached = _GROUPS.get(key)
        if cached is not None and cached[0]() is world and cached[1]() is not None:
            return cached[1]()
        try:
            pg = dist.new_group(ranks=list(ranks), backend="gloo", timeout=timedelta(seconds=timeout_s),
                                use_local_synchronization=True)
        except ValueError as exc:  # a group over these ranks already has the hashed name
            raise ThreadPlanError(
                f"cannot create a gloo group over ranks {list(ranks)} for the thread plan ({exc}): "
                "pass group= a gloo group over these ranks"
            ) from exc
        except RuntimeError as exc:  # rendezvous timed out
            raise ThreadPlanError(
                f"creating a gloo group over ranks {list(ranks)} failed within {timeout_s:g} s: {exc}"
            ) from exc
        _GROUPS[key] = (weakref.ref(world), weakref.ref(pg))
        return pg


def _exchange(me: RankCpus, *, group: Any, timeout_s: float) -> tuple[list[RankCpus], int, str] | None:
    """All local ranks' inputs and this rank's index, or None without torch.distributed.

    The exchange runs on a gloo group (never on NCCL, see :func:`_gloo_group`) with a timeout.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    rank = dist.get_rank()
    ranks, filter_host, how = _node_ranks(group)
    if rank not in ranks:
        raise ThreadPlanError(f"rank {rank} is not in the process group {ranks} given to plan_cpu_threads")
    if len(ranks) == 1:
        return [me], 0, how
    pg = _gloo_group(ranks, group, timeout_s)
    ranks = list(dist.get_process_group_ranks(pg))  # all_gather_object's order
    gathered: list[object] = [None] * len(ranks)
    try:
        dist.all_gather_object(gathered, _payload(me, rank), group=pg)
    except RuntimeError as exc:
        raise ThreadPlanError(
            f"exchanging affinity masks with ranks {ranks} failed (did every rank call "
            f"plan_cpu_threads?): {exc}"
        ) from exc
    host = socket.gethostname()
    entries = [_from_payload(item, r) for item, r in zip(gathered, ranks)]
    keep = [i for i, (h, _) in enumerate(entries) if h == host] if filter_host else list(range(len(ranks)))
    if not filter_host and any(h != host for h, _ in entries):
        logger.warning("plan_cpu_threads: ranks %s report different host names %s; treating them as "
                       "one node as %s says", ranks, sorted({h for h, _ in entries}), how)
    index = keep.index(ranks.index(rank))
    return [entries[i][1] for i in keep], index, how


def _exchange_with(me: RankCpus, agreement: Any) -> tuple[list[RankCpus], int]:
    """All local ranks' inputs and this rank's index, gathered with ``agreement.all_gather``.

    The agreement spans this node's ranks (its caller built it so); it is not closed here.
    """
    rank = agreement.rank
    try:
        gathered = agreement.all_gather(_payload(me, rank), step=None, what="thread plan")
    except RuntimeError as exc:  # autotune.AgreementError and collective failures
        raise ThreadPlanError(
            f"exchanging affinity masks through {agreement!r} failed (did every rank call "
            f"plan_cpu_threads?): {exc}"
        ) from exc
    if not isinstance(gathered, list) or len(gathered) != agreement.world_size:
        raise ThreadPlanError(f"{agreement!r} gathered {gathered!r}: expected one payload per local rank")
    entries = [_from_payload(item, r) for r, item in enumerate(gathered)]
    host = socket.gethostname()
    if any(h != host for h, _ in entries):
        logger.warning("plan_cpu_threads: the ranks of %r report different host names %s; treating them as "
                       "one node", agreement, sorted({h for h, _ in entries}))
    return [e for _, e in entries], rank


def _given_masks(masks: Sequence[RankCpus | Iterable[int]], local_rank: int | None,
                 cpus: Iterable[int] | None) -> tuple[list[RankCpus], int]:
    """``masks`` as :class:`RankCpus` and this rank's index, checked against ``cpus``."""
    given = [m if isinstance(m, RankCpus) else RankCpus(cpus=frozenset(m)) for m in masks]
    if not given:
        raise ThreadPlanError("plan_cpu_threads: masks=[] : expected the masks of at least one local rank")
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or not 0 <= local_rank < len(given):
        raise ThreadPlanError(
            f"plan_cpu_threads: local_rank={local_rank!r} with {len(given)} masks: expected an int from 0 "
            f"to {len(given) - 1}"
        )
    if cpus is not None and frozenset(cpus) != given[local_rank].cpus:
        raise ThreadPlanError(
            f"plan_cpu_threads: cpus={format_cpulist(frozenset(cpus))} is not masks[{local_rank}] = "
            f"{format_cpulist(given[local_rank].cpus)}: expected this rank's own mask"
        )
    return given, local_rank


def _local_masks(me: RankCpus, *, group: Any, agreement: Any,
                 timeout_s: float) -> tuple[list[RankCpus], int, MasksFrom]:
    """Every local rank's input, this rank's index, and where they came from: ``agreement``, else
    a gloo exchange when torch.distributed is initialised, else LOCAL_WORLD_SIZE copies of ``me``."""
    if agreement is not None:
        return (*_exchange_with(me, agreement), "agreement")
    exchanged = _exchange(me, group=group, timeout_s=timeout_s)
    if exchanged is not None:
        masks, index, _ = exchanged
        return masks, index, "collective"
    size = knobs.local_world_size()
    local = knobs.local_rank() if size is not None else None  # LOCAL_RANK alone: one rank
    size, local = size or 1, local or 0
    if local >= size:
        raise ThreadPlanError(
            f"LOCAL_RANK={local} with LOCAL_WORLD_SIZE={size}: expected LOCAL_RANK < LOCAL_WORLD_SIZE"
        )
    return [me] * size, local, "environment"


# --------------------------------------------------------------------------- the plan

_LOGGED: set[tuple[int, str]] = set()
_LOG_LOCK = threading.Lock()


def _log_once(plan: ThreadPlan) -> None:
    key = (plan.threads, plan.reason)
    with _LOG_LOCK:
        first = key not in _LOGGED
        _LOGGED.add(key)
    logger.log(logging.INFO if first else logging.DEBUG, "thread plan: %d threads: %s",
               plan.threads, plan.reason)


def _fmt(x: Fraction) -> str:
    return str(int(x)) if x.denominator == 1 else f"{float(x):.2f}"


def _count(x: int | Fraction, word: str) -> str:
    return f"{_fmt(Fraction(x))} {word}" + ("" if x == 1 else "s")


def _reason(*, alloc: Allocation, index: int, masks: Sequence[RankCpus], masks_from: str,
            topology: CpuTopology, smt: bool, static: int, statics: Sequence[int], cpu_count: int,
            oversubscribed: bool, chosen: int, source: str, requested: int) -> str:
    n = len(masks)
    mine = masks[index].cpus
    parts = [f"local rank {index} of {n}" + {
        "collective": " (masks exchanged over gloo)",
        "agreement": " (masks exchanged through the given agreement)",
        "given": " (masks handed in)",
        "environment": " (no process group: LOCAL_WORLD_SIZE ranks assumed to share this mask)",
        "single": "",
    }[masks_from]]
    mask = f"mask {format_cpulist(mine)} has {_count(len(mine), 'CPU')}"
    if alloc.shared_cpus[index]:
        mask += f", {alloc.shared_cpus[index]} shared with other local ranks"
    parts.append(mask)
    units = alloc.units_in_mask[index]
    if smt:
        parts.append("SMT siblings counted as CPUs")
    elif topology.cores:
        siblings = len(mine) - int(units)
        parts.append(_count(units, "physical core")
                     + (f" ({_count(siblings, 'SMT sibling')} not counted)" if siblings > 0 else ""))
    elif topology.physical_per_logical < 1:
        parts.append(f"about {_count(units, 'physical core')} "
                     f"(psutil: {_fmt(topology.physical_per_logical)} per CPU)")
    planned = alloc.threads[index]
    share = f"share {_fmt(alloc.shares[index])} -> {_count(planned, 'thread')}"
    if index in alloc.raised:
        share += " (raised to the 1-thread minimum)"
    if index in alloc.trimmed:
        share += " (lowered so the local ranks fit the covered CPUs and cgroup quotas)"
    parts.append(share)
    for key, quota, cap, members in alloc.cgroup_caps:
        if index in members:
            parts.append(f"cgroup {key} quota {quota:g} CPUs caps its {_count(len(members), 'local rank')} "
                         f"at {_count(cap, 'thread')}")
    rule = f"static rule min({len(mine)}, {cpu_count} // {n}) = {static}"
    if oversubscribed:
        rule += f" oversubscribes ({sum(statics)} threads over local ranks on a budget of {alloc.capacity})"
    parts.append(rule)
    clamped = f" (clamped to {chosen}, the CPUs of the mask)" if requested != chosen else ""
    if source == "argument":
        parts.append(f"threads={requested} argument{clamped} overrides the plan's {planned}")
    elif source == "environment":
        parts.append(f"{knobs.THREADS_VAR}={requested}{clamped} overrides the plan's {planned}")
    try:
        omp = knobs.omp_num_threads()
    except knobs.KnobError:  # e.g. OpenMP's nested "4,2": not ours to judge, only reported
        omp = None
    if omp is not None and omp != chosen:
        parts.append(f"OMP_NUM_THREADS={omp} (a launcher default) is not obeyed")
    return "; ".join(parts)


def plan_cpu_threads(
    *,
    threads: int | None = None,
    group: Any = None,
    smt: bool = False,
    timeout_s: float = DEFAULT_EXCHANGE_TIMEOUT_S,
    topology: CpuTopology | None = None,
    cpus: Iterable[int] | None = None,
    cpu_count: int | None = None,
    agreement: Any = None,
    masks: Sequence[RankCpus | Iterable[int]] | None = None,
    local_rank: int | None = None,
) -> ThreadPlan:
    """Plan this rank's intra-op threads from all local ranks' affinity masks.

    Args:
        threads: explicit thread count; wins over everything.
        group: process group of this node's ranks. A gloo group is used as is (with its own
            timeout); for another backend (NCCL) a gloo group over the same ranks is made once and
            reused. Default, when torch.distributed is initialised: the ranks of this node from
            LOCAL_RANK/LOCAL_WORLD_SIZE (all ranks, filtered by host name, if those are unset).
            Every rank of that group must call this function.
        smt: count SMT siblings as CPUs (default: physical cores only).
        timeout_s: seconds the exchange on a gloo group made here may wait before
            :class:`ThreadPlanError` (the group keeps the timeout of the call that made it).
        topology: the CPU topology (default: :func:`offload._topology.read_cpu_topology`).
        cpus: this rank's mask (default: ``os.sched_getaffinity(0)``).
        cpu_count: the machine's CPU count for the static rule (default: ``os.cpu_count()``).
        agreement: an ``autotune`` agreement over this node's ranks (``rank``, ``world_size``,
            ``all_gather(obj, *, step, what)``): the masks are gathered through it instead of a gloo
            group made here. The caller owns it (it is not closed). Not with ``group`` or ``masks``.
        masks: every local rank's mask (:class:`RankCpus`, or CPU ids), in local-rank order, handed
            in: nothing is exchanged (simulations, tests). Needs ``local_rank``; ``cpus``, when
            given, must be ``masks[local_rank]``'s CPUs. A :class:`RankCpus` carries its cgroup
            quota; the topology's is not added. Not with ``group`` or ``agreement``.
        local_rank: this rank's index in ``masks`` (only with ``masks``).

    Raises:
        ThreadPlanError: bad ``threads``, an empty mask, inconsistent launcher variables, or a
            failed exchange. ``autotune.knobs.KnobError``: a malformed environment variable.
    """
    if threads is not None:
        _check_threads(threads, "threads")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ThreadPlanError(f"Unable to use timeout_s={timeout_s!r}: expected a number of seconds > 0")
    given = [name for name, value in (("group", group), ("agreement", agreement), ("masks", masks))
             if value is not None]
    if len(given) > 1:
        raise ThreadPlanError(f"plan_cpu_threads: {' and '.join(given)} given: pass at most one of them")
    if local_rank is not None and masks is None:
        raise ThreadPlanError(f"plan_cpu_threads: local_rank={local_rank!r} without masks=: expected both")
    env_threads = knobs.threads_override()  # validated before any collective
    topo = topology if topology is not None else read_cpu_topology()
    if masks is not None:
        local, index = _given_masks(masks, local_rank, cpus)
        me = local[index]
        masks_from: MasksFrom = "given"
    else:
        me = RankCpus(cpus=frozenset(cpus) if cpus is not None else _affinity(), cgroup=topo.cgroup_limit)
        local, index, masks_from = _local_masks(me, group=group, agreement=agreement, timeout_s=timeout_s)
    if len(local) == 1:
        masks_from = "single"
    mine = me.cpus

    alloc = allocate_threads(local, topo, smt=smt)
    ncpu = cpu_count if cpu_count is not None else (os.cpu_count() or len(mine))
    statics = [static_rule_threads(len(m.cpus), ncpu, len(local)) for m in local]
    oversubscribed = sum(statics) > alloc.capacity
    planned = alloc.threads[index]
    source: PlanSource
    if threads is not None:
        requested, source = threads, "argument"
        chosen = _clamp_to_mask(threads, "threads", mine)
    elif env_threads is not None:
        requested, source = env_threads, "environment"
        chosen = _clamp_to_mask(env_threads, knobs.THREADS_VAR, mine)
    else:
        requested = chosen = planned
        source = "plan"
    reason = _reason(alloc=alloc, index=index, masks=local, masks_from=masks_from, topology=topo,
                     smt=smt, static=statics[index], statics=statics, cpu_count=ncpu,
                     oversubscribed=oversubscribed, chosen=chosen, source=source, requested=requested)
    plan = ThreadPlan(
        threads=chosen,
        reason=reason,
        source=source,
        cpus=mine,
        local_world_size=len(local),
        local_rank=index,
        planned_threads=planned,
        local_threads=alloc.threads,
        local_masks=tuple(m.cpus for m in local),
        masks_from=masks_from,
        smt=smt,
        cgroup_cpus=None if me.cgroup is None else me.cgroup.cpus,
        static_rule_threads=statics[index],
        oversubscribed_by_static_rule=oversubscribed,
    )
    _log_once(plan)
    return plan


# --------------------------------------------------------------------------- process state


@contextlib.contextmanager
def thread_limit(threads: int) -> Iterator[None]:
    """Set torch's intra-op thread count for the block; restore the previous count after.

    ``threads`` above ``autotune.knobs.MAX_THREADS`` raises :class:`ThreadPlanError`; above this
    process's CPUs it is used as given, with a warning once (the plan clamps; this is the mechanism).
    """
    _check_threads(threads, "threads")
    cpus = _affinity()
    if threads > len(cpus):
        _warn_once("thread_limit", threads, cpus,
                   "thread_limit(%d): more threads than the %d CPUs of this process's affinity mask (%s); "
                   "they only time-slice them", threads, len(cpus), format_cpulist(cpus))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def apply_thread_plan(plan: ThreadPlan) -> int:
    """``torch.set_num_threads(plan.threads)``; returns the previous count (to restore it)."""
    _check_threads(plan.threads, "ThreadPlan.threads")
    previous = torch.get_num_threads()
    torch.set_num_threads(plan.threads)
    return previous


class NumaBinding:
    """What a NUMA bind changed; ``restore()`` (or leaving the ``with`` block) undoes it.

    ``node``: the NUMA node bound to, or None. ``cpus``: the calling thread's mask after the bind
    (``previous`` when skipped). ``previous``: its mask before. ``bound``: whether the mask was
    narrowed to the node.
    """

    __slots__ = ("node", "cpus", "previous", "bound", "_changed")

    def __init__(self, *, node: int | None, cpus: frozenset[int], previous: frozenset[int],
                 bound: bool, changed: tuple[tuple[int, frozenset[int]], ...] = ()) -> None:
        self.node = node
        self.cpus = cpus
        self.previous = previous
        self.bound = bound
        self._changed = changed

    def restore(self) -> None:
        """Give every thread the bind changed its previous mask back (idempotent)."""
        changed, self._changed = self._changed, ()
        for tid, mask in changed:
            with contextlib.suppress(OSError):  # the thread may have exited
                os.sched_setaffinity(tid, mask)

    def __enter__(self) -> NumaBinding:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def __repr__(self) -> str:
        return f"NumaBinding(node={self.node}, cpus={format_cpulist(self.cpus)!r}, bound={self.bound})"


def _skip(node: int | None, why: str, *args: object) -> NumaBinding:
    logger.warning("NUMA bind skipped, mask kept: " + why, *args)
    mask = _affinity()
    return NumaBinding(node=node, cpus=mask, previous=mask, bound=False)


def bind_to_numa_node(node: int, *, root: Path | str = "/") -> NumaBinding:
    """Narrow this process's threads to the CPUs of NUMA node ``node`` that they may already use.

    The new mask is the intersection of the node's cpulist (``root/sys/devices/system/node``) and
    the calling thread's mask; every thread whose mask equals the caller's is narrowed too (threads
    started later inherit it). A CPU-less node, an unknown node or an empty intersection logs a
    warning and changes nothing. Returns a handle whose ``restore()`` undoes the change.
    """
    path = Path(root) / "sys" / "devices" / "system" / "node" / f"node{node}" / "cpulist"
    try:
        node_cpus = parse_cpulist(path.read_text(), what=str(path))
    except OSError:
        return _skip(node, "NUMA node %s has no cpulist at %s", node, path)
    if not node_cpus:
        return _skip(node, "NUMA node %s has no CPUs (a memory-only node)", node)
    previous = _affinity()
    target = previous & node_cpus
    if not target:
        return _skip(node, "NUMA node %s CPUs %s do not intersect the mask %s", node,
                     format_cpulist(node_cpus), format_cpulist(previous))
    changed: list[tuple[int, frozenset[int]]] = []
    if target != previous:
        own = threading.get_native_id()
        os.sched_setaffinity(0, target)
        changed.append((own, previous))
        with contextlib.suppress(OSError):
            for name in os.listdir("/proc/self/task"):
                tid = int(name)
                if tid == own:
                    continue
                with contextlib.suppress(OSError):
                    if frozenset(os.sched_getaffinity(tid)) == previous:
                        os.sched_setaffinity(tid, target)
                        changed.append((tid, previous))
    logger.info("bound %d threads to NUMA node %d: CPUs %s (was %s)", len(changed), node,
                format_cpulist(target), format_cpulist(previous))
    return NumaBinding(node=node, cpus=target, previous=previous, bound=True, changed=tuple(changed))


def _device_pci_bus_id(index: int) -> str:
    """sysfs PCI address of CUDA device ``index`` (the one place that reads device properties)."""
    props = torch.cuda.get_device_properties(index)
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def bind_to_device_numa_node(device: torch.device | int | str | None = None, *,
                             root: Path | str = "/") -> NumaBinding:
    """Bind to the NUMA node of a CUDA device (default: the current one), see :func:`bind_to_numa_node`.

    A no-op (``bound=False``) without CUDA, for a non-CUDA device, or when sysfs reports no NUMA
    node for the device (``numa_node`` = -1).
    """
    if not torch.cuda.is_available():
        logger.debug("NUMA bind skipped: no CUDA device")
        mask = _affinity()
        return NumaBinding(node=None, cpus=mask, previous=mask, bound=False)
    if device is None:
        index = torch.cuda.current_device()
    else:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            mask = _affinity()
            return NumaBinding(node=None, cpus=mask, previous=mask, bound=False)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
    bus_id = _device_pci_bus_id(index)
    node = read_pci_numa_node(bus_id, root)
    if node is None:
        logger.info("NUMA bind skipped: sysfs reports no NUMA node for cuda:%d (%s)", index, bus_id)
        mask = _affinity()
        return NumaBinding(node=None, cpus=mask, previous=mask, bound=False)
    return bind_to_numa_node(node, root=root)


# ---- NUMA placement of one rank's optimizer state (before its slabs are allocated) ----------


def numa_node_for(
    *, mask: frozenset[int], nodes: Sequence[tuple[int, frozenset[int]]], device_node: int | None
) -> int | None:
    """The NUMA node a rank's host state belongs on, or None when there is nothing to choose.

    With a GPU: the node sysfs reports for it (``device_node``; the copies cross no socket link).
    Without: the node holding most CPUs of the rank's affinity mask (ties: the lowest id), so the
    threads that compute on the state sit next to it. None on a single-node machine, or when the
    mask meets no node's CPUs.
    """
    if device_node is not None:
        return device_node
    if len(nodes) < 2:
        return None
    best = max(((len(mask & cpus), -node) for node, cpus in nodes), default=(0, 0))
    return -best[1] if best[0] > 0 else None


def bind_rank_numa_node(device: torch.device | str | None = None, *,
                        root: Path | str = "/") -> NumaBinding:
    """Bind this process to the NUMA node of its GPU (``device`` on CUDA), or of its affinity mask
    (CPU), see :func:`numa_node_for`; a no-op binding where there is nothing to choose."""
    from offload._topology import read_numa_nodes  # (kept local: this section stands alone)

    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        return bind_to_device_numa_node(dev, root=root)
    mask = _affinity()
    node = numa_node_for(mask=mask, nodes=read_numa_nodes(root), device_node=None)
    if node is None:
        logger.debug("NUMA bind skipped: one NUMA node, or the mask %s meets none", format_cpulist(mask))
        return NumaBinding(node=None, cpus=mask, previous=mask, bound=False)
    return bind_to_numa_node(node, root=root)
