"""Simulated large nodes: the step-time model behaves as documented, and the simulation drives the
real tuner (its lock-in rule, its agreement checks), not a shortcut."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import numpy as np
import pytest

from autotune import AgreementMismatch, AgreementTimeout, AutotuneConfig, Knob, OnlineTuner, SearchSpace
from autotune.testing import InProcessAgreement
from bench.simulate import _main as simulate
from bench.simulate._stepmodel import Hardware, Node, NoiseModel, Workload

NUMA = "2s60c-smt2-8r-numa"
SHARED = "2s60c-smt2-8r-shared"
SMALL = "1s16c-smt2-1r"


@pytest.fixture(scope="module")
def numa() -> Node:
    return simulate.build_node(NUMA)


@pytest.fixture(scope="module")
def shared() -> Node:
    return simulate.build_node(SHARED)


# --------------------------------------------------------------------------- the model


def test_domain_bandwidth_saturates_monotonically() -> None:
    hw = Hardware(sockets=1, cores_per_socket=64, contention_loss=0.0)
    bws = [hw.domain_bandwidth(u) for u in range(1, 65)]
    assert all(b2 >= b1 for b1, b2 in zip(bws, bws[1:]))
    assert bws[0] == pytest.approx(hw.core_bw_gbs, rel=0.01)  # one core: its own bandwidth
    assert bws[-1] <= hw.domain_bw_gbs and bws[-1] > 0.98 * hw.domain_bw_gbs  # saturated at the peak
    # Linear at first, then the knee: half again as many threads past saturation add almost nothing.
    assert bws[3] / bws[1] > 1.9 and bws[47] / bws[31] < 1.02


def test_step_time_falls_with_threads_then_flattens() -> None:
    node = simulate.build_node(SMALL)
    chunk = 1 << 25
    times = [node.node_time([t], chunk) for t in (1, 2, 4, 8, 16)]
    assert times[0] / times[1] > 1.8  # one core is far from saturating the socket
    assert all(b < a for a, b in zip(times[:3], times[1:4]))
    assert abs(times[4] / times[3] - 1) < 0.08  # saturated: 16 threads within a few % of 8


def test_smt_siblings_add_little() -> None:
    hw = Hardware(sockets=1, cores_per_socket=16, smt=2, background_threads=0.0, oversub_penalty=0.0)
    node = Node(name="t", hardware=hw, masks=(frozenset(range(32)),), workload=Workload(params=1 << 28))
    core_only = node.kernel_rates([16])[0][0]
    with_smt = node.kernel_rates([32])[0][0]
    assert 0.9 < with_smt / core_only <= 1.0  # at most the 5 % an SMT sibling adds
    # Far below saturation an SMT sibling is worth smt_gain of a core, not a core.
    few = Node(name="t", hardware=replace(hw, domain_bw_gbs=1e4), masks=(frozenset(range(32)),),
               workload=Workload(params=1 << 28))
    assert few.kernel_rates([16])[0][0] / few.kernel_rates([32])[0][0] == pytest.approx(1.05, rel=1e-6)


def test_shared_masks_are_slower_than_numa_binding(numa: Node, shared: Node) -> None:
    for t in (1, 2, 4, 8, 15):
        assert shared.node_time([t] * 8, 1 << 25) > numa.node_time([t] * 8, 1 << 25)


def test_oversubscription_costs_more_than_smt_gains(numa: Node) -> None:
    plan = numa.node_time([15] * 8, 1 << 22)
    static = numa.node_time([30] * 8, 1 << 22)  # the old rule's 30 threads per rank
    assert static > 1.2 * plan


def test_tiny_and_huge_chunks_lose(numa: Node) -> None:
    mid = numa.node_time([8] * 8, 1 << 25)
    assert numa.node_time([8] * 8, 1 << 20) > 1.05 * mid  # per-chunk overhead
    assert numa.node_time([8] * 8, 1 << 30) > 1.03 * mid  # no overlap of copies and kernel


def test_overlap_with_backward_hides_small_chunks_more() -> None:
    node = simulate.build_node("2s60c-smt2-8r-numa-overlap")
    plain = simulate.build_node(NUMA)
    wl = node.workload
    for chunk in (1 << 22, 1 << 25):
        serial = wl.forward_s + wl.backward_s + plain.node_time([8] * 8, chunk)
        assert node.node_time([8] * 8, chunk) < serial
    hidden_small = wl.forward_s + wl.backward_s + plain.node_time([8] * 8, 1 << 25) - node.node_time([8] * 8, 1 << 25)
    hidden_huge = wl.forward_s + wl.backward_s + plain.node_time([8] * 8, 1 << 30) - node.node_time([8] * 8, 1 << 30)
    assert hidden_small > hidden_huge


def test_noise_is_heavy_tailed_with_rare_spikes() -> None:
    noise = NoiseModel()
    rng = np.random.default_rng(0)
    f = np.stack([noise.factors(rng, 8) for _ in range(4000)])
    assert abs(np.median(f) - 1) < 0.01
    spikes = np.mean(f > 1.6)
    assert 0.01 < spikes < 0.03  # about spike_prob per rank and step
    assert f.max() > 1.9 and np.quantile(f, 0.9) < 1.06  # a few % typical, 2x occasionally


def test_model_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="cores_per_socket"):
        Hardware(sockets=1, cores_per_socket=0)
    node = simulate.build_node(SMALL)
    with pytest.raises(ValueError, match="threads"):
        node.node_time([0], 1 << 20)
    with pytest.raises(ValueError, match="unknown node"):
        simulate.build_node("nope")


# --------------------------------------------------------------------------- the real planning code


def test_thread_plans_come_from_plan_cpu_threads(numa: Node) -> None:
    plans = simulate.plan_node(numa)
    assert [p.planned_threads for p in plans] == [15] * 8  # 60 physical cores / 4 ranks per socket
    assert [p.static_rule_threads for p in plans] == [30] * 8
    assert all(p.oversubscribed_by_static_rule for p in plans)
    space, baseline, caps = simulate.tuning_inputs(numa, plans)
    assert baseline == {"threads": 15, "chunk_numel": 4 << 20}
    assert space.knobs[0].values == (1, 2, 4, 8, 15) and list(caps) == [15] * 8
    assert caps.bound == (15,) * 8  # each mask inside its socket: binding narrows nothing
    one = simulate.plan_node(simulate.build_node(SMALL))
    assert one[0].planned_threads == 16 and one[0].static_rule_threads == 32


# --------------------------------------------------------------------------- the real tuner


def test_simulated_agreement_runs_the_tuners_own_checks() -> None:
    """Ranks that tune different spaces fail in OnlineTuner's own start() check."""
    agreements = InProcessAgreement.group(2, timeout_s=20.0)
    errors: list[BaseException] = []
    spaces = [SearchSpace((Knob("threads", (1, 2)),)), SearchSpace((Knob("threads", (1, 2, 4)),))]

    def rank(r: int) -> None:
        tuner = OnlineTuner(spaces[r], baseline={"threads": 2}, apply=lambda s: None,
                            config=AutotuneConfig(use_cache=False), group=agreements[r])
        try:
            tuner.start()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(errors) == 2 and all(isinstance(e, AgreementMismatch) for e in errors)
    assert "search space" in str(errors[0])


