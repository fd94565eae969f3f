"""Glue between ``CPUOffloadAdamW`` and the generic ``autotune.OnlineTuner``.

This module is the only place that knows both sides: it builds the offload search space (threads
x chunk size, x kernel on bf16/fp16 models) from the thread plan and the slab sizes, and the
workload the cache key names (:func:`offload_workload`), turns each step's ``StepStats`` into the
tuner's ``StepSample`` and turns the tuner's settings back into ``OffloadSettings``. It sees the
optimizer only through :class:`Tunable` (settings, ``apply_settings``, ``last_stats``) and never
imports it.

Kernel knob ("torch", "fused-mp"): only when the model has bf16/fp16 parameters, the fused-mp
kernel is available on *every* local rank and :func:`offload.kernels._fused_mp.bitwise_matches_torch` is
true (so switching kernels never changes the math). The first two and the last are the same on
every local rank by construction (one model, one torch build, one CPU model per node); build
availability could differ in theory (a build that fails on one rank only), so the local ranks
AND their answers with an all-gather on the node's agreement (:func:`agreed_kernels`, the same
agreement as the thread plan and the tuner, ``offload.tuning._node_agreement``) before anyone builds the space. The baseline keeps the kernel in force (the default "auto" resolved). With the
kernel knob the chunk ladder is shortened (:data:`MAX_CHUNK_CANDIDATES_WITH_KERNEL`) so the
space stays near the default 40-step probe budget; beyond it the tuner samples with TPE.
An fp32 model gets no kernel knob: there both kernels move the same 28 bytes per parameter in
place and are bitwise equal, so the default "auto" (the native kernel where verified and built)
is used without spending probe steps on a choice worth little.

Objective: without ``overlap_backward`` the settings change nothing but ``step()`` itself (the
worker thread sets its own intra-op thread count), so the tuner minimises the wall time of
``step()``; that keeps the noise of forward and backward out of the comparison. With
``overlap_backward`` part of the step runs during backward and competes with it for the CPU, so
the tuner minimises the wall time of the whole iteration instead, from the return of the previous
``step()`` to the return of this one. The first step after a switch is discarded by the tuner's
warm-up rule.

Speculate knob (off, on): only with ``overlap_backward``. Work started during backward is
validated before it commits, so switching it never changes the math; whether it pays depends on
the machine (free cores during backward: a GPU node) and the loop (clipping every step redoes
every early chunk). The baseline is on, as asked; the lock-in rule keeps it unless off is
clearly faster, as it is where backward runs on the same cores (a CPU-only box).

Backward-threads knob: only with the speculate knob and more than one thread. Its values are
thread counts from 1 to the top of the thread ladder (:func:`backward_ladder`, at most
:data:`MAX_BACKWARD_CANDIDATES`; the top, the same as ``threads``, is the baseline), each rank
using ``min(value, its threads)`` (:func:`backward_thread_count`). Absolute counts, not shares of
``threads``: what slows backward is how many cores are busy beside it, what the drain needs is
its own count, so the two knobs act apart and the coordinate sweep can walk each on its own (a
share moved the count during backward with every rung of the thread ladder, and the sweep
stopped at a lower ``threads`` with share 1, 1.3 % slower than the best on the step model). The
knob comes first in the space, so the sweep walks it at the top thread count, where every value
is a distinct setting (above ``threads`` a value repeats the drain's count). Busy cores during
backward slow the trainer's launch-bound backward; few threads there leave a longer backlog for
``step()``: which wins is the machine's.

Ring-slots knob (:data:`RING_LADDER`, the CUDA staging ring's depth, ``OffloadSettings.ring_slots``):
only where the step runs the CUDA transport, which is where a ring exists: parameters on a CUDA
device, or device operations handed in (``CPUOffloadAdamW(device_ops=)``, the fake-CUDA tests);
never on the host transport, and not where the user set ``ring_slots``. The baseline is today's
depth (2, double buffering); deeper rings let gradient copies run further ahead of a kernel
whose time varies, at one more pinned chunk-sized block per direction per slot, so a tie keeps
the shallower ring. Last in the space: the sweep walks it at the best threads and chunk size.
Exact whatever the depth (the same bytes reach the kernel).

NUMA-binding knob (off, on: ``OffloadSettings.bind_numa``): only where the local ranks' affinity
masks span several NUMA nodes (:func:`masks_span_numa_nodes` of the thread plan's
``local_masks_per_numa_node``, the same on every local rank), and not where the user chose
``bind_numa`` (True or False; the default None means "off, tunable"). Inside one node there is
nothing to bind to. Across nodes an unbound rank's threads read part of its state from the other
node's memory, through the socket link; bound, it reads it locally but computes on one node's
cores of its mask: which wins is the machine's (the step model finds binding pays where the node's
memory saturates with the cores left, ``bench.simulate._stepmodel``). On, applied between steps, it binds
the process to its GPU's node and moves the host state's pages there in place; off restores the
affinity and leaves the pages where they are, so an "off" measured after an "on" reads the state
from one node (``offload.state._placement``). The baseline is off (the default's behaviour) and a
tie keeps it. Bound, a rank's threads are capped at ``ThreadPlan.bound_threads``: the rule
rerun on every local rank's mask narrowed to its node (each rank's node travels with its mask in
the plan's one exchange), so the ranks bound to one node never oversubscribe it (the cyclic masks
of ``bench.simulate``: 15 threads unbound, 7-8 bound, where keeping 15 made "on" look 10 % worse
than it is). Right after ``threads`` in the space: the sweep walks the thread count first, then
decides the binding at it, then the chunk size (p95 regret on ``bench.simulate``'s three nodes
with the knob: 1.45 / 4.17 / 2.42 %; first: 2.64 / 2.63 / 2.42 %; last: 14.9 / 4.17 / 2.42 %,
where one unlucky pair of samples keeps a 20-25 % slower "off"). Exact either way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from collections.abc import Sequence
from typing import Any, Callable, Literal, Protocol

import torch

from autotune import (
    AutotuneConfig,
    Knob,
    OnlineTuner,
    SearchSpace,
    StepSample,
    cache_for,
    geometric_ladder,
    powers_of_two,
    trace_for,
)
from offload.tuning._node_agreement import NodeAgreement, node_agreement
from offload.state._items import LOWP_DTYPES
from offload.state._params import ParamRecord
from offload._settings import KERNELS, OffloadSettings
from offload._stats import StepStats
from offload.state._slabs import ParamSlot
from offload.threads._plan import ThreadPlan

logger = logging.getLogger(__name__)

__all__ = ["RING_LADDER", "OffloadTuning", "Tunable", "agreed_kernels", "backward_ladder", "backward_thread_count",
           "cache_facts", "masks_span_numa_nodes", "offload_search_space", "offload_workload",
           "step_threads_space"]

#: Smallest chunk the tuner probes: below ~1M elements per call the fixed per-chunk cost shows.
MIN_TUNED_CHUNK = 1 << 20
#: Most chunk sizes probed; with the thread ladder this keeps the grid inside the probe budget
#: on typical machines (the tuner switches to TPE when it does not fit).
MAX_CHUNK_CANDIDATES = 4
#: Most thread counts probed.
MAX_THREAD_CANDIDATES = 5
#: Most chunk sizes probed (besides the configured one) when the kernel knob doubles the space.
MAX_CHUNK_CANDIDATES_WITH_KERNEL = 2
#: Most values of the backward-threads knob (the top thread count included).
MAX_BACKWARD_CANDIDATES = 3
#: The ring-slots knob's values (CUDA only): double buffering (today's depth, the baseline) up to
#: the reference system's 4 slots.
RING_LADDER = (2, 3, 4)


def backward_ladder(top_threads: int) -> tuple[int, ...]:
    """The backward-threads knob's values for a thread ladder topped at ``top_threads``: a
    geometric ladder from 1 to it, thinned to :data:`MAX_BACKWARD_CANDIDATES`.

    >>> backward_ladder(1), backward_ladder(2), backward_ladder(15), backward_ladder(64)
    ((1,), (1, 2), (1, 4, 15), (1, 8, 64))
    """
    return geometric_ladder(1, top_threads, max_count=MAX_BACKWARD_CANDIDATES)


def backward_thread_count(value: int, threads: int) -> int | None:
    """``OffloadSettings.backward_threads`` for the knob's ``value`` on a rank running ``threads``:
    None (the same as ``threads``) where ``value`` is not below it."""
    return None if value >= threads else value


def masks_span_numa_nodes(plan: ThreadPlan) -> bool:
    """Whether some local rank's affinity mask holds CPUs of more than one NUMA node (the
    ``bind_numa`` knob's condition; from ``plan.local_masks_per_numa_node``, empty on one node)."""
    return any(sum(1 for n in counts if n) > 1 for counts in plan.local_masks_per_numa_node)


