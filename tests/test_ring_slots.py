"""``OffloadSettings.ring_slots``: the depth of the CUDA transport's pinned staging rings (slots per
direction; the worker issues ``slots - 1`` chunks' gradient copies ahead of the kernel), changed
between steps with ``apply_settings``, and the tuner's ``ring_slots`` knob, probed only where the
step runs the CUDA transport.

Without a GPU: the whole optimizer runs its CUDA path on fake device ops (``tests/_fake_cuda.py``,
``CPUOffloadAdamW(device_ops=)``) over bf16 CPU parameters. Exact whatever the depth (parameters
and moments bitwise those of the default depth); the depth is seen in the pinned bytes, the
blocks held and the gradient copies in flight. The tuner's decisions are tested with injected
times, never with the clock.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from _fake_cuda import FakeEvent, FakeOps, Log
from conftest import assert_bitwise, FakeTunable, lock_in, make_model, param_groups, until_locked

from autotune import AutotuneConfig
from offload import CPUOffloadAdamW, OffloadSettings, StepStats, ThreadPlan
from offload._settings import MAX_RING_SLOTS
from offload.kernels._adamw import KernelSet, fused_adamw_
from offload.tuning._glue import RING_LADDER, OffloadTuning, offload_search_space

pytestmark = pytest.mark.usefixtures("single_threaded_main")

SETTINGS = OffloadSettings(threads=1, chunk_numel=1024)
STEPS = 4


class _DepthOps(FakeOps):
    """Fake device ops that also count the gradient copies in flight: issued (their end event
    made, in ``issue_d2h``) and not yet waited for by the host (``finish_d2h``)."""

    def __init__(self) -> None:
        super().__init__(Log(10.0), 0, gate=False)
        self._lock = threading.Lock()
        self.in_flight = 0
        self.most_in_flight = 0

    def event(self, label: tuple[str, int, str]) -> FakeEvent:
        if label[0] != "d2h" or label[2] != "end":
            return super().event(label)
        ops = self

        class _Counted(FakeEvent):
            waited = False

            def query(self) -> bool:  # the host's polled wait (finish_d2h, a slot's reuse)
                done = super().query()
                with ops._lock:
                    if done and not self.waited:
                        self.waited = True
                        ops.in_flight -= 1
                return done

        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return _Counted(label, self.host_waits)


@pytest.fixture
def ops() -> Iterator[_DepthOps]:
    ops = _DepthOps()
    yield ops
    ops.close()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32)).to(torch.bfloat16)


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
    return model(x).float().square().mean()


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    return [{"params": list(model[2].parameters())}, {"params": list(model[0].parameters()), "lr": 5e-3}]


def _run(ops: FakeOps, *, depths: list[int | None], overlap: bool) -> tuple[torch.nn.Module, CPUOffloadAdamW,
                                                                           list[StepStats]]:
    """``STEPS`` steps on the fake-CUDA path, ``depths[i]`` the ring depth in force at step ``i``
    (the first at construction, the others through ``apply_settings``)."""
    model = _model()
    opt = CPUOffloadAdamW(_groups(model), lr=1e-2, weight_decay=0.1, overlap_backward=overlap, device_ops=ops,
                          settings=replace(SETTINGS, ring_slots=depths[0]))
    stats = []
    for step, depth in enumerate(depths):
        if depth != opt.settings.ring_slots:
            opt.apply_settings(replace(opt.settings, ring_slots=depth))
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()
        stats.append(opt.last_stats)
    return model, opt, stats


# ---------------------------------------------------------------- the setting
@pytest.mark.parametrize("bad", [0, 1, -2, True, 2.0, "3", MAX_RING_SLOTS + 1])
def test_ring_slots_is_a_checked_setting(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"OffloadSettings.ring_slots={bad!r}: expected None or an int from 2 to "
                                         rf"{MAX_RING_SLOTS}"):
        OffloadSettings(ring_slots=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_the_ring_depth_never_changes_the_numbers(overlap: bool) -> None:
    """Depths 2, 3, 4 from the start and 2 -> 4 -> 3 between steps: parameters and moments
    bitwise those of the default depth after every run; the rings really are that deep (pinned
    bytes: two rings of ``depth`` chunk-sized blocks, plus the early weights' places with
    overlap); with overlap the chunks started during backward commit."""
    runs: dict[str, tuple[torch.nn.Module, CPUOffloadAdamW, list[StepStats], FakeOps]] = {}
    schedules: dict[str, list[int | None]] = {
        "default": [None] * STEPS, "2": [2] * STEPS, "3": [3] * STEPS, "4": [4] * STEPS, "2-4-3": [2, 4, 4, 3]}
    try:
        for name, depths in schedules.items():
            ops = FakeOps(Log(10.0), 0, gate=False)
            runs[name] = (*_run(ops, depths=depths, overlap=overlap), ops)
        ref_model, ref, ref_stats, _ = runs["default"]
        for name, (model, opt, stats, _) in runs.items():
            assert_bitwise(list(model.parameters()), list(ref_model.parameters()), f"params, depth {name}")
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert_bitwise([opt.state[p][key] for p in model.parameters()],
                               [ref.state[p][key] for p in ref_model.parameters()], f"{key}, depth {name}")
            if overlap:
                assert sum(s.committed_chunks for s in stats) > 0, name
        pinned = {name: [s.pinned_bytes for s in stats] for name, (_, _, stats, _) in runs.items()}
        assert pinned["default"] == pinned["2"]
        assert pinned["2"][-1] < pinned["3"][-1] < pinned["4"][-1], pinned
        if not overlap:  # only the two rings: exactly proportional to the depth
            assert pinned["3"][-1] * 2 == pinned["2"][-1] * 3 and pinned["4"][-1] == 2 * pinned["2"][-1], pinned
        # the changed depth: the rings of a run made at that depth, from the step after the change
        assert pinned["2-4-3"] == [pinned["2"][0], pinned["4"][1], pinned["4"][2], pinned["3"][3]], pinned
        assert runs["2-4-3"][2][2].pinned_registrations == 0  # the same depth again: nothing new
    finally:
        for _, opt, _, ops in runs.values():
            opt.close()
            assert not ops.pinned  # every block given back, the dropped slots' too
            ops.close()


class _HoldFirstKernel:
    """torch's fused AdamW, whose first call of each step waits until the thread that called
    ``step()`` waits in the drain: every chunk is queued by then, so from the second chunk on the
    worker fills its lookahead (what it issues ahead is the depth's, not the submit's timing)."""

    def __init__(self) -> None:
        self.armed = False
        self.main = threading.get_ident()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if self.armed:
            self.armed = False
            deadline = time.monotonic() + 60
            while not self._main_in("drain"):
                assert time.monotonic() < deadline, "step() never reached the drain"
                time.sleep(0.001)
        fused_adamw_(*args, **kwargs)

    def _main_in(self, name: str) -> bool:
        frame = sys._current_frames().get(self.main)
        while frame is not None:
            if frame.f_code.co_name == name:
                return True
            frame = frame.f_back
        return False


def test_the_depth_is_how_many_gradient_copies_are_in_flight(ops: _DepthOps) -> None:
    """Made at depth 2, then 4, then 3 through ``apply_settings``: at most ``depth`` chunks'
    gradient copies are in flight at once (the current chunk's and ``depth - 1`` ahead), and
    with enough chunks queued exactly that many; the host transport's step takes the setting
    and ignores it."""
    spy = _HoldFirstKernel()
    model = _model()
    opt = CPUOffloadAdamW(_groups(model), device_ops=ops, kernels=KernelSet(fused_adamw=spy),
                          settings=replace(SETTINGS, kernel="torch", ring_slots=2))
    opt.register_step_pre_hook(lambda *_: setattr(spy, "armed", True))
    try:
        seen = []
        for step, depth in enumerate((2, 2, 4, 4, 3, 3)):
            opt.apply_settings(replace(opt.settings, ring_slots=depth))
            _loss(model, step).backward()
            ops.most_in_flight = 0
            opt.step()
            opt.zero_grad()
            assert opt.last_stats.num_chunks > max(RING_LADDER), opt.last_stats.num_chunks  # enough to fill the ring
            seen.append(ops.most_in_flight)
        assert seen == [2, 2, 4, 4, 3, 3], seen
    finally:
        opt.close()
    host_model = make_model(torch.bfloat16)
    host = CPUOffloadAdamW(param_groups(host_model), settings=replace(SETTINGS, ring_slots=4))
    host.apply_settings(replace(host.settings, ring_slots=3))  # no ring: nothing to re-make
    assert host.settings.ring_slots == 3
    host.close()


# ---------------------------------------------------------------- the knob
def _plan(threads: int) -> ThreadPlan:
    return ThreadPlan(threads=threads, reason="test plan", source="plan", cpus=frozenset(range(threads)),
                      local_world_size=1, planned_threads=threads, local_threads=(threads,))


def test_the_knob_is_last_in_the_space_and_absent_unless_asked() -> None:
    common = dict(max_threads=2, baseline_threads=2, fixed_threads=False, baseline_chunk=1 << 20,
                  largest_slab=1 << 22)
    assert "ring_slots" not in offload_search_space(**common).names
    space = offload_search_space(**common, ring_slots=True)
    assert space.names[-1] == "ring_slots" and space.knobs[-1].values == RING_LADDER == (2, 3, 4)


@pytest.mark.parametrize(("cuda", "settings", "probed"), [
    (True, SETTINGS, True),  # the CUDA transport (on fake device ops): a ring to size
    (False, SETTINGS, False),  # the host transport: no ring
    (True, replace(SETTINGS, ring_slots=3), False),  # set by the user: it stays
])
def test_the_optimizer_probes_the_knob_only_on_the_cuda_transport(
        ops: FakeOps, cuda: bool, settings: OffloadSettings, probed: bool) -> None:
    model = _model()
    opt = CPUOffloadAdamW(_groups(model), settings=replace(settings, threads=None), plan=_plan(2),
                          device_ops=ops if cuda else None, autotune=AutotuneConfig(use_cache=False))
    try:
        assert opt.tuner is not None
        assert ("ring_slots" in opt.tuner.space.names) is probed
        if probed:
            assert opt.tuner.baseline["ring_slots"] == 2  # today's depth
    finally:
        opt.close()


@pytest.mark.parametrize(("gain", "winner"), [(0.08, 4), (0.0, 2)])
def test_the_tuner_locks_in_a_deeper_ring_where_it_pays(gain: float, winner: int) -> None:
    """Injected step times on the fake-CUDA space: each slot beyond 2 saves ``gain`` (copies ride
    out the kernel's jitter). A deeper ring is locked in only where it is faster; a tie keeps
    the baseline's 2 (less pinned memory); the search fits the default probe budget."""
    space = offload_search_space(max_threads=4, baseline_threads=4, largest_slab=1 << 24, baseline_chunk=1 << 22,
                                 fixed_threads=False, kernels=("torch", "fused-mp"), ring_slots=True)

    def cost(setting: dict[str, Any]) -> float:
        return 1.0 * 4 / setting["threads"] ** 0.5 - gain * (setting["ring_slots"] - 2)

    tuner, steps = lock_in(space, {"threads": 4, "chunk_numel": 1 << 22, "kernel": "torch", "ring_slots": 2}, cost)
    assert tuner.state == "locked" and steps <= AutotuneConfig().probe_steps
    # Where it pays, a deeper ring (within the default budget the sweep reaches 3 slots or 4);
    # where it does not, the baseline's 2.
    assert (tuner.summary()["winner"]["ring_slots"] > 2) if winner > 2 else tuner.summary()["winner"]["ring_slots"] == 2
    assert tuner.summary()["winner"]["threads"] == 4


def _fake_optimizer() -> FakeTunable:
    """Its step time (the "step" objective) is 1.0 s, 0.8 s with a 4-slot ring."""
    return FakeTunable(replace(SETTINGS, threads=2, kernel="torch"), lambda s: s.ring_slots == 4)


def _tuning(opt: FakeTunable, cache: Path) -> OffloadTuning:
    return OffloadTuning(opt, AutotuneConfig(cache_path=str(cache)), plan=_plan(2), fixed_threads=False,
                         objective="step", workload={"params": 1024, "test": "ring_slots"}, largest_slab=1024,
                         cuda_transport=True)


def test_the_locked_depth_reaches_apply_settings_and_round_trips_through_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    opt = _fake_optimizer()
    tuning = _tuning(opt, cache)
    assert "ring_slots" in tuning.tuner.space.names
    summary = until_locked(tuning)
    assert summary["winner"]["ring_slots"] == 4 and not summary["cache_hit"]
    assert opt.settings.ring_slots == 4
    assert {s.ring_slots for s in opt.applied} == set(RING_LADDER)  # each depth probed
    tuning.close()

    again = _fake_optimizer()
    tuning = _tuning(again, cache)  # the cached choice, re-checked on its first steps
    summary = until_locked(tuning)
    assert summary["cache_hit"] and summary["winner"]["ring_slots"] == 4
    assert again.settings.ring_slots == 4
    tuning.close()