def _in_threads(fn, world: int) -> list:
    out: list = [None] * world

    def rank(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_in_process_agreement_collectives() -> None:
    agreements = InProcessAgreement.group(3, timeout_s=20.0)
    assert [(a.rank, a.world_size) for a in agreements] == [(0, 3), (1, 3), (2, 3)]
    mine = [{"rank": r} for r in range(3)]

    def rank(r: int) -> tuple:
        a = agreements[r]
        gathered = a.all_gather(mine[r], step=None, what="gather")
        told = a.broadcast(f"from {r}", step=1, what="broadcast")
        top = a.max_float(float(r), step=2, what="max")
        return gathered, told, top

    results = _in_threads(rank, 3)
    for r, (gathered, told, top) in enumerate(results):
        assert gathered == mine and all(g is not m for g, m in zip(gathered, mine))  # pickled per receiver
        assert told == "from 0" and top == 2.0
    assert agreements[0].collectives == agreements[2].collectives == 3


def test_in_process_agreement_times_out_naming_the_step() -> None:
    lonely = InProcessAgreement.group(2, timeout_s=0.2, owner="test node")[0]
    with pytest.raises(AgreementTimeout, match=r"test node: step 7 \(gather\): another rank failed") as info:
        lonely.all_gather(1, step=7, what="gather")
    assert info.value.step == 7


def test_in_process_agreement_abort_releases_the_others() -> None:
    agreements = InProcessAgreement.group(2, timeout_s=20.0)

    def rank(r: int) -> object:
        if r == 1:
            agreements[1].abort()
            return None
        return agreements[0].all_gather(0, step=None, what="start check")

    out = _in_threads(rank, 2)
    assert isinstance(out[0], AgreementTimeout) and "start (start check)" in str(out[0])


@pytest.mark.parametrize("kw", [{"world_size": 0}, {"world_size": True}, {"world_size": 2, "timeout_s": 0}])
def test_in_process_agreement_rejects_bad_group(kw: dict) -> None:
    with pytest.raises(ValueError, match="world_size|timeout_s"):
        InProcessAgreement.group(**kw)


class _RecordingTrace:
    """What ``OnlineTuner(trace=...)`` writes: every measured step and the summary at lock-in."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.summaries: list[dict] = []

    def add_step(self, row: dict) -> None:
        self.rows.append(row)

    def add_spans(self, rank: int, step: int, spans: object) -> None:
        pass

    def write_summary(self, summary: dict) -> None:
        self.summaries.append(summary)


def test_regret_comes_from_the_real_lock_in_rule(numa: Node) -> None:
    plans = simulate.plan_node(numa)
    space, baseline, caps = simulate.tuning_inputs(numa, plans)
    traces = [_RecordingTrace() for _ in range(numa.ranks)]
    out = simulate.run_seed(numa, space, baseline, caps, seed=3, traces=traces)
    calls = [row["decision"] for t in traces for row in t.rows if row["decision"]]
    assert len(calls) == 1  # rank 0 alone decides, once
    assert all(not t.rows and not t.summaries for t in traces[1:])
    (decided,) = traces[0].summaries  # the tuner's summary when it locked in
    assert calls[0] == f"locked {space.describe(out['winner'])}"
    assert decided["winner"] == out["winner"] and decided["reason"] == out["reason"]
    observed = [rank["time_s"] for row in traces[0].rows for rank in row["ranks"].values()]
    assert len(observed) == 8 * out["probe_steps"] and out["probe_steps"] <= AutotuneConfig().probe_steps
    assert out["collectives"] >= 2 * out["probe_steps"]  # a gather and a broadcast per step
    # The tuner saw noisy model times, not the truth.
    assert len(set(observed)) == len(observed)


def test_tuner_finds_a_clear_winner_and_keeps_a_good_static_plan() -> None:
    """A regret check that can fail: when the static plan is 3x slower than the best (1 thread
    forced as baseline), the real tuner leaves it; the regret is then small."""
    node = simulate.build_node(SMALL)
    plans = simulate.plan_node(node)
    space, _, caps = simulate.tuning_inputs(node, plans)
    bad = {"threads": 1, "chunk_numel": 4 << 20}
    out = simulate.run_seed(node, space, bad, caps, seed=0)
    assert out["winner"]["threads"] > 1 and not out["kept_baseline"]


def test_quick_simulation_runs_and_reports(tmp_path) -> None:
    rc = simulate.main(["--quick", "--seeds", "2", "--nodes", f"{NUMA},{SMALL}", "--out-dir", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "simulated_nodes.json").read_text())
    assert [n["node"] for n in data["nodes"]] == [NUMA, SMALL]
    for n in data["nodes"]:
        assert len(n["runs"]) == 2
        assert 0 <= n["regret"]["median"] <= n["regret"]["max"]
        assert n["probe_steps"]["max"] <= n["probe_steps"]["budget"]
        assert n["static_rule"]["oversubscribed"] is True
        best = min(n["truth_s"].values())
        for r in n["runs"]:
            key = " ".join(f"{k}={v}" for k, v in r["winner"].items())
            assert r["regret"] == pytest.approx(n["truth_s"][key] / best - 1)
    md = (tmp_path / "simulated_nodes.md").read_text()
    assert "| node |" in md and "regret" in md and "## The model" in md
    for n in data["nodes"]:  # the share of seeds whose winner is not the most frequent one
        counts = list(n["winners"].values())
        assert n["flip_rate"] == pytest.approx(1 - max(counts) / sum(counts))
    assert "winner flips" in md and data["targets"]["median_probe_steps"] == 32


def test_the_two_socket_shapes_the_issue_names() -> None:
    """A smaller 2-socket node whose 8 ranks share one mask, and one whose ranks' cores span both
    sockets (Slurm's cyclic distribution): each rank's 15 cores are 8 on one socket, 7 on the other."""
    shared = simulate.build_node("2s32c-smt2-8r-shared")
    assert shared.ranks == 8 and len(set(shared.masks)) == 1 and len(shared.masks[0]) == 128
    assert [p.planned_threads for p in simulate.plan_node(shared)] == [8] * 8  # 64 cores / 8 ranks
    cyclic = simulate.build_node("2s60c-smt2-8r-cyclic")
    hw = cyclic.hardware
    for mask in cyclic.masks:
        per_socket = sorted(len({hw.core_of(c) for c in mask if hw.socket_of(c) == s}) for s in range(2))
        assert per_socket == [7, 8] and len(mask) == 30
    assert not set.intersection(*(set(m) for m in cyclic.masks))  # disjoint
    plans = simulate.plan_node(cyclic)
    assert [p.planned_threads for p in plans] == [15] * 8
    # Bound to its GPU's socket a rank keeps the 7 or 8 cores of its mask there, never 15.
    bound = [p.bound_threads for p in plans]
    assert all(b == len({hw.core_of(c) for c in m if hw.socket_of(c) == cyclic.gpu_socket(r)})
               for r, (b, m) in enumerate(zip(bound, cyclic.masks))) and set(bound) <= {7, 8}
    # The shared mask bound: 4 ranks on each 32-core socket, 8 threads each, as unbound.
    assert [p.bound_threads for p in simulate.plan_node(shared)] == [8] * 8


def test_ranks_given_different_noise_lock_in_the_same_winner() -> None:
    """Every rank of a simulated node sees its own noise (per-rank jitter and spikes), and the
    timings are reduced across the ranks (the node's time is their max) before any decision:
    every rank locks in rank 0's winner (``run_seed`` raises if any differs)."""
    node = simulate.build_node("2s60c-smt2-8r-cyclic")
    plans = simulate.plan_node(node)
    space, baseline, caps = simulate.tuning_inputs(node, plans)
    loud = NoiseModel(rank_sigma=0.08, spike_prob=0.1)
    for seed in range(3):
        out = simulate.run_seed(node, space, baseline, caps, seed, noise=loud)
        assert out["winner"] in space.candidates()


def test_in_process_agreement_decides_exactly_as_real_gloo() -> None:
    """Two real processes over gloo (the tuner's own GlooAgreement) and the in-process threads
    take identical decisions from the same model times."""
    check = simulate.gloo_check("1s16c-smt2-2r", [0])
    assert check["all_identical"], check


def test_the_oracle_bound_is_a_floor_that_more_samples_or_less_noise_lower() -> None:
    """The oracle (told the 3 fastest candidates, every probe step spent on them): without noise it
    always picks the best; with the model's noise more steps never raise its regret."""
    from bench.simulate._oracle import oracle_bound

    node = simulate.build_node("2s60c-smt2-8r-exclusive")
    plans = simulate.plan_node(node)
    space, _, caps = simulate.tuning_inputs(node, plans)
    threads_of = lambda c: [min(int(c["threads"]), x) for x in caps]  # noqa: E731 - as bench.simulate caps them
    quiet = NoiseModel(node_sigma=0.0, rank_sigma=0.0, spike_prob=0.0)
    calm = oracle_bound(node, space.candidates(), threads_of, steps=12, noise=quiet, seeds=20)
    assert calm["median"]["p95"] == calm["mean"]["p95"] == calm["median"]["above_2pct"] == 0.0
    assert calm["contenders"] == 3 and calm["samples_each"] == 3
    short = oracle_bound(node, space.candidates(), threads_of, steps=12, seeds=300)
    long = oracle_bound(node, space.candidates(), threads_of, steps=60, seeds=300)
    assert short["median"]["above_2pct"] > long["median"]["above_2pct"]
    assert oracle_bound(node, space.candidates(), threads_of, steps=12, seeds=300) == short  # seeded
    for stat in ("median", "mean"):  # the equal split is one of the splits the best one is chosen from
        best = short["best_split"][stat]
        assert best["above_2pct"] <= short[stat]["above_2pct"] and sum(best["split"]) == 12 - 3


def test_the_oracle_says_how_many_steps_a_median_pick_needs() -> None:
    """``steps_needed``: without noise the fewest steps it tries; under the model's noise on the
    exclusive node (three candidates within 2.7 %) a median pick needs more steps than a mean
    pick, and at that budget the best split meets the 2 % p95 while one step fewer does not."""
    from bench.simulate._oracle import oracle_bound, steps_needed

    node = simulate.build_node("2s60c-smt2-8r-exclusive")
    space, _, caps = simulate.tuning_inputs(node, simulate.plan_node(node))
    threads_of = lambda c: simulate.capped(c, caps)  # noqa: E731
    quiet = NoiseModel(node_sigma=0.0, rank_sigma=0.0, spike_prob=0.0)
    assert steps_needed(node, space.candidates(), threads_of, noise=quiet, seeds=50) == 8
    by_median = steps_needed(node, space.candidates(), threads_of, seeds=300)
    by_mean = steps_needed(node, space.candidates(), threads_of, statistic="mean", seeds=300)
    assert by_median is not None and by_mean is not None and by_mean < by_median
    assert oracle_bound(node, space.candidates(), threads_of, steps=by_median, seeds=300)["best_split"]["median"][
        "p95"] <= 0.02
    assert oracle_bound(node, space.candidates(), threads_of, steps=by_median - 1, seeds=300)["best_split"][
        "median"]["p95"] > 0.02
    cyclic = simulate.build_node("2s60c-smt2-8r-cyclic")  # bound ranks cap 15 threads at 7-8: 15 runs as 8
    space, _, caps = simulate.tuning_inputs(cyclic, simulate.plan_node(cyclic))
    told = oracle_bound(cyclic, space.candidates(), lambda c: simulate.capped(c, caps), steps=12, seeds=20)
    assert len(told["contender_s"]) == 3 and told["contender_s"] == sorted(set(told["contender_s"]))
    with pytest.raises(ValueError, match="statistic='trimmed'"):
        steps_needed(node, space.candidates(), threads_of, statistic="trimmed")


def test_the_share_of_seeds_above_two_percent_carries_a_wilson_interval() -> None:
    """The report's "seeds above 2 %" interval: Wilson's (it never leaves [0, 1], holds the share,
    and narrows as seeds grow); 0 of 100 still admits up to 3.7 %."""
    low, high = simulate.wilson_interval(0, 100)
    assert low == 0.0 and high == pytest.approx(0.037, abs=0.001)
    low, high = simulate.wilson_interval(5, 100)
    assert low < 0.05 < high and low == pytest.approx(0.0215, abs=0.001) and high == pytest.approx(0.1118, abs=0.001)
    assert simulate.wilson_interval(10, 200)[1] - simulate.wilson_interval(10, 200)[0] < high - low


# --------------------------------------------------------------------------- load episodes and whole runs

CONTENDED = "1s16c-smt2-2r-contended"


def test_load_trace_is_seeded_episodic_and_prefix_stable() -> None:
    """The load is a function of (node, seed): the same trace every time, another for another seed;
    its episodes last tens to hundreds of steps; a shorter trace is the longer one's start (so a
    session that stops at lock-in sees the load of the same steps of a whole run)."""
    from bench.simulate._contention import Contention, load_trace

    c = Contention(episodes=((4.0,), (8.0,)))
    a = load_trace(c, CONTENDED, 3, 20_000)
    assert np.array_equal(a, load_trace(c, CONTENDED, 3, 20_000))
    assert not np.array_equal(a, load_trace(c, CONTENDED, 4, 20_000))
    assert not np.array_equal(a, load_trace(c, "another node", 3, 20_000))
    assert np.array_equal(load_trace(c, CONTENDED, 3, 150), a[:150])
    assert set(np.unique(a)) == {0, 1, 2}
    assert abs(np.mean(a > 0) - c.loaded_share) < 0.08
    starts = np.flatnonzero(np.diff((a > 0).astype(int)) == 1) + 1
    ends = np.flatnonzero(np.diff((a > 0).astype(int)) == -1) + 1
    lengths = [e - s for s, e in zip(starts, ends[ends > starts[0]])]
    assert 60 < np.mean(lengths) < 150  # geometric, mean 100
    with pytest.raises(ValueError, match="mean_episode_steps"):
        Contention(episodes=((1.0,),), mean_episode_steps=0.5)
    with pytest.raises(ValueError, match="same number of sockets"):
        Contention(episodes=((1.0,), (1.0, 2.0)))
    with pytest.raises(ValueError, match="sockets"):
        replace(simulate.build_node(SMALL), contention=Contention(episodes=((1.0, 1.0),)))


def test_an_episode_slows_a_team_by_how_far_it_exceeds_the_free_cores() -> None:
    """The VM's case (2 cores, 4 busy threads): 1 thread is only time-shared (2.5x), a 2-thread team
    also stalls in its barriers (6x). On the 16-core node under 8 busy threads, 2 ranks x 8 threads
    (16 > 8 free cores) slow down, 2 x 4 (fit) not at all, and no setting slows outside an episode."""
    from bench.simulate._contention import busy_core_ratio, team_slowdown

    vm = Node(name="vm", hardware=Hardware(sockets=1, cores_per_socket=2, smt=1, background_threads=0.0),
              masks=(frozenset(range(2)),), workload=Workload(params=1 << 24))
    for threads, factor in ((1, 2.5), (2, 6.0)):
        assert vm.kernel_rates([threads], load=(4,))[0][0] / vm.kernel_rates([threads])[0][0] == pytest.approx(factor)
    assert busy_core_ratio(4, 16, 8.0) == 1.0 and team_slowdown(1.0, 8, 4.0) == 1.0
    node, quiet_node = simulate.build_node(CONTENDED), simulate.build_node("1s16c-smt2-2r")
    chunk = 1 << 24
    for load in ((), (0.0,)):
        assert node.rank_times([8, 8], chunk, load=load) == quiet_node.rank_times([8, 8], chunk)
    quiet = {t: node.node_time([t, t], chunk) for t in (4, 8)}
    loaded = {t: node.node_time([t, t], chunk, load=(8,)) for t in (4, 8)}
    assert loaded[4] == quiet[4]
    assert quiet[8] < quiet[4] and loaded[8] > 3 * quiet[8] and loaded[8] > loaded[4]
    assert node.node_time([8, 8], chunk, load=(4,)) > 3 * quiet[8]  # 4 busy threads are enough against a full team
    with pytest.raises(ValueError, match="load"):
        node.node_time([8, 8], chunk, load=(1.0, 1.0))


def _contended_inputs(name: str = CONTENDED):
    node = simulate.build_node(name)
    space, baseline, caps = simulate.tuning_inputs(node, simulate.plan_node(node))
    return node, space, baseline, caps


def test_contended_truth_is_each_settings_mean_over_the_runs_load() -> None:
    """A candidate's truth in a contended run is the mean of its step times over the run's load
    trace (here against a step-by-step sum); the long-run table weights the levels by their share.
    The quiet best (8 threads a rank) is not the best under this load."""
    from bench.simulate._contention import load_trace
    from bench.simulate._truth import NodeTruth

    node, space, _, caps = _contended_inputs()
    truth = NodeTruth(node, space.candidates(), space.describe, lambda c: simulate.capped(c, caps))
    levels = node.contention.levels
    trace = load_trace(node.contention, node.name, 5, 400)
    of_seed = truth.of_seed(5, 400)
    for c in space.candidates()[::3]:
        steps = [node.node_time(simulate.capped(c, caps), int(c["chunk_numel"]), load=levels[k]) for k in trace]
        assert of_seed[space.describe(c)] == pytest.approx(sum(steps) / len(steps), rel=1e-12)
    quiet_best = min(truth.quiet, key=truth.quiet.get)
    assert quiet_best.startswith("threads=8") and min(truth.expected, key=truth.expected.get).startswith("threads=4")
    weights = node.contention.level_weights
    assert sum(weights) == pytest.approx(1.0) and truth.expected[quiet_best] == pytest.approx(
        sum(w * node.node_time([8, 8], int(quiet_best.split("=")[-1]), load=lv) for w, lv in zip(weights, levels)))


def test_whole_run_regret_is_zero_with_one_candidate() -> None:
    from autotune import Knob as _Knob
    from bench.simulate._session import Caps
    from bench.simulate._truth import NodeTruth, whole_run_row

    node, _, _, _ = _contended_inputs()
    space = SearchSpace((_Knob("threads", (4,)), _Knob("chunk_numel", (1 << 24,))))
    caps = Caps(own=(8, 8), bound=(8, 8))
    out = simulate.run_seed(node, space, {"threads": 4, "chunk_numel": 1 << 24}, caps, seed=1, steps=300)
    truth = NodeTruth(node, space.candidates(), space.describe, lambda c: simulate.capped(c, caps))
    row = whole_run_row(truth, out, space.describe(out["winner"]), truth.of_seed(1, 300), 300)
    assert row["regret"] == pytest.approx(0.0, abs=1e-12) and row["stay_regret"] == pytest.approx(0.0, abs=1e-12)
    assert row["lock_step"] == 0 and row["steps_by_state"] == {"locked": 300} and row["switches_after_lock"] == 0


_FIRST = {"threads": 8, "chunk_numel": 1 << 24}
_SECOND = {"threads": 4, "chunk_numel": 1 << 24}


class _ScriptedTuner:
    """OnlineTuner's interface with a fixed script: 3 probing steps of the static plan, lock-in on
    ``_FIRST``, then (as a post-lock watch may) a switch to ``_SECOND`` applied after step 100."""

    def __init__(self, space, *, baseline, apply, **_):
        self._apply, self._baseline, self.state, self._steps, self.current = apply, baseline, "new", 0, {}

    def _set(self, setting):
        self.current = dict(setting)
        self._apply(dict(setting))

    def start(self):
        self.state = "probing"
        self._set(self._baseline)

    def observe(self, sample):
        self._steps += 1
        if self._steps == 3:
            self.state = "locked"
            self._set(_FIRST)
        elif self._steps == 100:
            self.state = "watching"
            self._set(_SECOND)

    def summary(self):
        return {"winner": _FIRST, "state": self.state, "kept_baseline": False, "probe_steps": 3,
                "sampler": "scripted", "reason": "scripted", "measurements": []}

    def close(self):
        pass


def test_whole_run_pays_for_every_step_the_tuner_runs_after_lock_in() -> None:
    """A run is priced step by step as it ran: a setting applied after lock-in (here by a scripted
    tuner) is paid from the next step on, its first step with the warm-up penalty; the regret is
    against the best fixed setting over the same load, and 'had it stayed' keeps the first winner."""
    from bench.simulate._contention import load_trace
    from bench.simulate._truth import NodeTruth, whole_run_row

    node, space, baseline, caps = _contended_inputs()
    horizon, seed = 400, 2
    out = simulate.run_seed(node, space, baseline, caps, seed, steps=horizon, tuner_class=_ScriptedTuner)
    rec = out["whole_run"]
    levels = [node.contention.levels[k] for k in load_trace(node.contention, node.name, seed, horizon)]

    def t(setting, step):
        return node.node_time(simulate.capped(setting, caps), setting["chunk_numel"], load=levels[step])

    warm = 1 + NoiseModel().warmup_penalty
    expected = [t(baseline, s) for s in range(3)] + [t(_FIRST, 3) * warm] + [t(_FIRST, s) for s in range(4, 100)] \
        + [t(_SECOND, 100) * warm] + [t(_SECOND, s) for s in range(101, horizon)]
    assert rec["costs"] == pytest.approx(expected, rel=1e-12)
    assert rec["lock_step"] == 3 and rec["switches_after_lock"] == 1 and rec["final"] == _SECOND
    truth = NodeTruth(node, space.candidates(), space.describe, lambda c: simulate.capped(c, caps))
    seed_truth = truth.of_seed(seed, horizon)
    row = whole_run_row(truth, out, space.describe(_FIRST), seed_truth, horizon)
    best = horizon * min(seed_truth.values())
    assert row["regret"] == pytest.approx(sum(expected) / best - 1, rel=1e-9)
    stayed = sum(expected[:4]) + sum(t(_FIRST, s) for s in range(4, horizon))
    assert row["stay_regret"] == pytest.approx(stayed / best - 1, rel=1e-9)
    assert row["steps_by_state"] == {"probing": 3, "locked": 97, "watching": 300}


def test_a_whole_run_session_decides_as_a_lock_in_session() -> None:
    """Running on past lock-in changes nothing up to it: the same noise and load per step."""
    node, space, baseline, caps = _contended_inputs()
    keys = ("winner", "probe_steps", "reason", "measured", "probe_true_s")
    for seed in (0, 1):
        short = simulate.run_seed(node, space, baseline, caps, seed)
        whole = simulate.run_seed(node, space, baseline, caps, seed, steps=200)
        assert {k: short[k] for k in keys} == {k: whole[k] for k in keys}
        assert len(whole["whole_run"]["costs"]) == 200 and "whole_run" not in short


def test_contended_simulation_reports_whole_run_regret(tmp_path) -> None:
    rc = simulate.main(["--quick", "--seeds", "2", "--whole-run-seeds", "1", "--horizon", "120",
                        "--nodes", f"{CONTENDED},{SMALL}", "--out-dir", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "simulated_nodes.json").read_text())
    contended, small = data["nodes"]
    assert contended["contention"] is not None and contended["oracle"] is None and contended["quiet_s"]
    assert small["contention"] is None and small["quiet_s"] is None and small["oracle"] is not None
    node, space, _, caps = _contended_inputs()
    from bench.simulate._truth import NodeTruth

    truth = NodeTruth(node, space.candidates(), space.describe, lambda c: simulate.capped(c, caps))
    for r in contended["runs"]:  # against the means over the run's own load, not the quiet times
        of_seed = truth.of_seed(r["seed"], 120)
        key = space.describe(r["winner"])
        assert r["regret"] == pytest.approx(of_seed[key] / min(of_seed.values()) - 1)
    for n in data["nodes"]:
        w = n["whole_run"]
        assert w["seeds"] == 1 and w["horizon"] == 120
        assert "whole_run" in n["runs"][0] and "whole_run" not in n["runs"][1]
        assert sum(n["runs"][0]["whole_run"]["steps_by_state"].values()) == 120
        assert w["regret"]["median"] >= -1e-9
    md = (tmp_path / "simulated_nodes.md").read_text()
    assert "whole-run regret" in md and "quiet s" in md and "Load episodes" in md


@pytest.mark.parametrize("argv, message", [(["--horizon", "40"], "--horizon"),
                                           (["--whole-run-seeds", "-1"], "--whole-run-seeds")])
def test_whole_run_options_are_checked(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        simulate.main(["--quick", *argv])
    assert message in capsys.readouterr().err


# --- the watch follows a load change (issue 36: "the watch follows a simulated load change") ----

def _follow_record(settings: list[str], measuring: list[bool], costs: list[float]) -> dict:
    return {"states": ["probing"] + ["locked"] * (len(settings) - 1), "measuring": measuring,
            "settings": settings, "costs": costs, "switches_after_lock": 1}


def test_follow_row_counts_the_steps_to_the_new_best_and_the_watchs_cost() -> None:
    from bench.simulate._truth import follow_row

    # Two settings; at level 0 "a" runs 1.0 and "b" 2.0, at level 1 "a" 4.0 and "b" 1.0. The run
    # changes to level 1 at step 3, a watch round measures "b" at steps 4-5, the run follows "b"
    # from step 6 on.
    truth = type("T", (), {"keys": ["a", "b"], "per_level": np.array([[1.0, 4.0], [2.0, 1.0]])})()
    levels = [0, 0, 0, 1, 1, 1, 1, 1]
    settings = ["a", "a", "a", "a", "b", "a", "b", "b"]
    measuring = [True, False, False, False, True, True, False, False]
    costs = [1.0, 1.0, 1.0, 4.0, 1.0, 4.0, 1.0, 1.0]
    row = follow_row(truth, _follow_record(settings, measuring, costs), levels, change_at=3)
    assert row["regret_at_change"] == pytest.approx(3.0) and row["follow_steps"] == 3
    assert row["final"] == "b" and row["final_regret"] == 0.0
    # The watch's two steps ran 1.0 and 4.0 where the followed "a" would have run 4.0 each: -3.0
    # over the 7 locked steps' 13.0.
    assert row["watch_cost"] == pytest.approx(-3.0 / 13.0)
    # A run that never gets within FOLLOW_TOLERANCE says so.
    stuck = follow_row(truth, _follow_record(["a"] * 8, [True] + [False] * 7, [1.0] * 8), levels, change_at=3)
    assert stuck["follow_steps"] is None and stuck["final_regret"] == pytest.approx(3.0)


def test_the_watch_follows_a_load_that_starts_to_the_lighter_setting() -> None:
    # The contended 2-rank node, quiet then loaded from step 500: 8 threads per rank lose 4.4x, 4
    # threads (the lighter setting, neither the runner-up nor the static plan) win; and the reverse.
    out = simulate.follow_change(simulate.CHANGE_NODE, 2, horizon=1500)
    starts, leaves = out["changes"]
    assert starts["best_before"].startswith("threads=8") and starts["best_after"].startswith("threads=4")
    s = starts["summary"]
    assert s["followed"] == 2 and s["final_regret"]["max"] <= 0.05 and s["regret_at_change_median"] > 3
    assert leaves["best_after"] == starts["best_before"]
    for c in (starts, leaves):
        for row in c["rows"]:
            assert row["watch_cost"] <= 0.01  # its bound is 0.5 % of the measured steps; this is the true cost
    with pytest.raises(ValueError, match="expected a contended node"):
        simulate.follow_change(NUMA, 1)
