"""Where the local ranks' affinity masks come from, for the thread plan.

In order: handed in (``masks=``: simulations, tests); gathered through the caller's ``autotune``
agreement (``agreement=``); exchanged over a gloo group made here when torch.distributed is
initialised (never over NCCL, and with a timeout, so a missing rank raises instead of hanging);
else LOCAL_WORLD_SIZE ranks are assumed to share this rank's mask.
"""

from __future__ import annotations

import logging
import socket
import threading
import weakref
from datetime import timedelta
from typing import Any, Iterable, Literal, Sequence

from offload._settings import local_rank, local_world_size
from offload.threads._rule import RankCpus, ThreadPlanError
from offload.threads._topology import CgroupCpuLimit, format_cpulist, parse_cpulist

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_EXCHANGE_TIMEOUT_S", "MasksFrom", "given_masks", "local_masks"]

#: Seconds the mask exchange may wait for the other local ranks before it raises.
DEFAULT_EXCHANGE_TIMEOUT_S = 120.0

MasksFrom = Literal["collective", "agreement", "given", "environment", "single"]


def _payload(me: RankCpus, rank: int) -> dict[str, Any]:
    limit = me.cgroup
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "cpus": format_cpulist(me.cpus),
        "cgroup": None if limit is None else limit.cgroup,
        "cgroup_cpus": None if limit is None else limit.cpus,
        "node": me.node,
    }


def _from_payload(item: object, source_rank: int) -> tuple[str, RankCpus]:
    if not isinstance(item, dict) or not isinstance(item.get("cpus"), str):
        raise ThreadPlanError(f"rank {source_rank} sent {item!r}: expected a thread-plan payload")
    cpus = parse_cpulist(item["cpus"], what=f"affinity mask of rank {source_rank}")
    limit = None
    if item.get("cgroup") is not None and item.get("cgroup_cpus") is not None:
        limit = CgroupCpuLimit(cpus=float(item["cgroup_cpus"]), cgroup=str(item["cgroup"]))
    node = item.get("node")
    if node is not None and (isinstance(node, bool) or not isinstance(node, int) or node < 0):
        raise ThreadPlanError(f"rank {source_rank} sent NUMA node {node!r}: expected None or an int >= 0")
    return str(item.get("host")), RankCpus(cpus=cpus, cgroup=limit, node=node)


def _node_ranks(group: Any) -> tuple[list[int], bool, str]:
    """Global ranks to exchange with, whether to keep only this host's, and how they were found."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if group is not None:
        return list(dist.get_process_group_ranks(group)), False, "the given process group"
    size, local = local_world_size(), local_rank()
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


def given_masks(masks: Sequence[RankCpus | Iterable[int]], local_rank: int | None,
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


def local_masks(me: RankCpus, *, group: Any, agreement: Any,
                timeout_s: float) -> tuple[list[RankCpus], int, MasksFrom]:
    """Every local rank's input, this rank's index, and where they came from: ``agreement``, else
    a gloo exchange when torch.distributed is initialised, else LOCAL_WORLD_SIZE copies of ``me``."""
    if agreement is not None:
        return (*_exchange_with(me, agreement), "agreement")
    exchanged = _exchange(me, group=group, timeout_s=timeout_s)
    if exchanged is not None:
        masks, index, _ = exchanged
        return masks, index, "collective"
    size = local_world_size()
    local = local_rank() if size is not None else None  # LOCAL_RANK alone: one rank
    size, local = size or 1, local or 0
    if local >= size:
        raise ThreadPlanError(
            f"LOCAL_RANK={local} with LOCAL_WORLD_SIZE={size}: expected LOCAL_RANK < LOCAL_WORLD_SIZE"
        )
    return [me] * size, local, "environment"
