"""Thread budget: topology reading from a fake sysfs tree, the allocation rule, overrides, the
static-rule comparison, process-state helpers and the NUMA bind helper (single process)."""

from __future__ import annotations

import logging
import os
import random
import re
import threading
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from autotune import knobs
from offload._settings import THREADS_VAR
from autotune.testing import InProcessAgreement
from offload import ThreadPlan, plan_cpu_threads, thread_limit
from offload.testing import CgroupCpuLimit, CpuTopology, RankCpus
from offload.threads._numa import bind_to_device_numa_node, bind_to_numa_node
from offload.threads._rule import ThreadPlanError, allocate_threads, static_rule_threads
from offload.threads._plan import apply_thread_plan, forget_logged_plans
from offload.threads._topology import (
    TopologyError,
    format_cpulist,
    normalize_pci_bus_id,
    parse_cpulist,
    read_cgroup_cpu_limit,
    read_cpu_topology,
)

REPO = Path(__file__).absolute().parents[1]
FLAT8 = CpuTopology.from_cores([[c] for c in range(8)])
#: 4 physical cores, 2-way SMT, Linux-style numbering (siblings are c and c + 4).
SMT4 = CpuTopology.from_cores([[c, c + 4] for c in range(4)], numa_nodes={0: range(8)})


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (THREADS_VAR, "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_sysfs(root: Path, cores: list[list[int]], *, nodes: dict[int, str] | None = None,
               legacy_names: bool = False) -> Path:
    """A tree under ``root`` that looks like /sys for the given sibling lists and NUMA nodes."""
    name = "thread_siblings_list" if legacy_names else "core_cpus_list"
    for core in cores:
        for cpu in core:
            write(root / f"sys/devices/system/cpu/cpu{cpu}/topology/{name}", format_cpulist(core) + "\n")
    write(root / "sys/devices/system/cpu/online", "0-%d\n" % max(max(c) for c in cores))
    for node, cpulist in (nodes or {}).items():
        write(root / f"sys/devices/system/node/node{node}/cpulist", cpulist + "\n")
    return root


# ------------------------------------------------------------------------------ topology