def step_threads_space(*, max_threads: int, baseline_threads: int, fixed_threads: bool) -> SearchSpace:
    """One knob, ``threads``: a geometric ladder from 1 to ``max_threads`` holding the static plan
    (at most :data:`MAX_THREAD_CANDIDATES` values), or the fixed count alone.
    Arguments must be the same on every local rank. ``tune_step_threads`` and ``tune_deepspeed``
    tune this space."""
    if fixed_threads:
        threads: tuple[int, ...] = (baseline_threads,)
    else:
        threads = geometric_ladder(1, max_threads, include=(baseline_threads,), max_count=MAX_THREAD_CANDIDATES)
    return SearchSpace((Knob("threads", threads, prefer="low"),))


def offload_search_space(
    *,
    max_threads: int,
    baseline_threads: int,
    largest_slab: int,
    baseline_chunk: int,
    fixed_threads: bool,
    kernels: tuple[str, ...] = (),
    speculate: bool = False,
    backward_threads: bool = False,
    ring_slots: bool = False,
    bind_numa: bool = False,
) -> SearchSpace:
    """Threads (a geometric ladder from 1 to ``max_threads`` that holds the static plan's value)
    x chunk size (powers of two from 1 Mi elements to the largest slab, plus the configured one)
    x kernel when ``kernels`` holds more than one (see the module doc; fewer chunk sizes then)
    x ``speculate`` (off, on) with ``speculate`` (an optimizer with ``overlap_backward``: the
    overlap is exact, so whether it pays is a measurement like the others; fewer chunk sizes then)
    x ``backward_threads`` (:func:`backward_ladder` of the top thread count; the first knob, see
    the module doc) with ``backward_threads`` and ``speculate`` where that top is above one thread
    x ``ring_slots`` (:data:`RING_LADDER`, last) with ``ring_slots`` (the CUDA transport runs)
    x ``bind_numa`` (off, on; right after ``threads``) with ``bind_numa`` (the masks span
    several NUMA nodes).

    Every argument must be the same on every local rank (derive them from agreed values).
    """
    for k in kernels:
        if k not in KERNELS:
            raise ValueError(f"offload_search_space: kernel {k!r}: expected one of {KERNELS}")
    if backward_threads and not speculate:
        raise ValueError("offload_search_space: backward_threads=True needs speculate=True (no early chunk runs "
                         "without it)")
    with_kernel = len(set(kernels)) > 1
    max_chunks = MAX_CHUNK_CANDIDATES_WITH_KERNEL if with_kernel or speculate else MAX_CHUNK_CANDIDATES
    if fixed_threads:
        threads: tuple[int, ...] = (baseline_threads,)
    else:
        threads = geometric_ladder(1, max_threads, include=(baseline_threads,), max_count=MAX_THREAD_CANDIDATES)
    hi = max(largest_slab, MIN_TUNED_CHUNK)
    chunks = set(powers_of_two(MIN_TUNED_CHUNK, hi, max_count=max_chunks)) if largest_slab > MIN_TUNED_CHUNK else set()
    # A chunk at least as large as the largest slab is the same schedule whatever its size: keep one.
    chunks = {c for c in chunks if c < largest_slab}
    chunks.add(baseline_chunk)
    knob_list = [
        Knob("threads", threads, prefer="low"),
        Knob("chunk_numel", tuple(sorted(chunks)), prefer="high"),
    ]
    if with_kernel:
        # Listed torch first and prefer="low": on a tie the torch path stays.
        ordered = tuple(k for k in KERNELS if k in kernels)
        knob_list.append(Knob("kernel", ordered, prefer="low"))
    if speculate:
        # Off first and prefer="low": where on and off tie, nothing runs during backward.
        knob_list.append(Knob("speculate", (False, True), prefer="low"))
    backward = backward_ladder(max(threads)) if backward_threads else (1,)
    if len(backward) > 1:
        # First (walked at the top thread count) and prefer="low": of two tied counts, the one
        # that leaves backward more cores.
        knob_list.insert(0, Knob("backward_threads", backward, prefer="low"))
    if ring_slots:
        # Last (walked at the best threads and chunk) and prefer="low": of two tied depths, the
        # one that pins less memory.
        knob_list.append(Knob("ring_slots", RING_LADDER, prefer="low"))
    if bind_numa:
        # Right after threads (see the module doc) and prefer="low": a tie stays unbound, the
        # default's behaviour.
        at = next(i for i, k in enumerate(knob_list) if k.name == "threads") + 1
        knob_list.insert(at, Knob("bind_numa", (False, True), prefer="low"))
    return SearchSpace(tuple(knob_list))


