"""A step-time model of the offloaded AdamW step on a multi-socket node, standing in for the clock.

``python -m bench.simulate`` drives the real ``autotune.OnlineTuner`` with times from this model
instead of real steps. The model is deliberately simple and every parameter is a named field of
:class:`Hardware` or :class:`Workload`; the defaults are calibrated loosely on this project's own
measurements (``bench/results/bandwidth-h200host.md``: one core moves about 20 GB/s, a socket
saturates well before all its cores are busy, a chunk costs about 100-200 us of fixed overhead).

Per rank and step (all local ranks step together, so they share the memory system all the time):

1. Placement. A rank's threads spread evenly over the logical CPUs of its affinity mask. CPUs are
   grouped into *classes* (same socket, same set of ranks whose masks hold them). Per class, the
   threads of every rank plus ``background_threads`` per rank (Python main thread, data loader,
   NCCL progress) compete for its physical cores and SMT siblings.
2. Core units. A class with ``T`` threads on ``k`` cores and ``l`` logical CPUs gives
   ``min(T, k) + smt_gain * clip(T - k, 0, l - k)`` core units: an SMT sibling adds ``smt_gain``
   (5 %) of a core. When the runnable threads exceed ``l`` the class is time-sliced and OpenMP's
   barriers stall on descheduled threads: the kernel is slower by ``1 + oversub_penalty * (ratio - 1)``.
3. Bandwidth. Each NUMA domain delivers ``softmin(demand * core_bw, domain_bw)`` (a saturating
   curve, exponent ``saturation_sharpness``), minus a small contention loss beyond saturation
   (``contention_loss`` per 100 % of excess demand, at most ``max_contention_loss``). A rank's
   memory lives on the domains of its mask (in proportion to its CPUs there); it gets the share of
   each domain's bandwidth proportional to its demand there, and a thread on another socket gets
   only ``remote_efficiency`` of its share through. A rank whose mask is shared with other ranks pays
   ``shared_mask_penalty`` (unpinned threads migrate between cores).
4. Kernel time per element = ``max(bytes_per_elem / rank bandwidth, 1 / (core units * core_rate))``.
5. Pipeline. ``ceil(params / chunk)`` chunks flow through three stages: d2h over PCIe, the CPU
   kernel (plus a fixed ``chunk_overhead_s + chunk_overhead_per_thread_s * threads`` per chunk:
   tiny chunks lose) and h2d over PCIe. The finish time is the exact flow-shop recurrence, so a
   huge chunk loses the overlap of the copies with the kernel. With ``overlap_backward`` chunk i
   becomes ready at ``backward_s * (i + 1) / n`` during backward and the objective is the whole
   iteration (forward + backward + the exposed part of the step), as the offload glue measures;
   ``Workload.last_grads_share`` of the parameters (the embedding, the first layers) are ready
   only at the end of backward. A kernel that starts before backward ends runs with ``backward_threads`` (the optimizer's
   ``OffloadSettings.backward_threads``; its rate from step 4 with those counts), a later one with
   ``threads``. Busy optimizer cores slow the launch-bound part of backward
   (``Workload.backward_launch_share``) by ``Hardware.all_core_clock_drop`` times the busy share
   of the node's cores (the cores' turbo clock falls as more of them work; DeepSpeed Reflow's
   point): the busy share is the optimizer threads running during backward over the physical
   cores, weighted by the fraction of backward their kernels run; backward is stretched by it once
   (one fixed-point step) and the pipeline recomputed on the stretched release times.
6. Node time = max over ranks (the tuner all-gathers and takes the max, too).
7. NUMA binding (``OffloadSettings.bind_numa``, ``bind_numa=True``). Unbound, a rank whose mask
   spans both sockets has its state on both, in proportion to its CPUs there (step 3): the share
   on the other socket is read at ``remote_efficiency`` of the bandwidth. Bound, every rank is
   narrowed to its GPU's socket (``Node.gpu_sockets``; default: the GPUs spread evenly over the
   sockets in rank order, GPUs 0-3 on socket 0 and 4-7 on socket 1 of an 8-GPU node): its mask
   becomes the mask's CPUs on that socket (unchanged where it holds none: the bind is skipped),
   so its threads compete for fewer cores (steps 1-2; its thread count is what the knob says)
   and its state lies on that socket, read locally (step 3). The whole model then runs on the
   narrowed masks. Not modelled: the cost of the page move when the binding is switched on (a
   one-off between steps), and pages left on one socket by an "on" before an "off".

8. Load episodes (``Node.contention``, :mod:`bench.simulate._contention`): ``load=`` gives each socket's busy
   threads at a step; the loaded cores are not available, and a rank whose threads do not fit on
   the free cores is slowed by the time share and barrier stalls of :func:`bench.simulate._contention.team_slowdown`
   (its kernel rate, times the factor of step 2). ``load=()`` or zeros: the quiet model, unchanged.

Noise per measured step: a node-wide lognormal factor, a per-rank lognormal factor and, per rank,
a spike (``spike_factor``, 2x) with probability ``spike_prob``; the first step after a change of
setting is ``warmup_penalty`` slower (the tuner discards it). Noise-free times give the ground truth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from bench.simulate._contention import Contention, busy_core_ratio, team_slowdown
from offload.testing import CpuTopology

__all__ = ["Hardware", "Node", "NoiseModel", "Workload", "overlap_pipeline", "pipeline_time"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """A node's CPUs and memory system (one NUMA domain per socket)."""

    sockets: int
    cores_per_socket: int
    smt: int = 2
    """Hardware threads per core."""
    domain_bw_gbs: float = 250.0
    """Peak DRAM bandwidth of one NUMA domain (GB/s) that the AdamW stream reaches."""
    core_bw_gbs: float = 18.0
    """Bandwidth one core pulls when the domain is idle (GB/s)."""
    saturation_sharpness: float = 4.0
    """Exponent of the soft minimum between demand and the domain's peak (larger: sharper knee)."""
    contention_loss: float = 0.015
    """Fractional bandwidth lost per 100 % of demand beyond the peak (queueing, row conflicts)."""
    max_contention_loss: float = 0.08
    remote_efficiency: float = 0.6
    """Fraction of its bandwidth share a thread on another socket gets through (socket link)."""
    smt_gain: float = 0.05
    """Core units an SMT sibling adds to its core."""
    core_rate_gelem: float = 1.5
    """AdamW elements per second per core when compute bound (G elements/s)."""
    oversub_penalty: float = 4.0
    """Kernel slowdown per unit of runnable threads beyond the logical CPUs (OpenMP barrier stalls)."""
    shared_mask_penalty: float = 0.03
    """Kernel slowdown of a rank whose mask other ranks share (thread migration)."""
    background_threads: float = 2.0
    """Runnable non-optimizer threads per rank competing for its mask's CPUs."""
    pcie_gbs: float = 40.0
    """Per-rank host<->device bandwidth per direction (GB/s)."""
    all_core_clock_drop: float = 0.15
    """Fraction a core's clock falls when every core of the node is busy, against one busy core
    (turbo bins), linear in between: what slows the trainer's launch-bound host work while
    optimizer threads run beside it (only with ``Workload.backward_launch_share``)."""

    def __post_init__(self) -> None:
        for name in ("sockets", "cores_per_socket", "smt"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Hardware.{name}={value!r}: expected an int >= 1")
        for name in ("domain_bw_gbs", "core_bw_gbs", "core_rate_gelem", "pcie_gbs", "saturation_sharpness"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"Hardware.{name}={value!r}: expected a finite number > 0")

    @property
    def logical_cpus(self) -> int:
        return self.sockets * self.cores_per_socket * self.smt

    def cpu(self, socket: int, core: int, thread: int = 0) -> int:
        """Linux numbering: first threads of every core, socket by socket, then the siblings."""
        return thread * self.sockets * self.cores_per_socket + socket * self.cores_per_socket + core

    def socket_of(self, cpu: int) -> int:
        return (cpu % (self.sockets * self.cores_per_socket)) // self.cores_per_socket

    def core_of(self, cpu: int) -> int:
        return cpu % (self.sockets * self.cores_per_socket)

    def socket_cpus(self, socket: int) -> frozenset[int]:
        return frozenset(
            self.cpu(socket, c, t) for c in range(self.cores_per_socket) for t in range(self.smt)
        )

    def topology(self) -> CpuTopology:
        """The :class:`offload.testing.CpuTopology` that ``plan_cpu_threads`` reads on this node."""
        n = self.sockets * self.cores_per_socket
        cores = [[t * n + c for t in range(self.smt)] for c in range(n)]
        return CpuTopology.from_cores(cores, numa_nodes={s: self.socket_cpus(s) for s in range(self.sockets)})

    def domain_bandwidth(self, demand_units: float) -> float:
        """GB/s one domain delivers for ``demand_units`` core units of demand (saturating)."""
        if demand_units <= 0:
            return 0.0
        want = demand_units * self.core_bw_gbs
        p = self.saturation_sharpness
        bw = (want ** -p + self.domain_bw_gbs ** -p) ** (-1.0 / p)
        excess = max(0.0, want / self.domain_bw_gbs - 1.0)
        return bw * (1.0 - min(self.max_contention_loss, self.contention_loss * excess))


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """What one rank's optimizer step moves."""

    params: int
    """Parameters whose optimizer state this rank holds (one parameter group: the largest slab)."""
    bytes_per_elem: float = 40.0
    """Host DRAM bytes per parameter per step (28 B AdamW + upcast of the grad + downcast of the weight)."""
    d2h_bytes_per_elem: float = 2.0
    h2d_bytes_per_elem: float = 2.0
    chunk_overhead_s: float = 60e-6
    """Fixed cost per chunk (launch, events, OpenMP fork/join)."""
    chunk_overhead_per_thread_s: float = 4e-6
    overlap_backward: bool = False
    forward_s: float = 0.4
    backward_s: float = 0.8
    backward_launch_share: float = 0.0
    """Share of ``backward_s`` the trainer's host thread is the bottleneck (launching kernels),
    slowed by busy cores (``Hardware.all_core_clock_drop``); 0: backward is GPU-bound."""
    last_grads_share: float = 0.0
    """With overlap: share of the parameters whose gradients all arrive at the end of backward
    (the embedding and the first layers); the others arrive evenly during it."""

    def __post_init__(self) -> None:
        if isinstance(self.params, bool) or not isinstance(self.params, int) or self.params < 1:
            raise ValueError(f"Workload.params={self.params!r}: expected an int >= 1")
        for name, below in (("backward_launch_share", 1.0), ("last_grads_share", 0.99)):
            share = getattr(self, name)
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= below:
                raise ValueError(f"Workload.{name}={share!r}: expected a number from 0 to {below}")


@dataclass(frozen=True, kw_only=True, slots=True)
class NoiseModel:
    """Heavy-tailed measurement noise: lognormal jitter plus rare spikes."""

    node_sigma: float = 0.02
    rank_sigma: float = 0.02
    spike_prob: float = 0.02
    """Per rank and step."""
    spike_factor: float = 2.0
    warmup_penalty: float = 0.3
    """Extra time of the first step after a change of setting."""

    def factors(self, rng: np.random.Generator, ranks: int) -> np.ndarray:
        """One step's multiplicative noise for each rank."""
        return self.factors_array(rng, (), ranks)

    def factors_array(self, rng: np.random.Generator, shape: tuple[int, ...], ranks: int) -> np.ndarray:
        """Many steps' noise at once: an array of ``shape + (ranks,)`` factors, each ``[..., :]`` one
        step's (``shape=()``: one step, the draws :meth:`factors` makes)."""
        node = rng.lognormal(0.0, self.node_sigma, size=shape)[..., None]
        per_rank = rng.lognormal(0.0, self.rank_sigma, size=shape + (ranks,))
        spikes = np.where(rng.random(shape + (ranks,)) < self.spike_prob, self.spike_factor, 1.0)
        return node * per_rank * spikes


def pipeline_time(
    n_chunks: int, chunk_elems: Sequence[int] | None, *, d2h_s: Sequence[float], kernel_s: Sequence[float],
    h2d_s: Sequence[float], release_s: Sequence[float],
) -> float:
    """Finish time of a three-stage flow shop (d2h -> kernel -> h2d), chunks in order, each stage
    one chunk at a time, chunk ``i`` ready at ``release_s[i]``."""
    d_end = k_end = h_end = 0.0
    for i in range(n_chunks):
        d_end = max(d_end, release_s[i]) + d2h_s[i]
        k_end = max(k_end, d_end) + kernel_s[i]
        h_end = max(h_end, k_end) + h2d_s[i]
    return h_end


def overlap_pipeline(
    sizes: Sequence[int], *, d2h_s: Sequence[float], h2d_s: Sequence[float], release_s: Sequence[float],
    backward_end_s: float, early_kernel_s: Callable[[int], float], late_kernel_s: Callable[[int], float],
) -> tuple[float, float]:
    """:func:`pipeline_time` where a kernel starting before ``backward_end_s`` takes
    ``early_kernel_s(size)`` and a later one ``late_kernel_s(size)``; returns (finish time, seconds
    of kernel work inside ``[0, backward_end_s]``)."""
    d_end = k_end = h_end = busy = 0.0
    for size, d2h, h2d, release in zip(sizes, d2h_s, h2d_s, release_s):
        d_end = max(d_end, release) + d2h
        start = max(k_end, d_end)
        k_end = start + (early_kernel_s(size) if start < backward_end_s else late_kernel_s(size))
        busy += max(0.0, min(k_end, backward_end_s) - start)
        h_end = max(h_end, k_end) + h2d
    return h_end, busy


@dataclass(frozen=True, kw_only=True, slots=True)
class Node:
    """A node: hardware, every local rank's affinity mask, and the workload of each rank."""

    name: str
    hardware: Hardware
    masks: tuple[frozenset[int], ...]
    workload: Workload
    description: str = ""
    gpu_sockets: tuple[int, ...] = ()
    """The socket (NUMA node) of each rank's GPU, where a bound rank binds; () (default): GPU ``r``
    on socket ``r * sockets // ranks`` (an 8-GPU node: 0-3 on socket 0, 4-7 on socket 1)."""
    contention: Contention | None = None
    """Load episodes on this node (None: a quiet node; step 8 of the module doc)."""
    _classes: tuple[tuple[int, frozenset[int], int, int], ...] = field(default=(), repr=False, compare=False)
    _cache: dict[tuple[tuple[int, ...], int, tuple[int, ...], tuple[float, ...]], tuple[float, ...]] = field(
        default_factory=dict, repr=False, compare=False, hash=False
    )
    _bound: list[Node] = field(default_factory=list, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.masks:
            raise ValueError(f"Node {self.name!r}: expected at least one rank mask")
        valid = frozenset(range(self.hardware.logical_cpus))
        for r, mask in enumerate(self.masks):
            if not mask or not mask <= valid:
                raise ValueError(
                    f"Node {self.name!r}: rank {r} mask {sorted(mask)[:8]}...: expected a non-empty set of CPUs "
                    f"in 0..{len(valid) - 1}"
                )
        if self.contention is not None and len(self.contention.levels[0]) != self.hardware.sockets:
            raise ValueError(f"Node {self.name!r}: contention episodes give busy threads for "
                             f"{len(self.contention.levels[0])} sockets: expected {self.hardware.sockets}")
        # CPU classes: (socket, ranks whose masks hold the CPU) -> (cpus, physical cores, logical cpus)
        groups: dict[tuple[int, frozenset[int]], set[int]] = {}
        for cpu in sorted(frozenset().union(*self.masks)):
            owners = frozenset(r for r, m in enumerate(self.masks) if cpu in m)
            groups.setdefault((self.hardware.socket_of(cpu), owners), set()).add(cpu)
        classes = tuple(
            (sock, owners, len({self.hardware.core_of(c) for c in cpus}), len(cpus))
            for (sock, owners), cpus in sorted(groups.items(), key=lambda kv: (kv[0][0], sorted(kv[0][1])))
        )
        object.__setattr__(self, "_classes", classes)

    @property
    def ranks(self) -> int:
        return len(self.masks)

    def gpu_socket(self, r: int) -> int:
        """The socket of rank ``r``'s GPU (see :attr:`gpu_sockets`)."""
        return self.gpu_sockets[r] if self.gpu_sockets else r * self.hardware.sockets // self.ranks

    @property
    def spans_numa_nodes(self) -> bool:
        """Whether some rank's mask holds CPUs of more than one socket (where binding can matter)."""
        return any(len({self.hardware.socket_of(c) for c in m}) > 1 for m in self.masks)

    def bound(self) -> Node:
        """This node with every rank bound to its GPU's socket (step 7 of the module doc)."""
        if not self._bound:
            masks = tuple((m & self.hardware.socket_cpus(self.gpu_socket(r))) or m for r, m in enumerate(self.masks))
            self._bound.append(self if masks == self.masks else Node(
                name=f"{self.name}-bound", hardware=self.hardware, masks=masks, workload=self.workload,
                description=f"{self.description} (bound)", gpu_sockets=self.gpu_sockets,
                contention=self.contention))
        return self._bound[0]

    def _memory_split(self, r: int) -> dict[int, float]:
        """Where rank ``r``'s memory lives: its mask's sockets, in proportion to its CPUs there."""
        mask = self.masks[r]
        counts: dict[int, int] = {}
        for cpu in mask:
            s = self.hardware.socket_of(cpu)
            counts[s] = counts.get(s, 0) + 1
        return {s: c / len(mask) for s, c in counts.items()}

    def _load(self, load: Sequence[float]) -> tuple[float, ...]:
        """``load`` checked: busy threads per socket, () when there are none."""
        busy = tuple(float(x) for x in load)
        if busy and (len(busy) != self.hardware.sockets or any(not (math.isfinite(x) and x >= 0) for x in busy)):
            raise ValueError(f"Node {self.name!r}: load={list(load)!r}: expected {self.hardware.sockets} "
                             "numbers >= 0 (busy threads per socket)")
        return busy if any(busy) else ()

    def kernel_rates(self, threads: Sequence[int], load: Sequence[float] = ()) -> tuple[list[float], list[int]]:
        """Per rank: seconds per element of the CPU kernel, and the threads it runs with; ``load``:
        busy threads per socket of a load episode (step 8)."""
        hw = self.hardware
        n = self.ranks
        t = [int(x) for x in threads]
        if len(t) != n or any(x < 1 for x in t):
            raise ValueError(f"Node {self.name!r}: threads={list(threads)!r}: expected {n} ints >= 1")
        busy = self._load(load)
        # Threads of rank r in each class, in proportion to the class's share of r's mask.
        per_class: list[dict[int, float]] = []
        unit_per_thread: list[float] = []
        overload: list[float] = []
        for sock, owners, cores, logical in self._classes:
            share = {r: t[r] * logical / len(self.masks[r]) for r in owners}
            bg = sum(hw.background_threads * logical / len(self.masks[r]) for r in owners)
            total = sum(share.values())
            units = min(total, cores) + hw.smt_gain * min(max(total - cores, 0.0), logical - cores)
            per_class.append(share)
            unit_per_thread.append(units / total if total > 0 else 0.0)
            overload.append(max(0.0, (total + bg) / logical - 1.0))
        # Demand (core units) of each rank on each memory domain.
        demand: dict[tuple[int, int], tuple[float, float]] = {}
        units_of_rank = [0.0] * n
        for (sock, owners, _, _), share, upt in zip(self._classes, per_class, unit_per_thread):
            for r, x in share.items():
                units_of_rank[r] += x * upt
                for dom, frac in self._memory_split(r).items():
                    eff = 1.0 if dom == sock else hw.remote_efficiency
                    d, e = demand.get((r, dom), (0.0, 0.0))
                    demand[(r, dom)] = (d + x * upt * frac, e + x * upt * frac * eff)
        dom_total: dict[int, float] = {}
        for (r, dom), (d, _) in demand.items():
            dom_total[dom] = dom_total.get(dom, 0.0) + d
        bw = [0.0] * n
        for (r, dom), (d, useful) in demand.items():
            if dom_total[dom] > 0:
                # Every thread occupies the domain; a remote thread gets only part of its share through.
                bw[r] += hw.domain_bandwidth(dom_total[dom]) * useful / dom_total[dom]
        rates = []
        for r in range(n):
            mem_s = 0.0 if bw[r] <= 0 else self.workload.bytes_per_elem / (bw[r] * 1e9)
            cpu_s = 1.0 / (max(units_of_rank[r], 1e-9) * hw.core_rate_gelem * 1e9)
            slow = 1.0 + hw.oversub_penalty * max(
                (ov for (s, owners, _, _), ov in zip(self._classes, overload) if r in owners), default=0.0
            )
            if any(r in owners and len(owners) > 1 for _, owners, _, _ in self._classes):
                slow *= 1.0 + hw.shared_mask_penalty
            if busy:  # step 8: the worst class of the rank's mask
                slow *= max(team_slowdown(busy_core_ratio(sum(share.values()), cores,
                                                          busy[sock] * cores / hw.cores_per_socket),
                                          t[r], hw.oversub_penalty)
                            for (sock, owners, cores, _), share in zip(self._classes, per_class) if r in owners)
            rates.append(max(mem_s, cpu_s) * slow)
        return rates, t

    def rank_times(self, threads: Sequence[int], chunk_numel: int,
                   backward_threads: Sequence[int] | None = None, *, bind_numa: bool = False,
                   load: Sequence[float] = ()) -> tuple[float, ...]:
        """Noise-free objective of every rank (step time, or iteration time with overlap_backward);
        ``backward_threads``: each rank's threads for kernels started during backward (default:
        ``threads``; only with ``overlap_backward``); ``bind_numa``: every rank bound to its GPU's
        socket (step 7); ``load``: busy threads per socket of a load episode (step 8)."""
        if bind_numa:
            return self.bound().rank_times(threads, chunk_numel, backward_threads, load=load)
        backward = tuple(int(x) for x in (threads if backward_threads is None else backward_threads))
        busy = self._load(load)
        key = (tuple(int(x) for x in threads), int(chunk_numel), backward, busy)
        cache = self._cache
        if key in cache:
            return cache[key]
        if isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel < 1:
            raise ValueError(f"chunk_numel={chunk_numel!r}: expected an int >= 1")
        rates, t = self.kernel_rates(threads, busy)
        wl, hw = self.workload, self.hardware
        n_chunks = math.ceil(wl.params / chunk_numel)
        sizes = [chunk_numel] * (n_chunks - 1) + [wl.params - chunk_numel * (n_chunks - 1)]
        d2h = [s * wl.d2h_bytes_per_elem / (hw.pcie_gbs * 1e9) for s in sizes]
        h2d = [s * wl.h2d_bytes_per_elem / (hw.pcie_gbs * 1e9) for s in sizes]
        if wl.overlap_backward:
            result = self._iteration_times(rates, t, backward, sizes, d2h, h2d, busy)
        else:
            fixed = [wl.chunk_overhead_s + wl.chunk_overhead_per_thread_s * x for x in t]
            result = tuple(
                pipeline_time(n_chunks, sizes, d2h_s=d2h, h2d_s=h2d, release_s=[0.0] * n_chunks,
                              kernel_s=[s * rates[r] + fixed[r] for s in sizes])
                for r in range(self.ranks)
            )
        cache[key] = result
        return result

    def _iteration_times(self, rates: list[float], t: list[int], backward: tuple[int, ...], sizes: list[int],
                         d2h: list[float], h2d: list[float], busy: tuple[float, ...]) -> tuple[float, ...]:
        """Every rank's iteration with overlap_backward (see the module doc, step 5)."""
        wl, hw = self.workload, self.hardware
        if len(backward) != self.ranks or any(b < 1 for b in backward):
            raise ValueError(f"Node {self.name!r}: backward_threads={list(backward)!r}: expected {self.ranks} ints >= 1")
        early_rates, bt = self.kernel_rates(backward, busy) if backward != tuple(t) else (rates, t)
        n = len(sizes)

        def ranks_at(backward_s: float) -> list[tuple[float, float]]:
            # chunk i is ready when its last gradient is: evenly during backward, but the last
            # chunks' (``last_grads_share`` of the parameters) only at its end
            spread = 1.0 - wl.last_grads_share
            release = [backward_s * min(n, (i + 1) / spread) / n for i in range(n)]
            out = []
            for r in range(self.ranks):
                late_fixed = wl.chunk_overhead_s + wl.chunk_overhead_per_thread_s * t[r]
                early_fixed = wl.chunk_overhead_s + wl.chunk_overhead_per_thread_s * bt[r]
                out.append(overlap_pipeline(
                    sizes, d2h_s=d2h, h2d_s=h2d, release_s=release, backward_end_s=backward_s,
                    early_kernel_s=lambda s, r=r, f=early_fixed: s * early_rates[r] + f,
                    late_kernel_s=lambda s, r=r, f=late_fixed: s * rates[r] + f))
            return out

        backward_s = wl.backward_s
        runs = ranks_at(backward_s)
        if wl.backward_launch_share > 0:
            cores = hw.sockets * hw.cores_per_socket
            busy = sum(bt[r] * min(1.0, runs[r][1] / backward_s) for r in range(self.ranks)) / cores
            backward_s *= 1.0 + wl.backward_launch_share * hw.all_core_clock_drop * min(1.0, busy)
            runs = ranks_at(backward_s)
        return tuple(wl.forward_s + max(end, backward_s) for end, _ in runs)

    def node_time(self, threads: Sequence[int], chunk_numel: int,
                  backward_threads: Sequence[int] | None = None, *, bind_numa: bool = False,
                  load: Sequence[float] = ()) -> float:
        """Noise-free node objective: the slowest rank."""
        return max(self.rank_times(threads, chunk_numel, backward_threads, bind_numa=bind_numa, load=load))
