"""``OffloadSettings.bind_numa`` switched between steps, and the tuner's ``bind_numa`` knob.

Switched on, the rank is bound to its node and the host state's pages are moved there in place
(``mbind`` with ``MPOL_MF_MOVE``, ``offload.state._pages``); switched off, the affinity is restored
and the pages stay. Exact whatever the switches (parameters and moments bitwise those of torch's
AdamW). The binder runs over a fake sysfs root (``numa_binder=``) and the page mover is a recorder
(``page_mover=``), except in the tests that call the real ``mbind`` on node 0 of this single-node
machine. The knob is probed only where the local masks span several NUMA nodes and the user left
``bind_numa`` unset; the tuner's decisions are tested with injected times, never with the clock.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_bitwise, FakeTunable, lock_in, until_locked

from autotune import AutotuneConfig
from offload import CPUOffloadAdamW, OffloadSettings, ThreadPlan
from offload.state._pages import mbind_move, page_node, page_ranges, page_size
from offload.threads._numa import bind_to_numa_node
from offload.tuning._glue import OffloadTuning, masks_span_numa_nodes, offload_search_space

pytestmark = pytest.mark.usefixtures("single_threaded_main")

MASK = frozenset(os.sched_getaffinity(0))
REAL_MBIND = platform.system() == "Linux" and platform.machine() in ("x86_64", "aarch64") and Path(
    "/sys/devices/system/node/node0").is_dir()


def _fake_nodes(root: Path, nodes: dict[int, str]) -> None:
    for node, cpulist in nodes.items():
        path = root / f"sys/devices/system/node/node{node}/cpulist"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(cpulist + "\n")


def _binder(root: Path, node: int):
    """A binder to ``node`` of the fake sysfs tree at ``root`` (that node lists every CPU of the
    mask: bound, the mask unchanged)."""
    _fake_nodes(root, {node: ",".join(map(str, sorted(MASK)))})
    return lambda device: bind_to_numa_node(node, root=root)


class Recorder:
    """A page mover that records its calls (and fails with ``error``, if given)."""

    def __init__(self, error: OSError | None = None) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.error = error

    def __call__(self, addr: int, nbytes: int, node: int) -> None:
        self.calls.append((addr, nbytes, node))
        if self.error is not None:
            raise self.error


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8))


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
    return model(x).square().mean()


def _train(schedule: list[bool | None], *, binder: Any, mover: Any, overlap: bool = False,
           check: Any = None) -> tuple[list[torch.Tensor], CPUOffloadAdamW]:
    """A step per entry of ``schedule`` (the ``bind_numa`` in force: the first at construction,
    the others through ``apply_settings``); ``check(opt)`` after every switch."""
    model = _model()
    opt = CPUOffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, overlap_backward=overlap,
                          settings=OffloadSettings(threads=1, chunk_numel=1024, bind_numa=schedule[0]),
                          numa_binder=binder, page_mover=mover)
    for step, bind in enumerate(schedule):
        if bind != opt.settings.bind_numa:
            opt.apply_settings(replace(opt.settings, bind_numa=bind))
            if check is not None:
                check(opt)
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()
    return list(model.parameters()), opt


def _torch_reference(steps: int) -> tuple[list[torch.Tensor], torch.optim.AdamW]:
    model = _model()
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(steps):
        _loss(model, step).backward()
        ref.step()
        ref.zero_grad()
    return list(model.parameters()), ref


def _covered(regions: list[tuple[int, int]], ranges: list[tuple[int, int]]) -> bool:
    return all(any(lo <= addr and addr + n <= lo + size for lo, size in ranges) for addr, n in regions)


def _state_regions(opt: CPUOffloadAdamW, params: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.numel() * t.element_size()) for p in params
            for key, t in opt.state[p].items() if key != "step" and t.numel()]


# ---------------------------------------------------------------- switching, exact
SCHEDULES = {"never": [None] * 6, "on-off-on": [None, True, True, False, True, False],
             "from-construction": [True, False, False, True, None, True]}


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_switching_bind_numa_between_steps_never_changes_the_numbers(tmp_path: Path, overlap: bool) -> None:
    """Off, on, off, on between steps (and on from construction): parameters and moments bitwise
    torch's fused AdamW; every switch on moves page-aligned ranges covering every state tensor
    (the second generation's too, with overlap) to the bound node, in place (the state keeps its
    addresses); a switch off moves nothing."""
    expected, ref = _torch_reference(6)
    ref_params = list(ref.param_groups[0]["params"])
    for name, schedule in SCHEDULES.items():
        mover = Recorder()
        seen: list[int] = []

        def check(opt: CPUOffloadAdamW) -> None:
            placement = opt.numa_placement
            if not opt.settings.bind_numa:  # off: nothing moved
                assert placement is None and len(mover.calls) == (seen[-1] if seen else 0)
                return
            assert placement is not None and placement.binding.node == 3 and placement.order == ["bind", "move-pages"]
            new = mover.calls[seen[-1] if seen else 0:]
            assert new and all(node == 3 and addr % page_size() == 0 for addr, _, node in new)
            assert placement.moved == [(a, n) for a, n, _ in new] and placement.move_error is None
            params = [p for g in opt.param_groups for p in g["params"]]
            if opt.state:
                assert _covered(_state_regions(opt, params), placement.moved)
            seen.append(len(mover.calls))

        params, opt = _train(schedule, binder=_binder(tmp_path / name, 3), mover=mover, overlap=overlap, check=check)
        try:
            assert_bitwise(params, expected, f"params, {name}")
            for key in ("exp_avg", "exp_avg_sq"):
                assert_bitwise([opt.state[p][key] for p in params], [ref.state[p][key] for p in ref_params],
                               f"{key}, {name}")
            switches_on = sum(1 for a, b in zip(schedule, schedule[1:]) if b and not a)
            assert len(seen) == switches_on
        finally:
            opt.close()


def test_a_switch_on_moves_pages_in_place_with_the_real_mbind(tmp_path: Path) -> None:
    """The default page mover (``mbind`` through ctypes) on node 0 of this machine, switched on
    between steps: no warning, every range moved, the state's addresses unchanged, each state
    tensor's pages on node 0, and the numbers torch's."""
    if not REAL_MBIND:
        pytest.skip("mbind: Linux on x86-64 or aarch64 with a NUMA node 0 in sysfs only")
    model = _model()
    opt = CPUOffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                          settings=OffloadSettings(threads=1, chunk_numel=1024), numa_binder=_binder(tmp_path, 0))
    try:
        for step in range(4):
            if step == 2:
                params = list(model.parameters())
                before = _state_regions(opt, params)
                opt.apply_settings(replace(opt.settings, bind_numa=True))
                placement = opt.numa_placement
                assert placement is not None and placement.move_error is None and placement.moved
                assert _state_regions(opt, params) == before  # in place: the same addresses
                assert _covered(before, placement.moved)
                assert {page_node(addr) for addr, _ in before} == {0}
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad()
        expected, _ = _torch_reference(4)
        assert_bitwise(list(model.parameters()), expected, "params after a real page move")
    finally:
        opt.close()


def test_the_real_mbind_moves_a_tensor_to_node_0_and_keeps_its_bits() -> None:
    if not REAL_MBIND:
        pytest.skip("mbind: Linux on x86-64 or aarch64 with a NUMA node 0 in sysfs only")
    t = torch.randn(3 << 20, generator=torch.Generator().manual_seed(1))
    copy, addr = t.clone(), t.data_ptr()
    ranges = page_ranges([(addr, t.numel() * 4)])
    assert len(ranges) == 1 and ranges[0][0] % page_size() == 0 and ranges[0][1] >= t.numel() * 4
    mbind_move(*ranges[0], 0)
    assert t.data_ptr() == addr and torch.equal(t, copy)
    assert {page_node(addr + off) for off in range(0, t.numel() * 4, 1 << 20)} == {0}
    with pytest.raises(OSError):  # unaligned: refused before the call
        mbind_move(ranges[0][0] + 8, 4096, 0)


def test_page_ranges_align_and_merge() -> None:
    page = 4096
    assert page_ranges([(100, 10), (5000, 10), (4096 * 3 + 1, 4096), (0, 0)], page) == [
        (0, 2 * page), (3 * page, 2 * page)]


def test_a_failed_page_move_warns_once_and_training_carries_on(tmp_path: Path, caplog) -> None:
    """A mover that fails (here: the real ``mbind`` to a node this machine lacks, and a recorder
    raising EIO): no exception, the failure in ``numa_placement.move_error``, one WARNING over
    two switches on, and the numbers unchanged."""
    schedule = [None, True, False, True, True]
    expected, _ = _torch_reference(len(schedule))
    movers: list[Any] = [Recorder(OSError(5, "Input/output error"))]
    if REAL_MBIND:
        movers.append(None)  # the real mbind, to node 63: EINVAL
    for i, mover in enumerate(movers):
        caplog.clear()
        errors: list[str | None] = []
        with caplog.at_level(logging.INFO, logger="offload.state._placement"):
            params, opt = _train(schedule, binder=_binder(tmp_path / str(i), 63), mover=mover,
                                 check=lambda o: errors.append(o.numa_placement and o.numa_placement.move_error))
        opt.close()
        assert_bitwise(params, expected, "params after failed page moves")
        assert errors[0] and "page ranges not (fully) moved to NUMA node 63" in errors[0]
        assert errors == [errors[0], None, errors[0]]  # the switch off records nothing
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "bind_numa" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]


def test_nothing_to_choose_is_a_logged_no_op(tmp_path: Path, caplog) -> None:
    """One NUMA node (the default binder over a one-node sysfs): switching on binds nothing and
    moves nothing, and says so."""
    from offload.threads._numa import bind_rank_numa_node

    _fake_nodes(tmp_path, {0: ",".join(map(str, sorted(MASK)))})
    mover = Recorder()
    with caplog.at_level(logging.INFO, logger="offload.state._placement"):
        params, opt = _train([None, True, True], mover=mover,
                             binder=lambda device: bind_rank_numa_node(device, root=tmp_path))
    try:
        assert not mover.calls and opt.numa_placement.order == ["bind", "move-skipped"]
        assert not opt.numa_placement.binding.bound and frozenset(os.sched_getaffinity(0)) == MASK
        assert any("no NUMA node to choose" in r.getMessage() for r in caplog.records)
    finally:
        opt.close()


@pytest.mark.skipif(len(MASK) < 2, reason="needs an affinity mask of >= 2 CPUs")
def test_switching_off_restores_the_affinity_of_threads_started_while_bound(tmp_path: Path) -> None:
    """Bound at construction (the worker thread starts bound, so the bind did not change it),
    then switched off between steps: the caller and the worker get the whole mask back; on again
    narrows them, off again restores them."""
    keep = sorted(MASK)[1:]
    _fake_nodes(tmp_path, {0: str(min(MASK)), 1: ",".join(map(str, keep))})
    from offload.threads._numa import bind_rank_numa_node

    model = _model()
    opt = CPUOffloadAdamW(model.parameters(), settings=OffloadSettings(threads=1, bind_numa=True),
                          numa_binder=lambda device: bind_rank_numa_node(device, root=tmp_path), page_mover=Recorder())
    try:
        bound = opt.numa_placement.binding.cpus
        assert bound < MASK
        worker = next(t for t in threading.enumerate() if t.name.startswith("offload-adamw-"))
        assert frozenset(os.sched_getaffinity(worker.native_id)) == bound
        for on in (False, True, False):
            opt.apply_settings(replace(opt.settings, bind_numa=on))
            want = bound if on else MASK
            assert frozenset(os.sched_getaffinity(0)) == want
            assert frozenset(os.sched_getaffinity(worker.native_id)) == want
    finally:
        opt.close()
    assert frozenset(os.sched_getaffinity(0)) == MASK


def test_bind_numa_none_is_off_and_checked() -> None:
    assert OffloadSettings().bind_numa is None
    for bad in (1, "yes", 0.0):
        with pytest.raises(ValueError, match="bind_numa=.*: expected None or a bool"):
            OffloadSettings(bind_numa=bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the knob
def _plan(per_node: tuple[tuple[int, ...], ...] = ()) -> ThreadPlan:
    return ThreadPlan(threads=2, reason="test plan", source="plan", cpus=frozenset(range(2)), local_world_size=2,
                      planned_threads=2, local_threads=(2, 2), local_masks=(frozenset(range(2)),) * 2,
                      local_masks_per_numa_node=per_node)


SPANNING = ((8, 8), (8, 8))  # two ranks, each mask on both nodes
SPLIT = ((16, 0), (0, 16))  # two ranks, each mask inside one node


def test_masks_span_numa_nodes() -> None:
    assert masks_span_numa_nodes(_plan(SPANNING))
    assert masks_span_numa_nodes(_plan(((16, 0), (4, 12))))  # one rank spanning is enough
    assert not masks_span_numa_nodes(_plan(SPLIT))
    assert not masks_span_numa_nodes(_plan(()))  # one NUMA node


def test_the_knob_follows_threads_and_is_absent_unless_asked() -> None:
    common = dict(max_threads=4, baseline_threads=4, fixed_threads=False, baseline_chunk=1 << 20,
                  largest_slab=1 << 22)
    assert "bind_numa" not in offload_search_space(**common).names
    space = offload_search_space(**common, bind_numa=True)
    assert space.names[:2] == ("threads", "bind_numa") and space.knobs[1].values == (False, True)
    assert space.knobs[1].prefer == "low"


@pytest.mark.parametrize(("per_node", "bind", "probed"), [
    (SPANNING, None, True),  # masks across nodes, left to the tuner
    (SPLIT, None, False),  # each mask inside one node: nothing to bind to
    ((), None, False),  # one NUMA node
    (SPANNING, False, False),  # pinned off by the user
    (SPANNING, True, False),  # pinned on by the user
])
def test_the_optimizer_probes_the_knob_only_where_masks_span_nodes(
        tmp_path: Path, per_node: tuple[tuple[int, ...], ...], bind: bool | None, probed: bool) -> None:
    opt = CPUOffloadAdamW(_model().parameters(), settings=OffloadSettings(chunk_numel=1024, bind_numa=bind),
                          plan=_plan(per_node), autotune=AutotuneConfig(use_cache=False),
                          numa_binder=_binder(tmp_path, 0), page_mover=Recorder())
    try:
        assert ("bind_numa" in opt.tuner.space.names) is probed
        if probed:
            assert opt.tuner.baseline["bind_numa"] is False
            assert opt.settings.bind_numa is False and opt.numa_placement is None  # the baseline: off
    finally:
        opt.close()


@pytest.mark.parametrize(("gain", "winner"), [(0.2, True), (0.0, False)])
def test_the_tuner_locks_in_binding_where_it_pays(gain: float, winner: bool) -> None:
    """Injected node times: bound is ``gain`` faster. It is locked in only where it pays; a tie
    keeps the baseline (unbound); within the default probe budget."""
    space = offload_search_space(max_threads=16, baseline_threads=16, largest_slab=1 << 26, baseline_chunk=1 << 22,
                                 fixed_threads=False, bind_numa=True)

    def cost(setting: dict[str, Any]) -> float:
        return (1.0 + abs(setting["threads"] - 8) / 16) * (1.0 - gain * setting["bind_numa"])

    tuner, steps = lock_in(space, {"threads": 16, "chunk_numel": 1 << 22, "bind_numa": False}, cost)
    assert tuner.state == "locked" and steps <= AutotuneConfig().probe_steps
    assert tuner.summary()["winner"]["bind_numa"] is winner
    assert tuner.summary()["winner"]["threads"] == 8


def _fake_optimizer() -> FakeTunable:
    """Its step takes 1.0 s, 0.8 s bound."""
    return FakeTunable(OffloadSettings(threads=2, chunk_numel=1024, kernel="torch"), lambda s: bool(s.bind_numa))


def _tuning(opt: FakeTunable, cache: Path) -> OffloadTuning:
    return OffloadTuning(opt, AutotuneConfig(cache_path=str(cache)), plan=_plan(SPANNING), fixed_threads=False,
                         objective="step", workload={"params": 1024, "test": "bind_numa"}, largest_slab=1024)


def test_the_locked_binding_reaches_apply_settings_and_round_trips_through_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    opt = _fake_optimizer()
    tuning = _tuning(opt, cache)
    assert "bind_numa" in tuning.tuner.space.names
    summary = until_locked(tuning)
    assert summary["winner"]["bind_numa"] is True and not summary["cache_hit"]
    assert opt.settings.bind_numa is True
    assert {s.bind_numa for s in opt.applied} == {False, True}  # both probed
    tuning.close()

    again = _fake_optimizer()
    tuning = _tuning(again, cache)  # the cached choice, re-checked on its first steps
    summary = until_locked(tuning)
    assert summary["cache_hit"] and summary["winner"]["bind_numa"] is True
    assert again.settings.bind_numa is True
    tuning.close()


# ---------------------------------------------------------------- the step model
def test_the_step_model_binds_where_masks_span_sockets_and_simulate_probes_it_there() -> None:
    """``bench.simulate._stepmodel``: bound, a shared-mask rank reads its state locally (as fast as the
    NUMA-bound node), a cyclic rank too, but on half its cores (its static plan's threads then
    oversubscribe them); a node whose masks lie inside one socket is unchanged. ``bench.simulate``
    builds the knob from the real search space on exactly the nodes whose masks span sockets."""
    from bench.simulate._nodes import NODES, build_node
    from bench.simulate._session import plan_node, tuning_inputs

    shared, numa, cyclic = (build_node(f"2s60c-smt2-8r-{m}") for m in ("shared", "numa", "cyclic"))
    chunk = 1 << 25
    assert shared.node_time([8] * 8, chunk, bind_numa=True) == numa.node_time([8] * 8, chunk)
    assert shared.node_time([8] * 8, chunk, bind_numa=True) < 0.85 * shared.node_time([8] * 8, chunk)
    assert numa.node_time([8] * 8, chunk, bind_numa=True) == numa.node_time([8] * 8, chunk)
    assert cyclic.node_time([8] * 8, chunk, bind_numa=True) < 0.9 * cyclic.node_time([8] * 8, chunk)
    assert cyclic.node_time([15] * 8, chunk, bind_numa=True) > 1.3 * cyclic.node_time([15] * 8, chunk)
    assert [len(m) for m in cyclic.bound().masks] == [16, 14, 16, 14, 14, 16, 14, 16]
    for name in NODES:
        node = build_node(name)
        space, baseline, _ = tuning_inputs(node, plan_node(node))
        assert ("bind_numa" in space.names) is node.spans_numa_nodes, name
        assert baseline.get("bind_numa", False) is False
    assert [n for n in NODES if build_node(n).spans_numa_nodes] == [
        "2s60c-smt2-8r-shared", "2s32c-smt2-8r-shared", "2s60c-smt2-8r-cyclic"]


# ---------------------------------------------------------------- threads once bound
def _two_sockets() -> Any:
    """2 sockets x 8 cores, no SMT: CPUs 0-7 on node 0, 8-15 on node 1."""
    from offload.threads._topology import CpuTopology

    return CpuTopology.from_cores([[c] for c in range(16)], numa_nodes={0: range(8), 1: range(8, 16)})


def test_the_bound_plan_reruns_the_rule_on_the_masks_narrowed_to_each_node() -> None:
    """Shared mask, 4 ranks, 2 bound to each node: 4 threads each unbound (16 cores / 4) and bound
    (8 cores / 2). Cyclic masks (each rank 2 cores on each node), each bound to one node: 4
    threads unbound, 2 bound: never more than the node's cores. Unknown nodes: no bound plan."""
    from offload import plan_cpu_threads
    from offload.testing import RankCpus

    topo, everything = _two_sockets(), frozenset(range(16))
    shared = [RankCpus(cpus=everything, node=r // 2) for r in range(4)]
    plans = [plan_cpu_threads(masks=shared, local_rank=r, topology=topo, cpu_count=16) for r in range(4)]
    assert [(p.threads, p.bound_threads) for p in plans] == [(4, 4)] * 4
    cyclic = [RankCpus(cpus=frozenset({2 * r, 2 * r + 1, 8 + 2 * r, 9 + 2 * r}), node=r % 2) for r in range(4)]
    plans = [plan_cpu_threads(masks=cyclic, local_rank=r, topology=topo, cpu_count=16) for r in range(4)]
    assert [(p.threads, p.bound_threads) for p in plans] == [(4, 2)] * 4
    crowded = [RankCpus(cpus=everything, node=0) for _ in range(4)]  # all on node 0: 8 cores for 4
    assert plan_cpu_threads(masks=crowded, local_rank=0, topology=topo, cpu_count=16).bound_threads == 2
    unknown = [RankCpus(cpus=everything) for _ in range(4)]
    assert plan_cpu_threads(masks=unknown, local_rank=0, topology=topo, cpu_count=16).bound_threads is None
    fixed = plan_cpu_threads(masks=cyclic, local_rank=0, topology=topo, cpu_count=16, threads=4)
    assert (fixed.threads, fixed.bound_threads) == (4, 2)  # an override, clamped to the 2 bound CPUs


def test_the_rank_node_travels_with_the_mask_through_the_agreement() -> None:
    """bind_node goes into the plan's one exchange: every rank's bound plan sees every node."""
    from autotune.testing import InProcessAgreement
    from offload import plan_cpu_threads

    topo = _two_sockets()
    world = InProcessAgreement.group(4)
    out: list[Any] = [None] * 4

    def rank(r: int) -> None:
        out[r] = plan_cpu_threads(agreement=world[r], topology=topo, cpus=range(16), cpu_count=16, bind_node=r // 2)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [(p.threads, p.bound_threads, p.masks_from) for p in out] == [(4, 4, "agreement")] * 4


def test_a_bound_rank_runs_at_most_its_bound_threads() -> None:
    """The tuner's bind_numa=True reaches apply_settings with threads capped at the bound plan's
    count; unbound, at the plan's own."""
    opt = _fake_optimizer()
    plan = replace(_plan(SPANNING), threads=4, planned_threads=4, local_threads=(4, 4), bound_threads=2)
    tuning = OffloadTuning(opt, AutotuneConfig(use_cache=False), plan=plan, fixed_threads=False, objective="step",
                           workload={"params": 1024, "test": "bound threads"}, largest_slab=1024)
    until_locked(tuning)
    assert {s.threads for s in opt.applied if s.bind_numa} <= {1, 2}
    assert 4 in {s.threads for s in opt.applied if not s.bind_numa}
    tuning.close()