def agreed_kernels(
    *, has_lowp: bool, timeout_s: float, available: Callable[[], tuple[bool, str]] | None = None,
    bitwise: Callable[[], bool] | None = None, agreement: Any = None,
) -> tuple[str, ...]:
    """The kernel knob's values, identical on every local rank: ``("torch", "fused-mp")`` when the
    model has bf16/fp16 parameters, the kernel is bitwise equal to the torch path on this build,
    and it is available on every local rank (an all-gather ANDs the ranks' answers); else ``()``.

    ``has_lowp`` and ``bitwise()`` are the same on every rank of a node (one model, one torch
    build, one CPU), so every rank takes the same branch and joins the all-gather, or none does.
    ``agreement``: an ``autotune`` agreement to use (tests); default: one over this node's ranks.
    """
    from offload.kernels import _fused_mp

    bitwise = bitwise or _fused_mp.bitwise_matches_torch
    if not has_lowp or not bitwise():
        return ()
    ok, reason = (available or _fused_mp.fused_mp_available)()
    from autotune import make_agreement

    agree = agreement if agreement is not None else make_agreement(
        None, timeout_s=timeout_s, owner="offload kernel knob"
    )
    try:
        answers = agree.all_gather(bool(ok), step=None, what="exchange of fused-mp availability")
    finally:
        if agreement is None:
            agree.close()
    if not all(answers):
        missing = [r for r, a in enumerate(answers) if not a]
        logger.info(
            "autotune: no kernel knob: fused-mp unavailable on local rank(s) %s%s",
            missing, f" (here: {reason})" if not ok else "",
        )
        return ()
    return KERNELS


