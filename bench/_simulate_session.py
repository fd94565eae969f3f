"""``bench.simulate``'s tuning sessions: the thread plans and search space of a simulated node, and
one session of its ranks' real tuners in lockstep threads (``InProcessAgreement`` for the
collective), priced by the step model with seeded noise."""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from autotune import AutotuneConfig, InProcessAgreement, OnlineTuner, StepSample
from bench._stepmodel import Node, NoiseModel
from offload import OffloadSettings, RankCpus, ThreadPlan, plan_cpu_threads
from offload.tuning._glue import masks_span_numa_nodes, offload_search_space

__all__ = ["BARRIER_TIMEOUT_S", "Caps", "DEFAULT_CHUNK_NUMEL", "capped", "plan_node", "rank_session", "result_row", "run_seed",
           "noise_table", "tuning_inputs"]

#: Seconds a simulated collective waits for the other simulated ranks before it fails.
BARRIER_TIMEOUT_S = 60.0
#: The chunk size ``CPUOffloadAdamW`` uses unless told otherwise (the static plan's chunk).
DEFAULT_CHUNK_NUMEL = OffloadSettings().chunk_numel


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
) -> dict[str, Any]:
    """Simulated local rank ``r``: a real ``OnlineTuner`` fed model step times until it locks in.

    ``agreement`` is what ``OnlineTuner(group=...)`` takes: an :class:`autotune.InProcessAgreement`, or
    None inside a real gloo job (the tuner then builds its own ``GlooAgreement``). ``trace``: what
    ``OnlineTuner(trace=...)`` takes (the tuner writes it on rank 0 only).
    Rank 0 appends the true node time of every probing step to ``history``.
    """
    current: dict[str, Any] = {}
    switched = [False]

    def apply(setting: dict[str, Any]) -> None:
        current.clear()
        current.update(setting)
        switched[0] = True

    workload = {"params": node.workload.params, "node": node.name}
    tuner = OnlineTuner(space, baseline=baseline, apply=apply, config=config, workload=workload, group=agreement,
                        trace=trace)
    tuner.start()
    step = 0
    while tuner.state in ("probing", "checking") and step < len(table):
        threads = capped(current, caps)
        chunk = int(current.get("chunk_numel", node.workload.params))  # threads-only spaces: one chunk
        bind = bool(current.get("bind_numa", False))
        time_s = node.rank_times(threads, chunk, bind_numa=bind)[r] * float(table[step, r])
        if switched[0]:
            time_s *= 1.0 + noise.warmup_penalty
        switched[0] = False
        if history is not None:
            history.append(node.node_time(threads, chunk, bind_numa=bind))
        tuner.observe(StepSample(time_s=time_s, stages={"step_s": time_s}))
        step += 1
    summary = tuner.summary()
    tuner.close()
    return summary


def result_row(node: Node, seed: int, summaries: Sequence[dict[str, Any] | None], history: list[float],
            collectives: int | None) -> dict[str, Any]:
    first = summaries[0]
    assert first is not None
    winners = [s["winner"] for s in summaries if s is not None]
    if any(w != first["winner"] for w in winners):
        raise RuntimeError(f"{node.name} seed {seed}: simulated ranks locked in different winners {winners}")
    if first["state"] != "locked":
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
) -> dict[str, Any]:
    """One tuning session of ``node.ranks`` real tuners in lockstep threads; returns rank 0's view.

    ``traces``: one ``OnlineTuner(trace=...)`` object per rank (``autotune.TraceWriter``, or any
    object with its ``add_step``/``add_spans``/``write_summary``), to see every measured step.
    """
    config = config or AutotuneConfig(use_cache=False)
    noise = noise or NoiseModel()
    n = node.ranks
    if traces is not None and len(traces) != n:
        raise ValueError(f"run_seed: {len(traces)} traces for {n} ranks: expected one per rank")
    # The tuner never exceeds its budget; one step more would show it if it did.
    table = noise_table(node, seed, config.probe_steps + 1, noise)
    agreements = InProcessAgreement.group(n, timeout_s=BARRIER_TIMEOUT_S, owner="simulated node")
    summaries: list[dict[str, Any] | None] = [None] * n
    errors: list[BaseException] = []
    history: list[float] = []

    def rank_main(r: int) -> None:
        agreement = agreements[r]
        try:
            summaries[r] = rank_session(r, agreement, node, space, baseline, caps, config, table, noise,
                                         history if r == 0 else None, None if traces is None else traces[r])
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
    return result_row(node, seed, summaries, history, agreements[0].collectives)
