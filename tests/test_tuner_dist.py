"""The tuner across real processes: two ranks joined by gloo, fake step times, no big tensors."""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from _dist_util import run_workers

pytestmark = pytest.mark.slow

THREADS = (1, 2, 4, 8)
CHUNKS = (1 << 20, 1 << 22)
BASELINE = {"threads": 8, "chunk_numel": 1 << 20}


def _space(chunks: tuple[int, ...] = CHUNKS) -> Any:
    from autotune import Knob, SearchSpace

    return SearchSpace((Knob("threads", THREADS), Knob("chunk_numel", chunks, prefer="high")))


def _cost(rank: int, setting: dict[str, Any]) -> float:
    """Rank 0 alone would pick 8 threads, rank 1 alone 1 thread; the node (max) optimum is 4 threads."""
    threads, chunk = setting["threads"], setting["chunk_numel"]
    base = 1.0 / threads + 0.1 if rank == 0 else 0.3 + 0.05 * threads
    return base * (0.95 if chunk == 1 << 22 else 1.0)


def _slowdown(setting: dict[str, Any]) -> float:
    """What a load that starts mid-run does to rank 1: large chunks become 3x slower."""
    return 3.0 if setting["chunk_numel"] == 1 << 22 else 1.0


def _node_optimum() -> dict[str, Any]:
    candidates = _space().candidates()
    return min(candidates, key=lambda s: max(_cost(0, s), _cost(1, s)))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _tune(rank: int, *, space: Any, config: Any, steps: int, cache: Any = None, stop_at: int | None = None,
          stop: str = "", slow_from: int | None = None, stop_file: str = "") -> dict[str, Any]:
    import torch.distributed

    from autotune import OnlineTuner, StepSample

    applied: list[tuple[int, dict[str, Any]]] = []
    tuner: Any = None

    def apply(setting: dict[str, Any]) -> None:
        applied.append((tuner.summary()["steps"] if tuner is not None and tuner.state != "new" else 0, setting))

    tuner = OnlineTuner(space, baseline=BASELINE, apply=apply, config=config, workload={"params": 1000},
                        cache=cache)
    # The tuner's timeout (5 s in some tests) also bounds setting up its group: without the barrier
    # a rank whose imports ran that much later under load would fail the others at "start".
    torch.distributed.barrier()
    tuner.start()
    states = []
    for step in range(steps):
        if step == stop_at:
            if stop == "exit":
                os._exit(3)
            if stop == "hang":
                time.sleep(120)
            if stop in ("sigstop", "sigkill"):
                if stop_file:
                    Path(stop_file).write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP if stop == "sigstop" else signal.SIGKILL)
        t = _cost(rank, tuner.current) * (_slowdown(tuner.current) if slow_from is not None and step >= slow_from else 1.0)
        tuner.observe(StepSample(time_s=t, stages={"step_s": t}))
        states.append(tuner.state)
    summary = tuner.summary()
    tuner.close()
    return {"applied": applied, "states": states, "summary": summary}


def _worker_agree(rank: int, world_size: int, *, cache_path: str) -> dict[str, Any]:
    from autotune import AutotuneConfig, TuningCache

    records = _Records()
    logging.getLogger("autotune").addHandler(records)
    logging.getLogger("autotune").setLevel(logging.DEBUG)
    config = AutotuneConfig(probe_steps=60, timeout_s=30.0, watch_cost=0.05)
    cache = TuningCache(cache_path) if rank == 0 else None
    # Probing ends after 47 steps; from step 100 on rank 1 alone runs large chunks 3x slower: the
    # node's optimum moves to the runner-up (small chunks), and the watch follows it.
    first = _tune(rank, space=_space(), config=config, steps=400, cache=cache, slow_from=100 if rank == 1 else None)
    second = _tune(rank, space=_space(), config=config, steps=20, cache=cache)
    return {"first": first, "second": second, "log": records.messages}


def _comparable(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in ("rank", "overhead_s")}


