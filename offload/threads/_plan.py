"""Thread budget for the CPU step: how many intra-op threads this rank may use, and why.

:func:`plan_cpu_threads` gathers every local rank's affinity mask (:mod:`offload.threads._masks`)
and applies the allocation rule (:mod:`offload.threads._rule`: physical cores, shared CPUs split,
cgroup quotas) on the CPU topology (:mod:`offload.threads._topology`); the resulting :class:`ThreadPlan`
carries a reason naming every number used (:mod:`offload.threads._reason`). An explicit override wins:
the ``threads=`` argument, then ``OFFLOAD_AUTOTUNE_THREADS``. It is clamped, with a warning naming
the value used, to the CPUs of this rank's affinity mask (more threads than CPUs only time-slice
them: issue 12 measured 1000 threads on 2 CPUs 80x slower), and above ``offload._settings.MAX_THREADS``
it is an error (torch.set_num_threads(100000) crashes).

:func:`thread_limit` and :func:`apply_thread_plan` change torch's intra-op thread count (the
mechanism; the plan is the policy).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal, Sequence

import torch

from offload._settings import MAX_THREADS, THREADS_VAR, threads_override
from offload.threads._masks import DEFAULT_EXCHANGE_TIMEOUT_S, MasksFrom, given_masks, local_masks
from offload.threads._reason import plan_reason
from offload.threads._rule import Allocation, RankCpus, ThreadPlanError, allocate_threads, static_rule_threads
from offload.threads._topology import CpuTopology, format_cpulist, read_affinity, read_cpu_topology

if TYPE_CHECKING:
    from autotune import Agreement

logger = logging.getLogger(__name__)

__all__ = [
    "RankCpus",
    "ThreadPlan",
    "ThreadPlanError",
    "apply_thread_plan",
    "forget_logged_plans",
    "plan_cpu_threads",
    "thread_limit",
]

PlanSource = Literal["argument", "environment", "plan"]


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
    bound_threads: int | None = None
    """Threads this rank may use once bound to its NUMA node (``OffloadSettings.bind_numa``
    switched on between steps): the same rule on every local rank's mask narrowed to its node's
    CPUs (:attr:`RankCpus.node`), so the bound ranks never oversubscribe their nodes; with an
    override (``source`` not "plan"), the override clamped to the narrowed mask. None where no
    rank binds (one NUMA node, nodes unknown): then ``threads`` holds."""
    local_masks_per_numa_node: tuple[tuple[int, ...], ...] = ()
    """Per local rank, how many CPUs of its mask lie in each NUMA node (nodes in id order); empty on
    a machine of one NUMA node. The tuner's cache key holds it: a mask spread over two nodes and
    one inside a node are different optima."""
    masks_from: str = "single"
    """"collective" (exchanged over gloo), "agreement" (exchanged through the caller's agreement),
    "given" (handed in with ``masks=``), "environment" (LOCAL_WORLD_SIZE copies of this mask), "single"."""
    smt: bool = False
    """Whether SMT siblings were counted as CPUs."""
    cgroup_cpus: float | None = None
    """The cgroup CPU quota (CPUs) that applied, if any."""
    static_rule_threads: int | None = None
    """The static rule ``min(len(mask), os.cpu_count() // local_world_size)`` for this rank (what
    a launcher-side "cores / ranks" recipe would give; the plan's reason compares with it)."""
    oversubscribed_by_static_rule: bool = False
    """Whether the static rule, applied on every local rank, totals more threads than the budget."""
    starved: str | None = None
    """Why the local ranks' masks starve the CPU step (less than one physical core per rank, or a
    small fraction of the machine), with the figures and what to do; None when they do not. Local
    rank 0 logs it once as a WARNING; a tuned optimizer's trace summary lists it under ``warnings``
    (``python -m autotune show --run`` prints it)."""


#: Masks covering at most this fraction of a machine of at least STARVED_MIN_CPUS CPUs starve the
#: step even at a core per rank: it is bound by memory bandwidth, which wants more cores.
STARVED_FRACTION = 1 / 8
STARVED_MIN_CPUS = 16


def starvation(*, alloc: Allocation, local_world_size: int, cpu_count: int, physical_cores: int) -> str | None:
    """The warning for masks that starve the CPU step, or None (see :attr:`ThreadPlan.starved`)."""
    covered = alloc.covered_cpus
    per_rank = alloc.counted_units / local_world_size
    small = cpu_count >= STARVED_MIN_CPUS and covered <= cpu_count * STARVED_FRACTION
    if per_rank >= 1 and not small:
        return None
    what = (f"{float(per_rank):.2g} of a physical core per rank" if per_rank < 1
            else f"{covered} of the machine's {cpu_count} CPUs")
    return (f"CPU starvation: {local_world_size} local rank(s) have {covered} CPU(s) in their affinity masks "
            f"({float(alloc.counted_units):g} physical core(s); the machine has {physical_cores} physical cores, "
            f"{cpu_count} CPUs): {what}. The CPU optimizer step is bound by memory bandwidth and runs many "
            "times slower so (a reported 8-rank job given 2 CPUs stepped in 1227 s instead of 15.5 s). "
            "Give each rank its cores: srun --cpus-per-task=N (Slurm), torchrun --numa-binding=exclusive "
            "(or no cpuset of a few CPUs around torchrun), or numactl --physcpubind per rank")


def _check_threads(value: object, what: str) -> int:
    """``value`` if it is an int from 1 to ``MAX_THREADS``: nothing else reaches set_num_threads."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
        raise ThreadPlanError(f"Unable to use {what}={value!r}: expected an int from 1 to {MAX_THREADS}")
    return value


#: What was logged once already: plans (threads, reason), and warnings (what, requested, mask).
_LOGGED: set[tuple[int, str]] = set()
_WARNED: set[tuple[str, int, frozenset[int]]] = set()
_LOG_LOCK = threading.Lock()


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


def _log_once(plan: ThreadPlan) -> None:
    key = (plan.threads, plan.reason)
    with _LOG_LOCK:
        first = key not in _LOGGED
        _LOGGED.add(key)
    logger.log(logging.INFO if first else logging.DEBUG, "thread plan: %d threads: %s",
               plan.threads, plan.reason)


def forget_logged_plans() -> None:
    """Log the next plan at INFO even if it was logged before (each distinct plan is logged at
    INFO once per process, then at DEBUG, so a loop that re-plans does not flood the log)."""
    with _LOG_LOCK:
        _LOGGED.clear()


def plan_cpu_threads(
    *,
    threads: int | None = None,
    group: Any = None,
    smt: bool = False,
    timeout_s: float = DEFAULT_EXCHANGE_TIMEOUT_S,
    topology: CpuTopology | None = None,
    cpus: Iterable[int] | None = None,
    cpu_count: int | None = None,
    agreement: Agreement | None = None,
    masks: Sequence[RankCpus | Iterable[int]] | None = None,
    local_rank: int | None = None,
    bind_node: int | None = None,
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
        topology: the CPU topology (default: :func:`offload.threads._topology.read_cpu_topology`).
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
        bind_node: the NUMA node this rank binds to under ``bind_numa`` (exchanged with the masks;
            with ``masks``, each :class:`RankCpus` carries its own ``node`` instead): the input of
            :attr:`ThreadPlan.bound_threads`.

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
    env_threads = threads_override()  # validated before any collective
    topo = topology if topology is not None else read_cpu_topology()
    if masks is not None:
        local, index = given_masks(masks, local_rank, cpus)
        me = local[index]
        masks_from: MasksFrom = "given"
    else:
        me = RankCpus(cpus=frozenset(cpus) if cpus is not None else read_affinity(), cgroup=topo.cgroup_limit,
                      node=bind_node)
        local, index, masks_from = local_masks(me, group=group, agreement=agreement, timeout_s=timeout_s)
    if len(local) == 1:
        masks_from = "single"
    mine = me.cpus

    alloc = allocate_threads(local, topo, smt=smt)
    ncpu = cpu_count if cpu_count is not None else (os.cpu_count() or len(mine))
    starved = starvation(alloc=alloc, local_world_size=len(local), cpu_count=max(ncpu, alloc.covered_cpus),
                         physical_cores=len(topo.cores) or int(ncpu * topo.physical_per_logical))
    statics = [static_rule_threads(len(m.cpus), ncpu, len(local)) for m in local]
    oversubscribed = sum(statics) > alloc.capacity
    planned = alloc.threads[index]
    source: PlanSource
    if threads is not None:
        requested, source = threads, "argument"
        chosen = _clamp_to_mask(threads, "threads", mine)
    elif env_threads is not None:
        requested, source = env_threads, "environment"
        chosen = _clamp_to_mask(env_threads, THREADS_VAR, mine)
    else:
        requested = chosen = planned
        source = "plan"
    reason = plan_reason(alloc=alloc, index=index, masks=local, masks_from=masks_from, topology=topo,
                     smt=smt, static=statics[index], statics=statics, cpu_count=ncpu,
                     oversubscribed=oversubscribed, chosen=chosen, source=source, requested=requested)
    bound = bound_allocation(local, topo, smt=smt)
    bound_threads = None
    if bound is not None:
        narrowed, threads_bound = bound
        bound_threads = threads_bound[index] if source == "plan" else min(chosen, len(narrowed[index]))
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
        bound_threads=bound_threads,
        local_masks_per_numa_node=masks_per_numa_node([m.cpus for m in local], topo),
        masks_from=masks_from,
        smt=smt,
        cgroup_cpus=None if me.cgroup is None else me.cgroup.cpus,
        static_rule_threads=statics[index],
        oversubscribed_by_static_rule=oversubscribed,
        starved=starved,
    )
    _log_once(plan)
    if starved is not None and index == 0:  # once per node: every rank computes the same words
        _warn_once("starved", len(local), frozenset().union(*(m.cpus for m in local)), "%s", starved)
    return plan


def bound_allocation(masks: Sequence[RankCpus], topology: CpuTopology, *, smt: bool = False
                     ) -> tuple[tuple[frozenset[int], ...], tuple[int, ...]] | None:
    """Every rank's mask narrowed to its NUMA node (:attr:`RankCpus.node`; unchanged where the node
    is unknown or meets none of the mask, as the bind then changes nothing) and the threads the
    rule gives each on those masks; None when no rank's mask narrows (one node, no node known)."""
    nodes = dict(topology.numa_nodes)
    if len(nodes) < 2:
        return None
    narrowed = [m if m.node is None else replace(m, cpus=(m.cpus & nodes.get(m.node, frozenset())) or m.cpus)
                for m in masks]
    if all(n.cpus == m.cpus for n, m in zip(narrowed, masks)):
        return None
    return tuple(n.cpus for n in narrowed), allocate_threads(narrowed, topology, smt=smt).threads


def masks_per_numa_node(masks: Sequence[frozenset[int]], topology: CpuTopology) -> tuple[tuple[int, ...], ...]:
    """Per mask, its CPU count in each NUMA node of ``topology`` (id order); () with fewer than
    two nodes (see :attr:`ThreadPlan.local_masks_per_numa_node`)."""
    if len(topology.numa_nodes) < 2:
        return ()
    return tuple(tuple(len(m & cpus) for _, cpus in topology.numa_nodes) for m in masks)


# --------------------------------------------------------------------------- process state


@contextlib.contextmanager
def thread_limit(threads: int) -> Iterator[None]:
    """Set torch's intra-op thread count for the block; restore the previous count after.

    ``threads`` above ``offload._settings.MAX_THREADS`` raises :class:`ThreadPlanError`; above this
    process's CPUs it is used as given, with a warning once (the plan clamps; this is the mechanism).
    """
    _check_threads(threads, "threads")
    cpus = read_affinity()
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
