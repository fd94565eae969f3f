"""``bench.simulate``'s tuning sessions: the thread plans and search space of a simulated node, and
one session of its ranks' real tuners in lockstep threads (``InProcessAgreement`` for the
collective), priced by the step model with seeded noise and, on a contended node, the seed's load
episodes (:mod:`bench.simulate._contention`).

A session runs until the tuner locks in, or (``steps=``, the whole-run regret) a fixed number of
training steps: every step is observed, whatever the tuner's state, and whatever it applies after
lock-in (a watch that switches) is run and paid for, so nothing assumes the winner stays."""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from autotune import AutotuneConfig, OnlineTuner, StepSample
from autotune.testing import InProcessAgreement
from bench.simulate._contention import load_trace
from bench.simulate._stepmodel import Node, NoiseModel
from offload import OffloadSettings, ThreadPlan, plan_cpu_threads
from offload.testing import RankCpus
from offload.tuning._glue import masks_span_numa_nodes, offload_search_space

__all__ = ["ACTIVE_STATES", "BARRIER_TIMEOUT_S", "Caps", "DEFAULT_CHUNK_NUMEL", "capped", "plan_node", "rank_session",
           "result_row", "run_seed", "noise_table", "step_loads", "tuning_inputs"]

#: Seconds a simulated collective waits for the other simulated ranks before it fails.
BARRIER_TIMEOUT_S = 60.0
#: The chunk size ``CPUOffloadAdamW`` uses unless told otherwise (the static plan's chunk).
DEFAULT_CHUNK_NUMEL = OffloadSettings().chunk_numel
#: Tuner states before its first decision: a session that stops at lock-in stops when it leaves them.
ACTIVE_STATES = ("probing", "checking")


# --------------------------------------------------------------------------- thread plan and space


def plan_node(node: Node) -> list[ThreadPlan]:
    """Every local rank's real ``plan_cpu_threads`` on the node's topology, the masks handed in,
    each with the NUMA node its rank binds to under ``bind_numa`` (its GPU's socket)."""
    topology = node.hardware.topology()
    masks = [RankCpus(cpus=m, node=node.gpu_socket(r)) for r, m in enumerate(node.masks)]
    return [
        plan_cpu_threads(masks=masks, local_rank=r, topology=topology, cpu_count=node.hardware.logical_cpus)
        for r in range(node.ranks)
    ]


@dataclass(frozen=True, slots=True)
class Caps:
    """Each rank's thread cap, as ``OffloadTuning`` applies it: its own plan's threads, and once
    bound to its NUMA node the bound plan's (``ThreadPlan.bound_threads``)."""

    own: tuple[int, ...]
    bound: tuple[int, ...]

    def __iter__(self):  # the unbound caps, as the list this replaces
        return iter(self.own)

    def __len__(self) -> int:
        return len(self.own)


def tuning_inputs(node: Node, plans: Sequence[ThreadPlan]) -> tuple[Any, dict[str, int], Caps]:
    """(space, static plan, each rank's thread cap), as ``offload.tuning._glue.OffloadTuning`` builds them."""
    own = [p.planned_threads if p.planned_threads is not None else p.threads for p in plans]
    local = tuple(plans[0].local_threads) or tuple(own)
    top = max(local)
    baseline: dict[str, Any] = {"threads": top, "chunk_numel": DEFAULT_CHUNK_NUMEL}
    numa = masks_span_numa_nodes(plans[0])  # bind_numa=None (the default): tunable where masks span nodes
    space = offload_search_space(
        max_threads=top,
        baseline_threads=top,
        largest_slab=node.workload.params,
        baseline_chunk=DEFAULT_CHUNK_NUMEL,
        fixed_threads=False,
        bind_numa=numa,
    )
    if numa:
        baseline["bind_numa"] = False
    bound = tuple(p.bound_threads if p.bound_threads is not None else c for p, c in zip(plans, own))
    return space, baseline, Caps(own=tuple(own), bound=bound)


# --------------------------------------------------------------------------- one tuning session


def capped(setting: dict[str, Any], caps: Caps | Sequence[int]) -> list[int]:
    """Each rank's threads for a setting (OffloadTuning caps the knob at the rank's own plan, at
    its bound plan where the setting binds)."""
    if isinstance(caps, Caps) and setting.get("bind_numa"):
        return [min(int(setting["threads"]), c) for c in caps.bound]
    return [min(int(setting["threads"]), c) for c in caps]