def test_ranks_apply_the_same_candidates_and_agree_on_the_node_optimum(tmp_path):
    results = run_workers(_worker_agree, 2, kwargs={"cache_path": str(tmp_path / "cache.json")}, timeout_s=90)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)
    r0, r1 = (r.value for r in results)
    first0, first1 = r0["first"], r1["first"]
    # Same settings applied at the same steps, same states, same decision on both ranks.
    assert first0["applied"] == first1["applied"]
    assert len(first0["applied"]) > 4
    assert first0["states"] == first1["states"]
    assert _comparable(first0["summary"]) == _comparable(first1["summary"])
    summary = first0["summary"]
    assert summary["state"] == "locked"
    assert summary["local_world_size"] == 2
    assert summary["probe_steps"] == 8 * 4 + 11 + 4  # exploring (round 0), two final rounds, one duel round
    # The slow rank sets the pace: the node time is the max over ranks, so neither rank's own
    # optimum (8 threads for rank 0, 1 thread for rank 1) won the lock-in, but the node's. After
    # rank 1 slowed down (rank 0 learns of it only through the gathered node times) the watch
    # switched both ranks, at the same step (the applied lists above are equal), to the faster
    # runner-up.
    locked = summary["measurements"]
    for m in locked:
        expected = max(_cost(0, m["candidate"]), _cost(1, m["candidate"]))
        assert m["samples"] == pytest.approx([expected] * m["n"])
    assert _node_optimum() == {"threads": 4, "chunk_numel": 1 << 22}
    assert summary["switches"] >= 1 and summary["sampler"] == "watch" and summary["watch_steps"] > 0
    assert summary["winner"] == {"threads": 4, "chunk_numel": 1 << 20}  # the runner-up
    switched = [s for s, setting in first0["applied"] if setting == summary["winner"] and s > 100]
    assert switched, first0["applied"]
    # Every rank logs the decision; rank 0 alone logs the per-candidate lines and the table.
    assert any("locked" in line for line in r0["log"]) and any("locked" in line for line in r1["log"])
    per_candidate = re.compile(r"OnlineTuner: candidate \d+ of 8: ")
    assert sum(bool(per_candidate.match(line)) for line in r0["log"]) == len(_space())
    assert not any(per_candidate.match(line) for line in r1["log"])
    # Second tuner: rank 0's cache hit is shared, nobody probes, both lock the cached winner (the
    # lock-in's: a watch switch follows today's load and is not written to the cache).
    second0, second1 = r0["second"]["summary"], r1["second"]["summary"]
    assert _comparable(second0) == _comparable(second1)
    assert second0["cache_hit"] is True and second0["cache_status"] == "hit"
    assert second0["probe_steps"] == 0 and second0["state"] == "locked"
    assert second0["winner"] == _node_optimum()
    assert r0["second"]["applied"] == r1["second"]["applied"] and r0["second"]["applied"][0] == [0, _node_optimum()]


def _worker_mismatch(rank: int, world_size: int) -> dict[str, Any]:
    from autotune import AutotuneConfig

    # Same static plan, but rank 1 derived a different chunk ladder (e.g. from a different model).
    chunks = CHUNKS if rank == 0 else CHUNKS + (1 << 24,)
    return _tune(rank, space=_space(chunks), config=AutotuneConfig(timeout_s=30.0), steps=3)


def test_mismatched_spaces_fail_with_a_clear_error_on_every_rank():
    results = run_workers(_worker_mismatch, 2, timeout_s=60)
    for r in results:
        assert not r.ok and not r.killed, r.describe()
        assert r.error_type == "AgreementMismatch", r.describe()
        assert "OnlineTuner" in r.error and "search space" in r.error
        assert "local rank 0" in r.error and "local rank 1" in r.error


def _worker_stops(rank: int, world_size: int, *, victim: int, stop: str) -> dict[str, Any]:
    from autotune import AutotuneConfig

    return _tune(rank, space=_space(), config=AutotuneConfig(timeout_s=5.0), steps=20,
                 stop_at=5 if rank == victim else None, stop=stop)


@pytest.mark.parametrize(("victim", "stop"), [(1, "exit"), (1, "hang")])
def test_a_rank_that_stops_answering_fails_the_other_with_a_named_error(victim, stop):
    survivor = 1 - victim
    results = run_workers(_worker_stops, 2, kwargs={"victim": victim, "stop": stop}, timeout_s=60,
                          wait_ranks=[survivor])
    alive = results[survivor]
    assert not alive.killed and not alive.ok, alive.describe()
    assert alive.error_type == "AgreementTimeout", alive.describe()
    assert "OnlineTuner" in alive.error and "step 5" in alive.error, alive.error
    assert f"local rank(s) {victim} " in alive.error, alive.error
    if stop == "exit":
        assert results[victim].returncode == 3
    else:
        assert "within 5 s" in alive.error and results[victim].killed