def offload_workload(records: Sequence[ParamRecord], slots: Sequence[ParamSlot], *, groups: int,
                     device_type: str, overlap_backward: bool,
                     state_dtype: torch.dtype = torch.float32) -> tuple[dict[str, Any], int]:
    """The tuner's workload of an optimizer (this rank's shard: its element count), and the
    largest slab of any local rank (the search space must be the same on every local rank: it is
    sized by the largest shard any rank holds; uneven shards differ by rank)."""
    group_numel = [0] * groups
    group_max = [0] * groups
    for slot in slots:
        group_numel[slot.group] += slot.numel
        layout = records[slot.index].layout
        group_max[slot.group] += slot.numel if layout is None else layout.max_local_numel
    sharded = [r.layout for r in records if r.layout is not None]
    objective = "iteration" if overlap_backward else "step"
    workload = {
        "params": sum(group_numel),
        "groups": groups,
        "dtypes": sorted({str(r.param.dtype) for r in records}),
        "device": device_type,
        "overlap_backward": bool(overlap_backward),
        "objective": objective,
        # bf16 moments move fewer bytes (another optimum); fp32 adds nothing: older keys still match
        **({"state_dtype": str(state_dtype)} if state_dtype != torch.float32 else {}),
        **({"sharded_params": len(sharded), "shard_ranks": sharded[0].mesh.size(),
            "global_params": sum(r.param.numel() for r in records)} if sharded else {}),
    }
    return workload, max(group_max, default=0)


def cache_facts(plan: ThreadPlan, *, native: bool) -> dict[str, Any]:
    """What else can move the optimum and goes into the cache key: the layout of the local ranks'
    affinity masks (shared or disjoint, their sizes: not only this rank's size, which the
    hardware facts hold, and on a machine of several NUMA nodes each mask's CPUs per node), and,
    where the native kernel may run, its source's hash."""
    masks = plan.local_masks or (plan.cpus,)
    seen: set[int] = set()
    shared = False
    for m in masks:
        shared = shared or bool(seen & m)
        seen |= m
    facts: dict[str, Any] = {"masks": {"shared": shared, "sizes": [len(m) for m in masks]}}
    if plan.local_masks_per_numa_node:  # several NUMA nodes: how each mask spreads over them
        facts["masks"]["per_numa_node"] = [list(c) for c in plan.local_masks_per_numa_node]
    if native:
        from offload.kernels._build import source_digest

        facts["kernel_source"] = source_digest()
    return facts