def noise_table(node: Node, seed: int, steps: int, noise: NoiseModel) -> np.ndarray:
    """``[step, rank]`` noise factors of one run (the same whichever agreement carries the run), seeded
    by the run's seed and a CRC of the node's name: a sum of its letters gave the shared and the
    cyclic node (631 each) the same noise."""
    rng = np.random.default_rng([seed, zlib.crc32(node.name.encode())])
    return np.stack([noise.factors(rng, node.ranks) for _ in range(steps)])


def step_loads(node: Node, seed: int, steps: int) -> list[tuple[float, ...]]:
    """Busy threads per socket at each of ``steps`` steps of run ``seed`` (all ``()`` on a quiet node)."""
    if node.contention is None:
        return [()] * steps
    levels = node.contention.levels
    return [levels[k] for k in load_trace(node.contention, node.name, seed, steps)]


def rank_session(
    r: int,
    agreement: Any,
    node: Node,
    space: Any,
    baseline: dict[str, int],
    caps: Caps | Sequence[int],
    config: AutotuneConfig,
    table: np.ndarray,
    noise: NoiseModel,
    history: list[float] | None,
    trace: Any = None,
    *,
    loads: Sequence[tuple[float, ...]] | None = None,
    steps: int | None = None,
    record: dict[str, Any] | None = None,
    tuner_class: Callable[..., Any] = OnlineTuner,
) -> dict[str, Any]:
    """Simulated local rank ``r``: a real ``OnlineTuner`` fed model step times until it locks in, or
    for ``steps`` steps (at most ``len(table)``).

    ``agreement`` is what ``OnlineTuner(group=...)`` takes: an :class:`autotune.testing.InProcessAgreement`, or
    None inside a real gloo job (the tuner then builds its own ``GlooAgreement``). ``trace``: what
    ``OnlineTuner(trace=...)`` takes (the tuner writes it on rank 0 only). ``loads``: each step's
    busy threads per socket (:func:`step_loads`; None: quiet).
    Rank 0 appends the true node time of every step before the first lock-in to ``history`` and,
    with ``record``, fills it: ``costs`` (each step's true node time under its load, with the
    warm-up penalty of a step right after a switch: what the run paid), ``states`` (the tuner's
    state each step ran in), ``settings`` (the setting each step ran, described), ``measuring``
    (whether the tuner used the step's time: probing, a re-check or a watch round), ``lock_step``
    and ``lock_summary`` (the first lock-in),
    ``switches_after_lock`` and ``final`` (the setting in effect at the end).
    Returns the tuner's summary at its first lock-in (at the end if it never locked).
    ``tuner_class``: what builds the tuner, with ``OnlineTuner``'s arguments (tests pass a scripted one).
    """
    current: dict[str, Any] = {}
    switched = [False]
    applied = [0]

    def apply(setting: dict[str, Any]) -> None:
        current.clear()
        current.update(setting)
        switched[0] = True
        applied[0] += 1

    workload = {"params": node.workload.params, "node": node.name}
    tuner = tuner_class(space, baseline=baseline, apply=apply, config=config, workload=workload, group=agreement,
                        trace=trace)
    tuner.start()
    limit = len(table) if steps is None else min(steps, len(table))
    costs: list[float] = []
    states: list[str] = []
    settings: list[str] = []
    measuring: list[bool] = []
    lock_step: int | None = None
    lock_summary: dict[str, Any] | None = None
    lock_applied = 0
    if tuner.state not in ACTIVE_STATES:  # decided at start (one candidate)
        lock_step, lock_summary, lock_applied = 0, tuner.summary(), applied[0]
    step = 0
    while step < limit and (steps is not None or tuner.state in ACTIVE_STATES):
        threads = capped(current, caps)
        chunk = int(current.get("chunk_numel", node.workload.params))  # threads-only spaces: one chunk
        bind = bool(current.get("bind_numa", False))
        load = () if loads is None else loads[step]
        time_s = node.rank_times(threads, chunk, bind_numa=bind, load=load)[r] * float(table[step, r])
        warm = switched[0]
        if warm:
            time_s *= 1.0 + noise.warmup_penalty
        switched[0] = False
        if r == 0 and (history is not None or record is not None):
            true_s = node.node_time(threads, chunk, bind_numa=bind, load=load)
            if history is not None and lock_step is None:
                history.append(true_s)
            costs.append(true_s * (1.0 + noise.warmup_penalty if warm and step > 0 else 1.0))
            states.append(tuner.state)
            settings.append(space.describe(current) if current else "")
            measuring.append(bool(getattr(tuner, "measuring", False)))
        tuner.observe(StepSample(time_s=time_s, stages={"step_s": time_s}))
        step += 1
        if lock_step is None and tuner.state not in ACTIVE_STATES:
            lock_step, lock_summary, lock_applied = step, tuner.summary(), applied[0]
    summary = lock_summary if lock_summary is not None else tuner.summary()
    if record is not None:
        record.update(costs=costs, states=states, settings=settings, measuring=measuring,
                      lock_step=lock_step, lock_summary=lock_summary,
                      switches_after_lock=applied[0] - lock_applied if lock_step is not None else 0,
                      final=tuner.current)
    tuner.close()
    return summary


