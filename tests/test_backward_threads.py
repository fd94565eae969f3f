"""``OffloadSettings.backward_threads``: the intra-op threads of the chunks started during backward,
apart from the drain's ``threads`` (DeepSpeed Reflow's point: busy cores slow the trainer's
launch-bound backward, while in ``step()`` it only waits), and the tuner's ``backward_threads``
knob, probed only with overlap and more than one thread.

Exact whatever the count (the kernels are bitwise independent of it): checked against the same
run at another count. The tuner's decisions are tested with injected times (fixed costs, or the
step-time model of ``bench.simulate._stepmodel``), never with the clock.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_bitwise, batch, lock_in, make_model, param_groups

from autotune import AutotuneConfig
from offload._settings import MAX_THREADS
from bench.simulate._nodes import NODES
from bench.simulate._stepmodel import Node, Workload
from offload import CPUOffloadAdamW, OffloadSettings, StepStats, ThreadPlan
from offload.kernels._adamw import KernelSet, mixed_precision_adamw_
from offload.tuning._glue import OffloadTuning, backward_ladder, backward_thread_count, offload_search_space

pytestmark = pytest.mark.usefixtures("single_threaded_main")

SETTINGS = OffloadSettings(threads=2, chunk_numel=1024)


def _plan(threads: int) -> ThreadPlan:
    return ThreadPlan(threads=threads, reason="test plan", source="plan", cpus=frozenset(range(threads)),
                      local_world_size=1, planned_threads=threads, local_threads=(threads,))


# ---------------------------------------------------------------- the setting
@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2", MAX_THREADS + 1])
def test_backward_threads_is_a_checked_setting(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"OffloadSettings.backward_threads={bad!r}: expected None or an int"):
        OffloadSettings(backward_threads=bad)  # type: ignore[arg-type]


def _train(model: torch.nn.Module, opt: CPUOffloadAdamW, steps: int) -> list[tuple[int, int]]:
    seen = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        model(batch(step, 0)).backward()
        opt.step()
        seen.append((opt.last_stats.speculated_chunks, opt.last_stats.committed_chunks))
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_threads_never_change_the_numbers(dtype: torch.dtype) -> None:
    """Overlap on, 1 and 2 threads for the early chunks (the drain at 2), and overlap off:
    parameters, moments and steps bitwise equal."""
    runs = {}
    for name, backward, overlap in (("one", 1, True), ("two", 2, True), ("off", None, False)):
        model = make_model(dtype)
        opt = CPUOffloadAdamW(param_groups(model), settings=replace(SETTINGS, backward_threads=backward),
                              overlap_backward=overlap)
        seen = _train(model, opt, 4)
        if overlap:
            assert all(s > 0 and s == c for s, c in seen[1:]), seen  # the early chunks ran and committed
        runs[name] = (model, opt)
    for name in ("two", "off"):
        (model, opt), (ref_model, ref) = runs["one"], runs[name]
        assert_bitwise(list(model.parameters()), list(ref_model.parameters()), f"params vs {name}")
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert_bitwise([opt.state[p][key] for p in model.parameters() if opt.state.get(p)],
                           [ref.state[p][key] for p in ref_model.parameters() if ref.state.get(p)], f"{key} vs {name}")
    for _, opt in runs.values():
        opt.close()


class _ThreadSpy:
    """The fused-mp kernel, recording the worker's intra-op threads of every call, early (it gets
    the speculation's ``checksums``) or not; ``hold`` makes the next early call wait until the
    thread that called ``step()`` waits for that chunk's kernel (so the later early chunks are
    still queued when ``step()`` starts)."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, int]] = []
        self.early = threading.Semaphore(0)
        self.hold = False
        self.held = threading.Event()  # the held early call has begun (its threads are set)
        self.in_step = threading.Event()
        self.main = threading.get_ident()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        early = kwargs.get("checksums") is not None
        if early and self.hold:
            self.hold = False
            self.held.set()
            assert self.in_step.wait(60), "step() was not called"
            self._wait_for_step_to_wait()
        self.calls.append((early, torch.get_num_threads()))
        mixed_precision_adamw_(*args, **kwargs)
        if early:
            self.early.release()

    def _wait_for_step_to_wait(self) -> None:
        """Until the main thread waits in ``Pipeline.wait_for`` (step() judging the first early
        chunk, after it took the window's early jobs)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            frame = sys._current_frames().get(self.main)
            names = set()
            while frame is not None:
                names.add(frame.f_code.co_name)
                frame = frame.f_back
            if "wait_for" in names:
                return
            time.sleep(0.001)
        raise AssertionError("step() never waited for the first early chunk")


def _spied(backward: int | None) -> tuple[torch.nn.Module, CPUOffloadAdamW, _ThreadSpy]:
    spy = _ThreadSpy()
    model = make_model(torch.bfloat16)
    opt = CPUOffloadAdamW(param_groups(model), settings=replace(SETTINGS, kernel="fused-mp", backward_threads=backward),
                          overlap_backward=True, kernels=KernelSet(mixed_precision_adamw=spy))
    opt.register_step_pre_hook(lambda *_: spy.in_step.set())
    return model, opt, spy


@pytest.mark.parametrize(("backward", "early_threads"), [(1, 1), (None, 2), (8, 2)])
def test_early_chunks_run_with_backward_threads_and_the_drain_with_threads(
        kernel: object, backward: int | None, early_threads: int) -> None:
    """Every early kernel waited for before ``step()``: it ran during backward, with
    ``backward_threads`` (None: ``threads``; above it: clamped to it); the chunks ``step()`` runs
    (the first step, before any state exists) with ``threads``."""
    model, opt, spy = _spied(backward)
    _train(model, opt, 1)  # no state yet: every chunk runs in step()
    late = {t for e, t in spy.calls if not e}
    spy.calls.clear()
    _train(model, opt, 1)  # the hooks learn the chunks: as many start early from now on
    launched, calls = opt.last_stats.speculated_chunks, sum(e for e, _ in spy.calls)
    spy.calls.clear()
    while spy.early.acquire(blocking=False):
        pass
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        model(batch(step, 0)).backward()
        for _ in range(calls):
            assert spy.early.acquire(timeout=60), "an early kernel did not run"
        opt.step()
        assert opt.last_stats.speculated_chunks == launched
    early = {t for e, t in spy.calls if e}
    assert early == {early_threads} and late == {2}, spy.calls
    assert all(t == 2 for e, t in spy.calls if not e), spy.calls
    assert opt.last_stats.committed_chunks > 0
    opt.close()


def test_early_chunks_still_queued_when_step_starts_run_with_threads(kernel: object) -> None:
    """The first early kernel of a backward is held until ``step()`` waits for it: the early
    chunks queued behind it run after backward, when the trainer only waits, so with the drain's
    threads; bitwise the same as ever."""
    model, opt, spy = _spied(1)
    _train(model, opt, 2)
    spy.calls.clear()
    spy.hold = True
    spy.in_step.clear()
    opt.zero_grad(set_to_none=True)
    model(batch(2, 0)).backward()
    # The worker has begun the first early chunk (with backward's threads) before step() starts:
    # on a loaded machine it may not have run at all during backward, and then every early chunk
    # rightly begins after step() started, with its threads (a failure seen on two pytest workers).
    assert spy.held.wait(60), "no early chunk began"
    opt.step()
    early = [t for e, t in spy.calls if e]
    assert len(early) >= 2 and opt.last_stats.committed_chunks == opt.last_stats.speculated_chunks > 1, spy.calls
    assert early[0] == 1 and set(early[1:]) == {2}, spy.calls
    opt.close()


# ---------------------------------------------------------------- the knob
def test_the_ladder_composes_with_the_thread_knob() -> None:
    """Counts from 1 to the top thread count; a rank runs ``min(value, threads)`` during backward
    (None in the settings: the same as ``threads``), never more than the drain."""
    assert backward_ladder(1) == (1,)
    for top in (2, 3, 8, 15, 128):
        ladder = backward_ladder(top)
        assert 2 <= len(ladder) <= 3 and ladder[0] == 1 and ladder[-1] == top
        assert backward_thread_count(top, top) is None  # the baseline: today's behaviour
        for threads in range(1, top + 1):
            counts = [backward_thread_count(v, threads) for v in ladder]
            assert all(c is None or 1 <= c < threads for c in counts)


def test_knob_is_absent_without_overlap_and_with_one_thread() -> None:
    common = dict(baseline_chunk=1 << 20, largest_slab=1 << 22)
    with_overlap = offload_search_space(max_threads=4, baseline_threads=4, fixed_threads=False, speculate=True,
                                        backward_threads=True, **common)
    assert with_overlap.names == ("backward_threads", "threads", "chunk_numel", "speculate")
    one_cpu = offload_search_space(max_threads=1, baseline_threads=1, fixed_threads=False, speculate=True,
                                   backward_threads=True, **common)
    assert "backward_threads" not in one_cpu.names
    fixed_one = offload_search_space(max_threads=4, baseline_threads=1, fixed_threads=True, speculate=True,
                                     backward_threads=True, **common)
    assert "backward_threads" not in fixed_one.names
    fixed_four = offload_search_space(max_threads=4, baseline_threads=4, fixed_threads=True, speculate=True,
                                      backward_threads=True, **common)
    assert "backward_threads" in fixed_four.names  # the user's thread count, still shared with backward
    with pytest.raises(ValueError, match="backward_threads=True needs speculate=True"):
        offload_search_space(max_threads=4, baseline_threads=4, fixed_threads=False, backward_threads=True, **common)


@pytest.mark.parametrize(("overlap", "threads", "settings", "probed"), [
    (True, 2, SETTINGS, True),
    (False, 2, SETTINGS, False),  # no overlap: no chunk runs during backward
    (True, 1, SETTINGS, False),  # one thread: nothing to give backward
    (True, 2, replace(SETTINGS, backward_threads=1), False),  # set by the user: it stays
])
def test_the_optimizer_probes_the_knob_only_where_it_can_matter(
        tmp_path: Path, overlap: bool, threads: int, settings: OffloadSettings, probed: bool) -> None:
    model = make_model(torch.float32)
    settings = replace(settings, threads=None)
    opt = CPUOffloadAdamW(param_groups(model), settings=settings, overlap_backward=overlap, plan=_plan(threads),
                          autotune=AutotuneConfig(use_cache=False))
    assert opt.tuner is not None
    assert ("backward_threads" in opt.tuner.space.names) is probed
    if probed:
        assert opt.tuner.space.knobs[0].values == (1, 2)
    opt.close()


@pytest.mark.parametrize(("busy_cost", "winner"), [(0.3, 1), (0.0, 8)])
def test_the_tuner_locks_in_few_backward_threads_where_busy_cores_slow_backward(
        busy_cost: float, winner: float) -> None:
    """Injected iteration times on an 8-thread plan: each thread during backward costs
    ``busy_cost / 8`` of the backward (busy cores slow the launch-bound backward); the exposed
    step shrinks with the drain's threads. The static plan's count (8) stays unless a lower one
    is clearly faster (a tie keeps the top count, the same as ``threads``); the search fits the
    default probe budget."""
    space = offload_search_space(max_threads=8, baseline_threads=8, largest_slab=1 << 24, baseline_chunk=1 << 22,
                                 fixed_threads=False, speculate=True, backward_threads=True)
    assert space.names[0] == "backward_threads" and space.knobs[0].values == (1, 2, 8)

    def cost(setting: dict[str, Any]) -> float:
        threads = int(setting["threads"])
        backward = backward_thread_count(int(setting["backward_threads"]), threads) or threads
        exposed_step = 0.2 * 8 / threads if setting["speculate"] else 0.6 * 8 / threads
        return (1.0 + busy_cost * backward / 8 if setting["speculate"] else 1.0) + exposed_step

    tuner, steps = lock_in(space, {"threads": 8, "chunk_numel": 1 << 22, "speculate": True, "backward_threads": 8}, cost)
    summary = tuner.summary()
    assert tuner.state == "locked" and steps <= AutotuneConfig().probe_steps
    assert summary["winner"]["backward_threads"] == winner
    assert summary["winner"]["threads"] == 8 and summary["winner"]["speculate"] is True


# ---------------------------------------------------------------- the glue: apply and cache
class _FakeOptimizer:
    """What the glue sees of ``CPUOffloadAdamW`` (``offload.tuning._glue.Tunable``)."""

    def __init__(self) -> None:
        self.settings = replace(SETTINGS, kernel="torch")
        self.applied: list[OffloadSettings] = []
        self.last_stats = StepStats(step_s=0.0, d2h_s=0.0, adam_kernel_s=0.0, materialize_s=0.0, drain_s=0.0,
                                    threads=2, chunk_numel=1024, num_chunks=1, numel=1024)

    def apply_settings(self, settings: OffloadSettings) -> None:
        self.settings = settings
        self.applied.append(settings)


class _IterationClock:
    """Each step() return is one iteration after the previous one: 1.0 s, 0.8 s with two threads
    and one of them during backward (the injected measurement: busy cores slow backward)."""

    def __init__(self, opt: _FakeOptimizer) -> None:
        self.opt, self.t = opt, 0.0

    def __call__(self) -> float:
        s = self.opt.settings
        self.t += 0.8 if s.speculate and s.threads == 2 and s.backward_threads == 1 else 1.0
        return self.t


def _tuning(opt: _FakeOptimizer, cache: Path) -> OffloadTuning:
    return OffloadTuning(opt, AutotuneConfig(cache_path=str(cache)), plan=_plan(2), fixed_threads=False,
                         objective="iteration", workload={"params": 1024, "test": "backward_threads"},
                         largest_slab=1024, clock=_IterationClock(opt))


def test_the_locked_count_reaches_apply_settings_and_round_trips_through_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    opt = _FakeOptimizer()
    tuning = _tuning(opt, cache)
    assert "backward_threads" in tuning.tuner.space.names
    for _ in range(100):
        tuning.after_step()
        if tuning.tuner.state == "locked":
            break
    summary = tuning.tuner.summary()
    assert summary["winner"]["backward_threads"] == 1 and not summary["cache_hit"]
    assert opt.settings.backward_threads == 1 and opt.settings.threads == 2
    assert {s.backward_threads for s in opt.applied} == {None, 1}  # 2: None, the drain's count
    tuning.close()

    again = _FakeOptimizer()
    tuning = _tuning(again, cache)  # the cached choice, re-checked on its first steps
    for _ in range(100):
        tuning.after_step()
        if tuning.tuner.state == "locked":
            break
    summary = tuning.tuner.summary()
    assert summary["cache_hit"] and summary["winner"]["backward_threads"] == 1
    assert again.settings.backward_threads == 1
    tuning.close()


# ---------------------------------------------------------------- the step-time model
def _node(*, params: int, launch_share: float, clock_drop: float = 0.6) -> Node:
    """``bench.simulate``'s 2-socket node, 8 ranks on 15 cores each, overlapped with a backward
    whose host thread is launch-bound for ``launch_share`` of it, and a tenth of the parameters
    (the embedding, the first layers) ready only at its end. The clock drop is exaggerated (0.6:
    under the model's default 0.15 the knob gains about 1 % at most over tuning ``threads``
    alone, the lock-in rule's minimum gain)."""
    shape = NODES["2s60c-smt2-8r-numa-overlap"]()
    return Node(name=shape.name, hardware=replace(shape.hardware, all_core_clock_drop=clock_drop), masks=shape.masks,
                workload=replace(shape.workload, params=params, backward_launch_share=launch_share,
                                 last_grads_share=0.1))


def test_the_model_of_backward_threads() -> None:
    """``bench.simulate._stepmodel``: with a GPU-bound backward fewer early threads never help; with a
    launch-bound one they do where the step hides behind backward, and do not where it cannot
    (the backlog left for ``step()``)."""
    chunk, t = 1 << 22, [15] * 8
    quiet = _node(params=600_000_000, launch_share=0.0)
    assert quiet.node_time(t, chunk, t) == quiet.node_time(t, chunk)
    assert quiet.node_time(t, chunk, [1] * 8) >= quiet.node_time(t, chunk)
    hidden = _node(params=600_000_000, launch_share=1.0)
    assert hidden.node_time(t, chunk, [4] * 8) < hidden.node_time(t, chunk)
    exposed = _node(params=2_000_000_000, launch_share=1.0)
    assert exposed.node_time(t, chunk, [1] * 8) > exposed.node_time(t, chunk, [4] * 8) > exposed.node_time(t, chunk)
    for bad in ({"backward_launch_share": 1.5}, {"last_grads_share": 1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Workload(params=1, **bad)


@pytest.mark.parametrize(("params", "low_wins"), [(600_000_000, True), (2_000_000_000, False)])
def test_the_tuner_on_the_model_runs_backward_apart_only_where_it_pays(params: int, low_wins: bool) -> None:
    """The real tuner and search space on noise-free model times of that node: fewer threads
    during backward than in the drain where the model's best setting has that (and within 0.5 %
    of that best), the same where the step cannot hide."""
    node = _node(params=params, launch_share=1.0)
    plain = Node(name="plain", hardware=node.hardware, masks=node.masks,
                 workload=replace(node.workload, overlap_backward=False))
    space = offload_search_space(max_threads=15, baseline_threads=15, largest_slab=params, baseline_chunk=1 << 22,
                                 fixed_threads=False, speculate=True, backward_threads=True)

    def model_time(setting: dict[str, Any]) -> float:
        threads, chunk = int(setting["threads"]), int(setting["chunk_numel"])
        if not setting["speculate"]:  # nothing early: the whole step runs after backward
            return node.workload.forward_s + node.workload.backward_s + plain.node_time([threads] * 8, chunk)
        backward = backward_thread_count(int(setting["backward_threads"]), threads) or threads
        return node.node_time([threads] * 8, chunk, [backward] * 8)

    baseline = {"threads": 15, "chunk_numel": 1 << 22, "speculate": True, "backward_threads": 15}
    tuner, _ = lock_in(space, baseline, model_time)
    assert tuner.state == "locked"
    winner = tuner.summary()["winner"]
    best = min(space.candidates(), key=model_time)

    def apart(setting: dict[str, Any]) -> bool:
        return int(setting["backward_threads"]) < int(setting["threads"])

    assert apart(best) is low_wins, best
    assert apart(winner) is low_wins, winner
    assert model_time(winner) <= 1.005 * model_time(best), (winner, best)