class Tunable(Protocol):
    """What the glue needs of the optimizer it tunes."""

    @property
    def settings(self) -> OffloadSettings: ...

    @property
    def last_stats(self) -> StepStats | None: ...

    def apply_settings(self, settings: OffloadSettings) -> None: ...


class OffloadTuning:
    """Owns the ``OnlineTuner`` of one ``CPUOffloadAdamW`` and feeds it every step."""

    def __init__(
        self,
        optimizer: Tunable,
        config: AutotuneConfig,
        *,
        plan: ThreadPlan,
        fixed_threads: bool,
        objective: Literal["step", "iteration"],
        workload: dict[str, Any],
        largest_slab: int,
        has_lowp: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        agreement: NodeAgreement | None = None,
        kernels_available: Callable[[], tuple[bool, str]] | None = None,
        cuda_transport: bool = False,
    ) -> None:
        """``agreement``: the node's agreement (``offload.tuning._node_agreement``) for the kernel vote and the
        tuner; closed by :meth:`close`. Default: one made here. ``kernels_available``: whether the
        native kernel can run on this rank (the optimizer's ``KernelSet.available``).
        ``cuda_transport``: the step runs the CUDA transport (the ring-slots knob's condition)."""
        self._optimizer = optimizer
        self._clock = clock
        if objective not in ("step", "iteration"):
            raise ValueError(f"objective={objective!r}: expected 'step' or 'iteration'")
        self.objective = objective
        self._own_threads = plan.threads
        # Once bound to its NUMA node a rank computes on that node's part of its mask only.
        self._bound_threads = plan.threads if getattr(plan, "bound_threads", None) is None else plan.bound_threads
        self._starved = plan.starved  # said in the trace's summary too
        # Every local rank must build the same space: the ladder tops at the largest budget of any
        # local rank and each rank caps the knob at its own plan (see _apply), so the static plan
        # ("as many threads as my plan allows") is the same setting on every rank.
        local = tuple(plan.local_threads) if getattr(plan, "local_threads", None) else (plan.threads,)
        top = plan.threads if fixed_threads else max(local)
        baseline: dict[str, Any] = {"threads": top, "chunk_numel": optimizer.settings.chunk_numel}
        if agreement is None:
            agreement = node_agreement(timeout_s=config.timeout_s, owner="OnlineTuner")
        self._agreement = agreement
        kernels = agreed_kernels(has_lowp=has_lowp, timeout_s=config.timeout_s, agreement=agreement,
                                 available=kernels_available)
        if kernels:
            # The kernel the user set (resolved: "torch" where fused-mp cannot run here).
            baseline["kernel"] = optimizer.settings.kernel
        speculate = objective == "iteration"  # overlap_backward: on (the user's ask) vs off
        if speculate:
            baseline["speculate"] = optimizer.settings.speculate
        # A count the user set stays; else the drain's count (share 1.0) is the baseline.
        backward = speculate and optimizer.settings.backward_threads is None
        # A depth the user set stays; the host transport has no ring.
        ring = cuda_transport and optimizer.settings.ring_slots is None
        # A binding the user chose stays; inside one NUMA node there is nothing to bind to.
        numa = optimizer.settings.bind_numa is None and masks_span_numa_nodes(plan)
        space = offload_search_space(
            max_threads=top,
            baseline_threads=top,
            largest_slab=largest_slab,
            baseline_chunk=baseline["chunk_numel"],
            fixed_threads=fixed_threads,
            kernels=kernels,
            speculate=speculate,
            backward_threads=backward,
            ring_slots=ring,
            bind_numa=numa,
        )
        if "backward_threads" in space.names:
            baseline["backward_threads"] = top  # the same as threads
        if ring:
            baseline["ring_slots"] = RING_LADDER[0]  # today's depth (ring_slots=None)
        if numa:
            baseline["bind_numa"] = False  # the default's behaviour (bind_numa=None: off)
        cache = cache_for(config)
        # The tuner writes its cache and trace on local rank 0 only.
        self._trace = trace_for(config)
        workload = {**workload, **cache_facts(plan, native=bool(kernels) or optimizer.settings.kernel == "fused-mp")}
        self.tuner = OnlineTuner(
            space,
            baseline=baseline,
            apply=self._apply,
            config=config,
            workload=workload,
            cache=cache,
            trace=self._trace,
            group=agreement,
        )
        self._last_return: float | None = None
        self.tuner.start()
        self._last_return = self._clock()

    @classmethod
    def for_optimizer(cls, optimizer: Tunable, config: AutotuneConfig, *, plan: ThreadPlan,
                      records: Sequence[ParamRecord], slots: Sequence[ParamSlot], groups: int,
                      device_type: str, overlap_backward: bool, state_dtype: torch.dtype = torch.float32,
                      agreement: NodeAgreement | None = None,
                      kernels_available: Callable[[], tuple[bool, str]] | None = None,
                      cuda_transport: bool = False) -> OffloadTuning:
        """The tuning of an optimizer of ``records`` laid out in ``slots`` (the workload and the
        search space derived here); ``cuda_transport``: its step runs the CUDA transport."""
        workload, largest = offload_workload(records, slots, groups=groups, device_type=device_type,
                                             overlap_backward=overlap_backward, state_dtype=state_dtype)
        return cls(optimizer, config, plan=plan, fixed_threads=plan.source != "plan",
                   objective=workload["objective"], workload=workload, largest_slab=largest,
                   has_lowp=any(r.param.dtype in LOWP_DTYPES for r in records), agreement=agreement,
                   kernels_available=kernels_available, cuda_transport=cuda_transport)

    def _apply(self, setting: dict[str, Any]) -> None:
        current = self._optimizer.settings
        numa = setting.get("bind_numa")
        bound = current.bind_numa if numa is None else bool(numa)
        threads = min(int(setting["threads"]), self._bound_threads if bound else self._own_threads)
        kernel = str(setting.get("kernel", current.kernel))
        speculate = bool(setting.get("speculate", current.speculate))
        value = setting.get("backward_threads")
        backward = current.backward_threads if value is None else backward_thread_count(int(value), threads)
        ring = setting.get("ring_slots")
        self._optimizer.apply_settings(
            replace(current, threads=threads, chunk_numel=int(setting["chunk_numel"]), kernel=kernel,  # type: ignore[arg-type]
                    speculate=speculate, backward_threads=backward,
                    ring_slots=current.ring_slots if ring is None else int(ring),
                    bind_numa=current.bind_numa if numa is None else bool(numa))
        )

    def after_step(self) -> None:
        """Called at the end of every ``step()``; reads the step's stats only while the tuner
        measures (probing, a re-check, a watch round; on CUDA, reading them waits for the step's
        copies). A locked step between watch rounds is only counted."""
        now = self._clock()
        previous, self._last_return = self._last_return, now
        if not self.tuner.measuring:
            self.tuner.observe(None)  # locked: counted, nothing read
            return
        stats = self._optimizer.last_stats
        if stats is None:
            return
        iteration_s = now - previous if previous is not None else stats.step_s
        stages = {
            "iteration_s": iteration_s,
            "step_s": stats.step_s,
            "d2h_s": stats.d2h_s,
            "adam_kernel_s": stats.adam_kernel_s,
            "materialize_s": stats.materialize_s,
            "drain_s": stats.drain_s,
        }
        spans = tuple((s.stage, s.chunk, s.start_s, s.end_s) for s in stats.spans)
        time_s = iteration_s if self.objective == "iteration" else stats.step_s
        self.tuner.observe(StepSample(time_s=time_s, stages=stages, spans=spans))  # writes the summary at lock-in

    def flush(self) -> None:
        """Write the trace summary (idempotent); called by ``close``."""
        if self._trace is not None:
            summary = self.tuner.summary()
            if self._starved is not None:
                summary = {**summary, "warnings": [self._starved]}
            self._trace.write_summary(summary)

    def close(self) -> None:
        self.flush()
        if self._trace is not None:
            self._trace.close()
        self.tuner.close()
        self._agreement.close()

