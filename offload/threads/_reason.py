"""The thread plan's reason: one sentence that says how this rank's thread count came about.

Every number the rule used is named (mask size, sharing, SMT siblings, cgroup caps, the static
rule it replaces, an override), so a log line alone explains a plan.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Sequence

from offload._settings import THREADS_VAR, KnobError, omp_num_threads
from offload.threads._rule import Allocation, RankCpus
from offload.threads._topology import CpuTopology, format_cpulist

__all__ = ["plan_reason"]


def _fmt(x: Fraction) -> str:
    return str(int(x)) if x.denominator == 1 else f"{float(x):.2f}"


def _count(x: int | Fraction, word: str) -> str:
    return f"{_fmt(Fraction(x))} {word}" + ("" if x == 1 else "s")


def plan_reason(*, alloc: Allocation, index: int, masks: Sequence[RankCpus], masks_from: str,
                topology: CpuTopology, smt: bool, static: int, statics: Sequence[int], cpu_count: int,
                oversubscribed: bool, chosen: int, source: str, requested: int) -> str:
    """The reason of local rank ``index``'s plan: ``alloc`` over ``masks`` (from ``masks_from``),
    the static rule's ``statics``, and the ``chosen`` threads (``requested`` by ``source``)."""
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
        parts.append(f"{THREADS_VAR}={requested}{clamped} overrides the plan's {planned}")
    try:
        omp = omp_num_threads()
    except KnobError:  # e.g. OpenMP's nested "4,2": not ours to judge, only reported
        omp = None
    if omp is not None and omp != chosen:
        parts.append(f"OMP_NUM_THREADS={omp} (a launcher default) is not obeyed")
    return "; ".join(parts)