def result_row(node: Node, seed: int, summaries: Sequence[dict[str, Any] | None], history: list[float],
            collectives: int | None) -> dict[str, Any]:
    first = summaries[0]
    assert first is not None
    winners = [s["winner"] for s in summaries if s is not None]
    if any(w != first["winner"] for w in winners):
        raise RuntimeError(f"{node.name} seed {seed}: simulated ranks locked in different winners {winners}")
    if first["state"] in ACTIVE_STATES or first["winner"] is None:
        raise RuntimeError(f"{node.name} seed {seed}: tuner did not lock in within its budget ({first['state']})")
    return {
        "seed": seed,
        "winner": first["winner"],
        "kept_baseline": first["kept_baseline"],
        "probe_steps": first["probe_steps"],
        "sampler": first["sampler"],
        "reason": first["reason"],
        "measured": [
            {"candidate": m["candidate"], "median_s": m["median_s"], "n": m["n"]} for m in first["measurements"]
        ],
        "probe_true_s": sum(history),
        "collectives": collectives,
    }


def run_seed(
    node: Node,
    space: Any,
    baseline: dict[str, int],
    caps: Caps | Sequence[int],
    seed: int,
    *,
    config: AutotuneConfig | None = None,
    noise: NoiseModel | None = None,
    traces: Sequence[Any] | None = None,
    steps: int | None = None,
    tuner_class: Callable[..., Any] = OnlineTuner,
    loads: Sequence[tuple[float, ...]] | None = None,
) -> dict[str, Any]:
    """One tuning session of ``node.ranks`` real tuners in lockstep threads; returns rank 0's view.

    ``traces``: one ``OnlineTuner(trace=...)`` object per rank (``autotune.TraceWriter``, or any
    object with its ``add_step``/``add_spans``/``write_summary``), to see every measured step.
    ``steps``: run that many training steps instead of stopping at lock-in; the row then holds
    ``whole_run`` (rank 0's ``record`` of :func:`rank_session`). Up to the lock-in both are the
    same session: the noise and the load of a step do not depend on how many steps are drawn.
    ``loads``: each step's busy threads per socket instead of the node's own load episodes (a
    scripted load change, :func:`bench.simulate._main.follow_change`).
    """
    config = config or AutotuneConfig(use_cache=False)
    noise = noise or NoiseModel()
    n = node.ranks
    if traces is not None and len(traces) != n:
        raise ValueError(f"run_seed: {len(traces)} traces for {n} ranks: expected one per rank")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"run_seed: steps={steps!r}: expected an int >= 1 or None")
    # The tuner never exceeds its budget; one step more would show it if it did.
    length = config.probe_steps + 1 if steps is None else steps
    table = noise_table(node, seed, length, noise)
    if loads is None:
        loads = step_loads(node, seed, length)
    elif len(loads) < length:
        raise ValueError(f"run_seed: {len(loads)} steps of load for {length} steps: expected one per step")
    agreements = InProcessAgreement.group(n, timeout_s=BARRIER_TIMEOUT_S, owner="simulated node")
    summaries: list[dict[str, Any] | None] = [None] * n
    errors: list[BaseException] = []
    history: list[float] = []
    record: dict[str, Any] | None = {} if steps is not None else None

    def rank_main(r: int) -> None:
        agreement = agreements[r]
        try:
            summaries[r] = rank_session(r, agreement, node, space, baseline, caps, config, table, noise,
                                         history if r == 0 else None, None if traces is None else traces[r],
                                         loads=loads, steps=steps, record=record if r == 0 else None,
                                         tuner_class=tuner_class)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors.append(exc)
            agreement.abort()

    workers = [threading.Thread(target=rank_main, args=(r,), name=f"sim-rank-{r}") for r in range(n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise RuntimeError(f"simulation of {node.name} seed {seed} failed: {errors[0]}") from errors[0]
    row = result_row(node, seed, summaries, history, agreements[0].collectives)
    if record is not None:
        row["whole_run"] = record
    return row