def test_cpulist_round_trip_and_errors() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("0-7:2") == {0, 2, 4, 6}
    assert parse_cpulist("") == frozenset()
    assert format_cpulist({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    with pytest.raises(TopologyError, match="'0-x'"):
        parse_cpulist("0-x")
    with pytest.raises(TopologyError, match="bad range"):
        parse_cpulist("5-2")
    assert normalize_pci_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    with pytest.raises(TopologyError, match="PCI bus id"):
        normalize_pci_bus_id("gpu0")


@pytest.mark.parametrize("legacy", [False, True])
def test_read_topology_from_fake_sysfs(tmp_path: Path, legacy: bool) -> None:
    fake_sysfs(tmp_path, [[0, 4], [1, 5], [2, 6], [3, 7]], nodes={0: "0-1,4-5", 1: "2-3,6-7", 2: ""},
               legacy_names=legacy)
    topo = read_cpu_topology(tmp_path)
    assert topo.source == "sysfs"
    assert topo.cores == tuple(frozenset({c, c + 4}) for c in range(4))
    assert topo.smt
    assert topo.node_cpus(1) == {2, 3, 6, 7}
    assert topo.node_cpus(2) == frozenset()  # a CPU-less (memory-only) node is listed, empty
    assert topo.numa_nodes_of({0, 6}) == (0, 1)
    assert topo.cgroup_limit is None


def test_topology_falls_back_to_psutil_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 8 if logical else 4)
    topo = read_cpu_topology(tmp_path)  # empty tree: no sysfs topology
    assert (topo.source, topo.cores, topo.physical_per_logical) == ("psutil", (), Fraction(1, 2))
    assert allocate_threads([range(8)], topo).threads == (4,)
    assert allocate_threads([range(8)], topo, smt=True).threads == (8,)


def test_cgroup_v2_quota_is_the_tightest_ancestor(tmp_path: Path) -> None:
    write(tmp_path / "proc/self/cgroup", "0::/job/rank0\n")
    cg = tmp_path / "sys/fs/cgroup"
    write(cg / "cgroup.controllers", "cpu memory\n")
    write(cg / "job/cpu.max", "250000 100000\n")
    write(cg / "job/rank0/cpu.max", "max 100000\n")
    limit = read_cgroup_cpu_limit(tmp_path)
    assert limit == CgroupCpuLimit(cpus=2.5, cgroup="v2:/job/rank0")
    assert limit.thread_cap == 2
    write(cg / "job/cpu.max", "max 100000\n")
    assert read_cgroup_cpu_limit(tmp_path) is None


def test_cgroup_v1_quota_and_namespaced_path(tmp_path: Path) -> None:
    # A cgroup namespace shows a path that does not exist under the mount: read the mount root.
    write(tmp_path / "proc/self/cgroup", "4:memory:/x\n3:cpu,cpuacct:/kubepods/pod1\n0::/\n")
    cpu = tmp_path / "sys/fs/cgroup/cpu,cpuacct"
    write(cpu / "cpu.cfs_quota_us", "150000\n")
    write(cpu / "cpu.cfs_period_us", "100000\n")
    assert read_cgroup_cpu_limit(tmp_path) == CgroupCpuLimit(cpus=1.5, cgroup="v1:/kubepods/pod1")
    write(cpu / "cpu.cfs_quota_us", "-1\n")
    assert read_cgroup_cpu_limit(tmp_path) is None


def test_topology_rejects_overlapping_cores() -> None:
    with pytest.raises(TopologyError, match=r"CPUs \[1\]"):
        CpuTopology.from_cores([[0, 1], [1, 2]])


# ------------------------------------------------------------------------------ allocation


def test_two_ranks_sharing_two_cpus_get_one_thread_each() -> None:
    alloc = allocate_threads([{0, 1}, {0, 1}], FLAT8)
    assert alloc.threads == (1, 1)
    assert alloc.shared_cpus == (2, 2)
    assert alloc.covered_cpus == 2


def test_disjoint_masks_get_their_own_size() -> None:
    assert allocate_threads([{0, 1, 2}, {3, 4}], FLAT8).threads == (3, 2)


def test_smt_siblings_are_not_counted_by_default() -> None:
    assert allocate_threads([range(8)], SMT4).threads == (4,)
    assert allocate_threads([range(8)], SMT4, smt=True).threads == (8,)
    # Two ranks on the two hardware threads of the same cores share those cores.
    assert allocate_threads([{0, 1}, {4, 5}], SMT4).threads == (1, 1)
    # A mask holding only one sibling of each core counts each core once.
    assert allocate_threads([{0, 1, 2, 3}], SMT4).threads == (4,)


def test_overlapping_masks_split_the_shared_cpus() -> None:
    alloc = allocate_threads([range(0, 4), range(2, 6)], FLAT8)
    assert alloc.shares == (Fraction(3), Fraction(3))  # 2 own + 2 halves each
    assert alloc.threads == (3, 3)
    alloc = allocate_threads([range(0, 4), range(2, 5)], FLAT8)  # 2 + 1, 1 + 1
    assert alloc.shares == (Fraction(3), Fraction(2)) and alloc.threads == (3, 2)


def test_shares_round_down_even_when_a_cpu_is_left_over() -> None:
    # 1.5 CPUs each: 1 thread each. Giving the spare CPU to one rank would not shorten the step,
    # since the slowest rank sets the node's pace, and it would make the ranks uneven.
    alloc = allocate_threads([{0, 1, 2}, {0, 1, 2}], FLAT8)
    assert alloc.shares == (Fraction(3, 2), Fraction(3, 2))
    assert alloc.threads == (1, 1)


def test_one_thread_minimum_is_paid_for_by_the_largest_rank() -> None:
    alloc = allocate_threads([{0}, {0}, {0, 1, 2, 3}], FLAT8)
    assert alloc.raised == (0, 1)
    assert alloc.threads == (1, 1, 2)  # rank 2's share is 3 1/3, trimmed to fit 4 CPUs
    assert alloc.trimmed == (2,)
    # More ranks than CPUs: the minimum wins, nobody can be trimmed further.
    assert allocate_threads([{0}, {0}, {0}], FLAT8).threads == (1, 1, 1)


def test_cgroup_quota_caps_ranks_that_share_it() -> None:
    quota = CgroupCpuLimit(cpus=3.5, cgroup="v2:/job")
    alloc = allocate_threads([RankCpus(cpus=frozenset(range(4)), cgroup=quota),
                              RankCpus(cpus=frozenset(range(4, 8)), cgroup=quota)], FLAT8)
    assert sum(alloc.threads) == 3 and min(alloc.threads) >= 1
    assert alloc.cgroup_caps == (("v2:/job", 3.5, 3, (0, 1)),)
    assert alloc.capacity == 3
    # A quota below one CPU per rank still leaves each rank one thread.
    tiny = CgroupCpuLimit(cpus=0.5, cgroup="v2:/job")
    assert allocate_threads([RankCpus(cpus=frozenset({0, 1}), cgroup=tiny),
                             RankCpus(cpus=frozenset({2, 3}), cgroup=tiny)], FLAT8).threads == (1, 1)
    # Different cgroups are capped separately.
    a, b = CgroupCpuLimit(cpus=1, cgroup="v2:/a"), CgroupCpuLimit(cpus=4, cgroup="v2:/b")
    assert allocate_threads([RankCpus(cpus=frozenset(range(4)), cgroup=a),
                             RankCpus(cpus=frozenset(range(4, 8)), cgroup=b)], FLAT8).threads == (1, 4)


def test_empty_mask_is_rejected() -> None:
    with pytest.raises(ThreadPlanError, match="local rank 1 has an empty affinity mask"):
        allocate_threads([{0}, set()], FLAT8)


def _random_topology(rng: random.Random) -> CpuTopology:
    ncpu = rng.randint(1, 24)
    cpus = list(range(ncpu))
    rng.shuffle(cpus)
    cores, i = [], 0
    while i < ncpu:
        k = rng.choice([1, 1, 2, 2, 4])
        cores.append(cpus[i:i + k])
        i += k
    if rng.random() < 0.2:  # no sysfs: psutil's average ratio only
        return CpuTopology(physical_per_logical=Fraction(1, rng.choice([1, 2, 4])))
    return CpuTopology.from_cores(cores)


def test_sum_never_exceeds_covered_cpus_property() -> None:
    rng = random.Random(20240607)
    for case in range(600):
        topo = _random_topology(rng)
        ncpu = max((max(c) for c in topo.cores), default=rng.randint(0, 23)) + 1
        nranks = rng.randint(1, 6)
        quota = CgroupCpuLimit(cpus=rng.uniform(0.3, ncpu), cgroup="v2:/q") if rng.random() < 0.3 else None
        ranks = [RankCpus(cpus=frozenset(rng.sample(range(ncpu), rng.randint(1, ncpu))), cgroup=quota)
                 for _ in range(nranks)]
        smt = rng.random() < 0.3
        alloc = allocate_threads(ranks, topo, smt=smt)
        where = f"case {case}: masks {[format_cpulist(r.cpus) for r in ranks]}, {topo}, smt={smt}"
        total = sum(alloc.threads)
        assert total <= max(nranks, alloc.covered_cpus), where
        if nranks <= alloc.covered_cpus:
            assert total <= alloc.covered_cpus, where
        assert total <= max(nranks, alloc.capacity), where
        assert all(1 <= t <= len(r.cpus) for t, r in zip(alloc.threads, ranks)), where
        if not smt:  # physical cores first: never more threads than counted cores (+ the minimum)
            assert total <= max(nranks, int(alloc.counted_units)), where
        if quota is not None:
            assert total <= max(nranks, quota.thread_cap), where
        assert allocate_threads(list(ranks), topo, smt=smt) == alloc, where  # deterministic


def test_static_rule_value() -> None:
    assert static_rule_threads(8, 16, 2) == 8
    assert static_rule_threads(8, 16, 4) == 4
    assert static_rule_threads(1, 2, 8) == 1


# ------------------------------------------------------------------------------ the plan


def test_plan_splits_shared_mask_from_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    plan = plan_cpu_threads(topology=FLAT8, cpus={0, 1}, cpu_count=8)
    assert (plan.threads, plan.source, plan.local_rank, plan.masks_from) == (1, "plan", 1, "environment")
    assert plan.local_threads == (1, 1)
    # The old rule: min(2, 8 // 2) = 2 per rank, 4 threads on 2 CPUs.
    assert plan.static_rule_threads == 2 and plan.oversubscribed_by_static_rule
    assert "2 shared with other local ranks" in plan.reason and "oversubscribes" in plan.reason


def test_plan_counts_physical_cores_and_flags_the_static_rule() -> None:
    plan = plan_cpu_threads(topology=SMT4, cpus=range(8), cpu_count=8)
    assert plan.threads == 4 and plan.static_rule_threads == 8
    assert plan.oversubscribed_by_static_rule
    assert "4 SMT siblings not counted" in plan.reason
    plan = plan_cpu_threads(topology=FLAT8, cpus=range(8), cpu_count=8)
    assert plan.threads == 8 and not plan.oversubscribed_by_static_rule


def test_plan_respects_cgroup_quota() -> None:
    topo = CpuTopology.from_cores([[c] for c in range(8)], cgroup_cpus=2.5)
    plan = plan_cpu_threads(topology=topo, cpus=range(8), cpu_count=8)
    assert plan.threads == 2 and plan.cgroup_cpus == 2.5
    assert "quota 2.5 CPUs" in plan.reason and plan.oversubscribed_by_static_rule


def test_argument_then_environment_override(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = plan_cpu_threads(threads=3, topology=FLAT8, cpus=range(6))
    assert (plan.threads, plan.source, plan.planned_threads) == (3, "argument", 6)
    monkeypatch.setenv(THREADS_VAR, "5")
    plan = plan_cpu_threads(topology=FLAT8, cpus=range(6))
    assert (plan.threads, plan.source) == (5, "environment")
    assert f"{THREADS_VAR}=5 overrides" in plan.reason
    assert plan_cpu_threads(threads=3, topology=FLAT8, cpus=range(6)).source == "argument"


@pytest.mark.parametrize("source", ["argument", "environment"])
def test_override_beyond_the_mask_is_clamped_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, source: str
) -> None:
    # 1000 threads on 2 CPUs ran 80x slower without a word; now: the mask's 2, and a warning.
    if source == "environment":
        monkeypatch.setenv(THREADS_VAR, "1000")
    with caplog.at_level(logging.WARNING, logger="offload.threads._plan"):
        plan = plan_cpu_threads(threads=1000 if source == "argument" else None, topology=FLAT8, cpus={2, 3})
    assert (plan.threads, plan.source) == (2, source)
    assert "1000" in plan.reason and "clamped to 2" in plan.reason
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    name = "threads" if source == "argument" else THREADS_VAR
    assert any(f"{name}=1000 asks for more threads than the 2 CPUs" in m and "using 2" in m for m in warned), warned


@pytest.mark.parametrize("raw", ["100000", "99999999999999999999", "1025"])
def test_environment_override_above_the_hard_maximum_raises(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    # 100000 reached torch.set_num_threads and crashed the process; 99999999999999999999 failed
    # only at step() with "Overflow when unpacking long long".
    monkeypatch.setenv(THREADS_VAR, raw)
    with pytest.raises(knobs.KnobError, match=re.escape(f"{THREADS_VAR}={raw!r}: expected an integer from 1 to 1024")):
        plan_cpu_threads(topology=FLAT8, cpus={0})


@pytest.mark.parametrize("bad", [1025, 100000, 10**20])
def test_thread_counts_above_the_hard_maximum_never_reach_torch(bad: int) -> None:
    before = torch.get_num_threads()
    with pytest.raises(ThreadPlanError, match=f"threads={bad}: expected an int from 1 to 1024"):
        plan_cpu_threads(threads=bad, topology=FLAT8, cpus={0})
    with pytest.raises(ThreadPlanError, match="expected an int from 1 to 1024"):
        with thread_limit(bad):
            pass
    from offload import OffloadSettings

    with pytest.raises(ValueError, match=f"OffloadSettings.threads={bad}: expected None or an int from 1 to 1024"):
        OffloadSettings(threads=bad)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("raw", ["abc", "0", "-2", "1.5", "\u0663", "1_0", "+4", "\uff14"])
def test_malformed_environment_override_raises(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(THREADS_VAR, raw)
    with pytest.raises(knobs.KnobError, match=re.escape(f"{THREADS_VAR}={raw!r}")):
        plan_cpu_threads(topology=FLAT8, cpus={0})


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_bad_thread_argument_raises(bad: object) -> None:
    with pytest.raises(ThreadPlanError, match="expected an int from 1 to"):
        plan_cpu_threads(threads=bad, topology=FLAT8, cpus={0})  # type: ignore[arg-type]


def test_local_rank_outside_local_world_size_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ThreadPlanError, match="LOCAL_RANK=2 with LOCAL_WORLD_SIZE=2"):
        plan_cpu_threads(topology=FLAT8, cpus={0})


def test_local_rank_without_local_world_size_is_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    plan = plan_cpu_threads(topology=FLAT8, cpus={0, 1})
    assert (plan.local_world_size, plan.local_rank, plan.threads) == (1, 0, 2)


def test_node_local_rank_beyond_local_world_size_names_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert knobs.node_local_rank() == 1
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(knobs.KnobError, match=r"LOCAL_RANK=5 with LOCAL_WORLD_SIZE=2: expected LOCAL_RANK from 0 to 1"):
        knobs.node_local_rank()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert knobs.node_local_rank() == 5  # LOCAL_RANK alone: nothing to check it against


def _plans_over(agreements: list[InProcessAgreement], masks: list[set[int]], **kw: object) -> list[ThreadPlan]:
    plans: list[ThreadPlan | BaseException | None] = [None] * len(agreements)

    def rank_main(r: int) -> None:
        try:
            plans[r] = plan_cpu_threads(agreement=agreements[r], cpus=masks[r], **kw)  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            plans[r] = exc

    workers = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(agreements))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    for p in plans:
        if isinstance(p, BaseException):
            raise p
    return plans  # type: ignore[return-value]


def test_plan_from_handed_in_masks_exchanges_nothing() -> None:
    masks = [RankCpus(cpus=frozenset(range(4))), RankCpus(cpus=frozenset(range(2, 6)))]
    plan = plan_cpu_threads(masks=masks, local_rank=1, topology=FLAT8, cpu_count=8)
    alloc = allocate_threads(masks, FLAT8)
    assert (plan.local_rank, plan.local_world_size, plan.masks_from) == (1, 2, "given")
    assert plan.local_masks == (frozenset(range(4)), frozenset(range(2, 6)))
    assert plan.local_threads == alloc.threads and plan.threads == plan.planned_threads == alloc.threads[1]
    assert plan.cpus == frozenset(range(2, 6)) and "(masks handed in)" in plan.reason
    # CPU ids work as masks; this rank's cpus= may repeat its own mask.
    same = plan_cpu_threads(masks=[range(4), range(2, 6)], local_rank=1, cpus=range(2, 6), topology=FLAT8,
                            cpu_count=8)
    assert same == plan
    # A rank's RankCpus carries its cgroup quota.
    quota = CgroupCpuLimit(cpus=1.5, cgroup="v2:/job")
    capped = plan_cpu_threads(masks=[RankCpus(cpus=frozenset(range(4)), cgroup=quota)], local_rank=0,
                              topology=FLAT8)
    assert (capped.threads, capped.cgroup_cpus, capped.masks_from) == (1, 1.5, "single")


def test_handed_in_masks_match_the_environment_split(monkeypatch: pytest.MonkeyPatch) -> None:
    given = plan_cpu_threads(masks=[{0, 1}, {0, 1}], local_rank=1, topology=FLAT8, cpu_count=8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    env = plan_cpu_threads(topology=FLAT8, cpus={0, 1}, cpu_count=8)
    assert given.local_threads == env.local_threads and given.threads == env.threads
    assert given.static_rule_threads == env.static_rule_threads
    assert given.oversubscribed_by_static_rule == env.oversubscribed_by_static_rule


@pytest.mark.parametrize("kw, match", [
    ({"masks": [{0}, {1}], "local_rank": 2}, "local_rank=2 with 2 masks"),
    ({"masks": [{0}, {1}]}, "local_rank=None with 2 masks"),
    ({"masks": [{0}, {1}], "local_rank": True}, "local_rank=True"),
    ({"masks": []}, "masks=\\[\\]"),
    ({"masks": [{0}, {1}], "local_rank": 0, "cpus": {1}}, "cpus=1 is not masks\\[0\\] = 0"),
    ({"local_rank": 0}, "local_rank=0 without masks"),
    ({"masks": [{0}], "local_rank": 0, "group": object()}, "group and masks given"),
    ({"masks": [{0}], "local_rank": 0, "agreement": object()}, "agreement and masks given"),
    ({"agreement": object(), "group": object()}, "group and agreement given"),
])
def test_bad_handed_in_masks_raise(kw: dict, match: str) -> None:
    with pytest.raises(ThreadPlanError, match=match):
        plan_cpu_threads(topology=FLAT8, **kw)


def test_plan_through_an_agreement_exchanges_masks() -> None:
    masks = [set(range(4)), set(range(2, 6)), {7}]
    agreements = InProcessAgreement.group(3, timeout_s=20.0)
    plans = _plans_over(agreements, masks, topology=FLAT8, cpu_count=8)
    for r, plan in enumerate(plans):
        assert (plan.local_rank, plan.local_world_size, plan.masks_from) == (r, 3, "agreement")
        assert plan.local_masks == tuple(frozenset(m) for m in masks)
        assert "(masks exchanged through the given agreement)" in plan.reason
        given = plan_cpu_threads(masks=masks, local_rank=r, topology=FLAT8, cpu_count=8)
        assert (plan.threads, plan.local_threads, plan.static_rule_threads) == (
            given.threads, given.local_threads, given.static_rule_threads)
    assert len({p.local_threads for p in plans}) == 1
    assert agreements[0].collectives == 1  # one all-gather, no group of its own


def test_plan_through_a_one_rank_agreement_is_single() -> None:
    (agreement,) = InProcessAgreement.group(1)
    plan = plan_cpu_threads(agreement=agreement, topology=FLAT8, cpus={0, 1})
    assert (plan.masks_from, plan.local_world_size, plan.threads) == ("single", 1, 2)


def test_failed_agreement_exchange_raises_thread_plan_error() -> None:
    class Broken:
        rank, world_size = 0, 2

        def all_gather(self, obj: object, *, step: int | None, what: str) -> list[object]:
            raise RuntimeError(f"{what}: local rank 1 did not answer")

    with pytest.raises(ThreadPlanError, match="did every rank call plan_cpu_threads.*local rank 1 did not answer"):
        plan_cpu_threads(agreement=Broken(), topology=FLAT8, cpus={0})


@pytest.mark.parametrize("bad", [0, -1.0, True, "30"])
def test_bad_timeout_raises(bad: object) -> None:
    with pytest.raises(ThreadPlanError, match="timeout_s"):
        plan_cpu_threads(timeout_s=bad, topology=FLAT8, cpus={0})  # type: ignore[arg-type]


def test_plan_logs_once_at_info(caplog: pytest.LogCaptureFixture) -> None:
    forget_logged_plans()
    with caplog.at_level(logging.DEBUG, logger="offload.threads._plan"):
        first = plan_cpu_threads(topology=FLAT8, cpus={0, 1, 2})
        plan_cpu_threads(topology=FLAT8, cpus={0, 1, 2})
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and first.reason in infos[0].getMessage()


def test_plan_on_this_machine() -> None:
    mask = frozenset(os.sched_getaffinity(0))
    plan = plan_cpu_threads()
    assert plan.cpus == mask and 1 <= plan.threads <= len(mask)
    assert plan.static_rule_threads is not None and plan.static_rule_threads >= 1
    assert hash(plan) == hash(plan_cpu_threads())  # frozen, hashable, deterministic


def test_thread_plan_contract_fields_still_construct() -> None:
    plan = ThreadPlan(threads=2, reason="r", source="plan", cpus=frozenset({0}), local_world_size=1)
    assert plan.local_threads == () and plan.static_rule_threads is None


# ------------------------------------------------------------------------------ process state


def test_thread_limit_restores_after_an_error() -> None:
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="boom"):
        with thread_limit(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with pytest.raises(ThreadPlanError):
        with thread_limit(0):
            pass


def test_apply_thread_plan_returns_the_previous_count() -> None:
    before = torch.get_num_threads()
    plan = ThreadPlan(threads=1, reason="test", source="argument", cpus=frozenset({0}), local_world_size=1)
    try:
        assert apply_thread_plan(plan) == before
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_numa_bind_skips_cpu_less_node_and_empty_intersection(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mask = frozenset(os.sched_getaffinity(0))
    far = max(mask) + 1000
    fake_sysfs(tmp_path, [[c] for c in sorted(mask)], nodes={0: format_cpulist(mask), 1: "", 2: f"{far}"})
    with caplog.at_level(logging.WARNING, logger="offload.threads._numa"):
        for node, why in [(1, "no CPUs"), (2, "do not intersect"), (7, "no cpulist")]:
            binding = bind_to_numa_node(node, root=tmp_path)
            assert not binding.bound and binding.cpus == mask
            assert frozenset(os.sched_getaffinity(0)) == mask
            assert why in caplog.text


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs an affinity mask of >= 2 CPUs")
def test_numa_bind_intersects_and_restores(tmp_path: Path) -> None:
    mask = frozenset(os.sched_getaffinity(0))
    keep = max(mask)
    # Node 1 holds one CPU of our mask plus CPUs we may not use: the bind must intersect.
    fake_sysfs(tmp_path, [[c] for c in sorted(mask)], nodes={0: format_cpulist(mask - {keep}),
                                                             1: f"{keep},{keep + 100}-{keep + 101}"})
    started, stop = threading.Event(), threading.Event()
    tid: list[int] = []

    def worker() -> None:
        tid.append(threading.get_native_id())
        started.set()
        stop.wait(30)

    t = threading.Thread(target=worker)
    t.start()
    started.wait(30)
    try:
        with bind_to_numa_node(1, root=tmp_path) as binding:
            assert binding.bound and binding.cpus == {keep}
            assert frozenset(os.sched_getaffinity(0)) == {keep}
            assert frozenset(os.sched_getaffinity(tid[0])) == {keep}  # existing threads follow
        assert frozenset(os.sched_getaffinity(0)) == mask
        assert frozenset(os.sched_getaffinity(tid[0])) == mask
    finally:
        stop.set()
        t.join()
        os.sched_setaffinity(0, mask)


def test_device_numa_bind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mask = frozenset(os.sched_getaffinity(0))
    if not torch.cuda.is_available():
        assert not bind_to_device_numa_node(root=tmp_path).bound  # no GPU: a no-op
    fake_sysfs(tmp_path, [[c] for c in sorted(mask)], nodes={0: format_cpulist(mask)})
    write(tmp_path / "sys/bus/pci/devices/0000:3b:00.0/numa_node", "0\n")
    write(tmp_path / "sys/bus/pci/devices/0000:5e:00.0/numa_node", "-1\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    bus = {0: "0000:3b:00.0", 1: "0000:5e:00.0"}
    with bind_to_device_numa_node(root=tmp_path, pci_bus_id=bus.__getitem__) as binding:
        assert binding.bound and binding.node == 0 and binding.cpus == mask
    unknown = bind_to_device_numa_node("cuda:1", root=tmp_path, pci_bus_id=bus.__getitem__)
    assert not unknown.bound and unknown.node is None
    assert not bind_to_device_numa_node("cpu", root=tmp_path, pci_bus_id=bus.__getitem__).bound
    assert frozenset(os.sched_getaffinity(0)) == mask


# ------------------------------------------------------------------------------ docs


def test_environment_doc_lists_every_variable_knobs_reads() -> None:
    """Both modules that read the environment: autotune's (``autotune.knobs``) and offload's
    (``offload._settings``)."""
    import offload._settings as settings

    names: set[str] = set()
    for module, path in ((knobs, REPO / "autotune" / "knobs.py"), (settings, REPO / "offload" / "_settings.py")):
        names |= {n for n in re.findall(r'"([A-Z][A-Z0-9_]{2,})"', path.read_text()) if not hasattr(module, n)}
    assert {"OFFLOAD_AUTOTUNE_THREADS", "LOCAL_WORLD_SIZE", "TORCH_EXTENSIONS_DIR", "OMP_NUM_THREADS"} <= names
    doc = (REPO / "docs" / "environment.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"docs/environment.md does not document {missing}"


def test_starved_masks_are_said_out_loud_once_per_node(caplog: pytest.LogCaptureFixture) -> None:
    """8 local ranks whose masks hold 2 CPUs of a 128-CPU machine: a WARNING with the figures and
    what to do, logged by local rank 0 only (every rank's plan carries the same words); a machine
    whose ranks have their cores says nothing. Never a hang or an exception for it."""
    from offload import plan_cpu_threads
    from offload.testing import CpuTopology
    from offload.threads._plan import forget_logged_plans

    forget_logged_plans()
    topo = CpuTopology.from_cores([[i, i + 64] for i in range(64)])
    with caplog.at_level(logging.WARNING, logger="offload.threads._plan"):
        plans = [plan_cpu_threads(masks=[{0, 1}] * 8, local_rank=r, topology=topo, cpu_count=128) for r in range(8)]
    warnings = [r.getMessage() for r in caplog.records if "CPU starvation" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert all(p.starved == warnings[0] for p in plans) and all(p.threads == 1 for p in plans)
    for figure in ("8 local rank(s)", "2 CPU(s)", "2 physical core(s)", "64 physical cores, 128 CPUs",
                   "0.25 of a physical core per rank", "srun --cpus-per-task", "torchrun --numa-binding", "numactl"):
        assert figure in warnings[0], figure
    small = plan_cpu_threads(masks=[{0, 1, 2, 3}], local_rank=0, topology=topo, cpu_count=128)
    assert small.starved is not None and "4 of the machine's 128 CPUs" in small.starved
    fine = plan_cpu_threads(masks=[set(range(32)), set(range(32, 64))], local_rank=0, topology=topo, cpu_count=128)
    assert fine.starved is None


def test_a_tuned_optimizer_puts_the_starvation_in_its_trace_summary(tmp_path) -> None:
    import json

    import torch

    from autotune import AutotuneConfig
    from offload import CPUOffloadAdamW, plan_cpu_threads
    from offload.testing import CpuTopology

    topo = CpuTopology.from_cores([[i, i + 64] for i in range(64)])
    plan = plan_cpu_threads(masks=[{0, 1, 2, 3}], local_rank=0, topology=topo, cpu_count=128)
    assert plan.starved is not None
    opt = CPUOffloadAdamW([torch.nn.Parameter(torch.zeros(8))], plan=plan,
                          autotune=AutotuneConfig(use_cache=False, trace_dir=str(tmp_path)))
    opt.close()
    summaries = list(tmp_path.rglob("summary.json"))
    assert len(summaries) == 1 and json.loads(summaries[0].read_text())["warnings"] == [plan.starved]
