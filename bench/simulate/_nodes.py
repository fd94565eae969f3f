"""The simulated nodes of ``python -m bench.simulate``: hardware, each local rank's mask, workload.

The targets are judged on every node. The first three, :data:`REQUIRED_NODES` (two sockets of 60
cores with NUMA-bound or shared masks, one 16-core socket), are the ones ``--quick`` runs; the
others widen the picture (exclusive masks, overlap with backward, 2 ranks, a smaller 2-socket
node whose 8 ranks share one mask, ranks whose cores span both sockets). The ``-contended`` nodes
are two of them on a shared host: load episodes of :mod:`bench.simulate._contention` come and go, and the
truth is each setting's mean over the run's load, not its quiet time.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from bench.simulate._contention import Contention
from bench.simulate._stepmodel import Hardware, Node, Workload

__all__ = ["NODES", "REQUIRED_NODES", "build_node"]


def _two_socket(masks: str, *, overlap: bool = False) -> Node:
    hw = Hardware(sockets=2, cores_per_socket=60, smt=2)
    sockets = [hw.socket_cpus(s) for s in range(2)]
    if masks == "numa":
        ranks = tuple(sockets[r // 4] for r in range(8))
        text = "8 ranks, each bound to its socket's NUMA node (4 ranks share each 120-CPU socket mask)"
    elif masks == "shared":
        ranks = (frozenset(range(hw.logical_cpus)),) * 8
        text = "8 ranks on one shared mask: all 240 CPUs (no binding, one cpuset)"
    elif masks == "exclusive":
        ranks = tuple(
            frozenset(hw.cpu(r // 4, c, t) for c in range((r % 4) * 15, (r % 4 + 1) * 15) for t in range(2))
            for r in range(8)
        )
        text = "8 ranks, each with its own 15 cores + SMT siblings (30 CPUs), 4 per socket"
    elif masks == "cyclic":
        # Slurm's default block:cyclic distribution: each rank's 15 cores alternate between the
        # sockets (8 on one, 7 on the other), so every rank's memory and threads span both.
        order = [(j % 2, j // 2) for j in range(2 * hw.cores_per_socket)]
        ranks = tuple(
            frozenset(hw.cpu(s, c, t) for s, c in order[r * 15:(r + 1) * 15] for t in range(2)) for r in range(8)
        )
        text = "8 ranks, each with 15 cores + SMT siblings spread over both sockets (Slurm's cyclic distribution)"
    else:
        raise ValueError(f"masks={masks!r}: expected 'numa', 'shared', 'exclusive' or 'cyclic'")
    wl = Workload(params=2_000_000_000, overlap_backward=overlap)
    name = f"2s60c-smt2-8r-{masks}" + ("-overlap" if overlap else "")
    if overlap:
        text += "; optimizer step overlapped with backward (objective: iteration time)"
    return Node(name=name, hardware=hw, masks=ranks, workload=wl,
                description=f"2 sockets x 60 cores x SMT2 (240 CPUs, 2 NUMA domains); {text}; 2e9 params per rank")


def _small_two_socket_shared() -> Node:
    """A smaller 2-socket node (2 x 32 cores, SMT2, 200 GB/s per socket) whose 8 ranks share one mask."""
    hw = Hardware(sockets=2, cores_per_socket=32, smt=2, domain_bw_gbs=200.0)
    wl = Workload(params=1_000_000_000)
    return Node(name="2s32c-smt2-8r-shared", hardware=hw, masks=(frozenset(range(hw.logical_cpus)),) * 8,
                workload=wl,
                description="2 sockets x 32 cores x SMT2 (128 CPUs, 2 NUMA domains of 200 GB/s); 8 ranks on one "
                            "shared mask of all 128 CPUs; 1e9 params per rank")


def _one_socket(ranks: int = 1) -> Node:
    hw = Hardware(sockets=1, cores_per_socket=16, smt=2, domain_bw_gbs=110.0)
    wl = Workload(params=1_000_000_000 // ranks)
    who = "1 rank on all CPUs" if ranks == 1 else f"{ranks} ranks sharing all CPUs"
    return Node(name=f"1s16c-smt2-{ranks}r", hardware=hw, masks=(frozenset(range(hw.logical_cpus)),) * ranks,
                workload=wl,
                description=f"1 socket x 16 cores x SMT2 (32 CPUs, 110 GB/s); {who}; {1e9 / ranks:.0e} params per rank")


def _contended(node: Node, episodes: tuple[tuple[float, ...], ...], what: str) -> Node:
    """``node`` on a shared host: load episodes (mean 100 steps, quiet spells mean 150) of ``episodes``."""
    return replace(node, name=f"{node.name}-contended", contention=Contention(episodes=episodes),
                   description=f"{node.description}; shared host: load episodes of {what}, 40 % of the steps")


#: Node name -> builder. The first three are :data:`REQUIRED_NODES`; the others widen the picture.
NODES: dict[str, Callable[[], Node]] = {
    "2s60c-smt2-8r-numa": lambda: _two_socket("numa"),
    "2s60c-smt2-8r-shared": lambda: _two_socket("shared"),
    "1s16c-smt2-1r": lambda: _one_socket(1),
    "2s60c-smt2-8r-exclusive": lambda: _two_socket("exclusive"),
    "2s60c-smt2-8r-numa-overlap": lambda: _two_socket("numa", overlap=True),
    "1s16c-smt2-2r": lambda: _one_socket(2),
    "2s32c-smt2-8r-shared": _small_two_socket_shared,
    "2s60c-smt2-8r-cyclic": lambda: _two_socket("cyclic"),
    # A 2-rank workstation: a data loader's 4 workers, or a neighbour's 8-thread job.
    "1s16c-smt2-2r-contended": lambda: _contended(
        _one_socket(2), ((4.0,), (8.0,)), "4 or 8 busy threads (a data loader, a neighbour's job)"),
    # An 8-GPU node: 8 ranks' data loaders (16 busy threads per socket), or a neighbour's job on socket 0.
    "2s60c-smt2-8r-numa-contended": lambda: _contended(
        _two_socket("numa"), ((16.0, 16.0), (30.0, 0.0)),
        "16 busy threads per socket (data loaders) or 30 on socket 0 (a neighbour's job)"),
}
#: The nodes ``--quick`` runs (the targets are judged on every node of a run).
REQUIRED_NODES = ("2s60c-smt2-8r-numa", "2s60c-smt2-8r-shared", "1s16c-smt2-1r")


def build_node(name: str) -> Node:
    """The node called ``name`` (a key of :data:`NODES`)."""
    try:
        return NODES[name]()
    except KeyError:
        raise ValueError(f"unknown node {name!r}: expected one of {sorted(NODES)}") from None
