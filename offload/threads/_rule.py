"""The thread allocation rule: the CPUs the local ranks' masks cover, split into thread counts.

Pure and deterministic (docs/environment.md explains the rule to users):

1. The counted units are physical cores: a core counts once however many of its SMT siblings a
   mask holds, and hyperthreads are never counted unless ``smt=True`` (the AdamW step is
   memory-bandwidth bound; a second hardware thread on a core adds contention, not bandwidth).
2. A unit touched by k local ranks counts 1/k for each. A rank's threads are the floor of its
   share, at least 1. If the one-thread minimum pushes the node's total over the units the masks
   cover, threads are taken back from the ranks with the most threads (deterministically), so the
   total never exceeds the covered CPUs while there are at least as many CPUs as ranks.
3. A cgroup CPU quota caps the total threads of the local ranks in that cgroup at floor(quota)
   (at least one per rank).

Every rank computes the whole node's allocation from the same masks, so the plans agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Iterable, Sequence

from offload.threads._topology import CgroupCpuLimit, CpuTopology

__all__ = ["Allocation", "RankCpus", "ThreadPlanError", "allocate_threads", "static_rule_threads"]


class ThreadPlanError(ValueError):
    """A thread count, mask or process-group layout the thread plan cannot use."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankCpus:
    """One local rank's input to the allocation."""

    cpus: frozenset[int]
    """Its affinity mask."""
    cgroup: CgroupCpuLimit | None = None
    """Its cgroup CPU quota; ranks reporting the same ``cgroup`` key share one quota."""
    node: int | None = None
    """The NUMA node it binds to under ``OffloadSettings.bind_numa`` (its GPU's, or its mask's:
    ``offload.threads._numa.rank_numa_node``); None: unknown, or nothing to bind to. Only the
    bound plan (``ThreadPlan.bound_threads``) reads it."""


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
    """The rule the thread plan replaces: ``min(len(mask), cpu_count // local_world_size)``, >= 1."""
    return max(1, min(mask_size, cpu_count // max(1, local_world_size)))