#: Survivors must fail within timeout_s plus this; generous because the test machine is loaded.
_GRACE_S = 20.0


def _worker_signalled(rank: int, world_size: int, *, victim: int, stop: str, timeout_s: float,
                      tmp: str) -> dict[str, Any]:
    from autotune import AutotuneConfig

    try:
        return _tune(rank, space=_space(), config=AutotuneConfig(timeout_s=timeout_s), steps=20,
                     stop_at=5 if rank == victim else None, stop=stop, stop_file=f"{tmp}/stopped")
    except Exception:
        Path(f"{tmp}/failed.{rank}").write_text(repr(time.time()))
        raise


@pytest.mark.parametrize("victim", [0, 1])
@pytest.mark.parametrize("stop", ["sigstop", "sigkill"])
def test_a_stopped_or_killed_rank_fails_every_survivor_in_time(tmp_path, victim, stop):
    """Real signals on 3 ranks: SIGSTOP freezes the victim's whole process, the store that local
    rank 0 hosts included; SIGKILL closes its connections. Every survivor must fail within the
    tuner's timeout plus a grace, naming the step, the rank and what happened to it."""
    timeout_s = 5.0
    survivors = [r for r in range(3) if r != victim]
    results = run_workers(_worker_signalled, 3, timeout_s=150, wait_ranks=survivors,
                          kwargs={"victim": victim, "stop": stop, "timeout_s": timeout_s, "tmp": str(tmp_path)})
    stopped_at = float((tmp_path / "stopped").read_text())
    for r in survivors:
        alive = results[r]
        assert not alive.killed and not alive.ok, alive.describe()
        assert alive.error_type == "AgreementTimeout", alive.describe()
        named = re.search(r"local rank\(s\) ([\d, ]+) \(", alive.error)
        assert "step 5" in alive.error and named, alive.error
        # A survivor that fails fast exits, so a third rank may find it gone too: it names both.
        assert victim in [int(x) for x in named.group(1).split(",")], alive.error
        state = "is stopped" if stop == "sigstop" else "exited"
        assert f"local rank {victim} {state}" in alive.error, alive.error
        if stop == "sigkill":  # its connections closed at once: no claim that it was silent for 5 s
            assert "did not answer within" not in alive.error and "made it fail after" in alive.error, alive.error
        else:
            assert f"did not answer within {timeout_s:g} s" in alive.error, alive.error
        failed_after = float((tmp_path / f"failed.{r}").read_text()) - stopped_at
        assert failed_after < timeout_s + _GRACE_S, (failed_after, alive.error)


def _worker_two_caches(rank: int, world_size: int, *, tmp: str) -> dict[str, Any]:
    from autotune import AutotuneConfig, TuningCache, knobs

    records = _Records()
    logging.getLogger("autotune").addHandler(records)
    os.environ[knobs.CACHE_VAR] = f"{tmp}/cache.{rank}.json"  # as a per-rank launcher script would
    config = AutotuneConfig(probe_steps=48, timeout_s=30.0)
    result = _tune(rank, space=_space(), config=config, steps=48, cache=TuningCache())
    return {"log": records.messages, "state": result["summary"]["state"]}


def test_ranks_naming_different_caches_are_warned_naming_both(tmp_path):
    results = run_workers(_worker_two_caches, 2, kwargs={"tmp": str(tmp_path)}, timeout_s=90)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)
    for r in results:
        warned = [m for m in r.value["log"] if "different tuning caches" in m]
        assert len(warned) == 1, r.value["log"]
        assert f"local rank 0: {tmp_path}/cache.0.json" in warned[0] and f"local rank 1: {tmp_path}/cache.1.json" in warned[0]
        assert r.value["state"] == "locked"
    assert (tmp_path / "cache.0.json").exists() and not (tmp_path / "cache.1.json").exists()
