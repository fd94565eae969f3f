"""Tuner logic with fake step times (single process): search, budget, lock-in, cache."""

from __future__ import annotations

import dataclasses
import doctest
import itertools
import logging
import math
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import pytest

from autotune import (
    AutotuneConfig,
    Knob,
    Measurement,
    OnlineTuner,
    SearchSpace,
    StepSample,
    geometric_ladder,
    powers_of_two,
)
from autotune.measure import _measurement, _paired, _space
from autotune.measure._measurement import gain_threshold, significantly_faster
from autotune.decide._decide import LEAN_ROUNDS, choose, decide_paired
from autotune.decide._probe import plan_budget

THREADS = (1, 2, 4, 8)
CHUNKS = (1 << 20, 1 << 21, 1 << 22)
BASELINE = {"threads": 8, "chunk_numel": 1 << 20}


def make_space(threads: tuple[int, ...] = THREADS, chunks: tuple[int, ...] = CHUNKS) -> SearchSpace:
    return SearchSpace((Knob("threads", threads), Knob("chunk_numel", chunks, prefer="high")))


Cost = Callable[[dict[str, Any]], float]


class Client:
    """Stands in for the optimizer: applies settings and reports fake step times for them."""

    def __init__(self, cost: Cost, *, noise: float = 0.0, seed: int = 0, switch_penalty: float = 0.0) -> None:
        self.cost = cost
        self.noise = noise
        self.rng = random.Random(seed)
        self.switch_penalty = switch_penalty
        self.current: dict[str, Any] | None = None
        self.applied: list[tuple[int, dict[str, Any]]] = []
        self.states: list[str] = []
        self.steps = 0
        self._switched = False

    def apply(self, setting: dict[str, Any]) -> None:
        self.applied.append((self.steps, dict(setting)))
        self.current = dict(setting)
        self._switched = True

    def run(self, tuner: OnlineTuner, steps: int, *, until_locked: bool = False) -> None:
        for _ in range(steps):
            assert self.current is not None
            t = self.cost(self.current) * (1.0 + self.rng.gauss(0.0, self.noise)) if self.noise else self.cost(self.current)
            if self._switched:
                t += self.switch_penalty
                self._switched = False
            self.states.append(tuner.state)
            self.steps += 1
            tuner.observe(StepSample(time_s=max(t, 0.0), stages={"step_s": t}, spans=(("adam_kernel", 0, 0.0, t),)))
            if until_locked and tuner.state == "locked":
                return


class FakeCache:
    def __init__(self, entries: dict[str, Any] | None = None) -> None:
        self.entries = dict(entries or {})
        self.puts: list[tuple[str, dict[str, Any]]] = []

    def get(self, key: str) -> Any:
        return self.entries.get(key)

    def put(self, key: str, entry: dict[str, Any]) -> None:
        self.puts.append((key, entry))
        self.entries[key] = entry


class FakeTrace:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.spans: list[tuple[int, int, Any]] = []
        self.summaries: list[dict[str, Any]] = []

    def add_step(self, row: dict[str, Any]) -> None:
        self.rows.append(row)

    def add_spans(self, rank: int, step: int, spans: Any) -> None:
        self.spans.append((rank, step, spans))

    def write_summary(self, summary: dict[str, Any]) -> None:
        self.summaries.append(summary)


def fake_fingerprint(*, workload: Any, space: SearchSpace, local_world_size: int) -> Any:
    return SimpleNamespace(key=f"key-{space.digest()}-{local_world_size}", details={"space": space.to_dict()})


def make_tuner(client: Client, *, space: SearchSpace | None = None, baseline: dict[str, Any] | None = None,
               **kwargs: Any) -> OnlineTuner:
    config = kwargs.pop("config", AutotuneConfig())
    tuner = OnlineTuner(space or make_space(), baseline=baseline or BASELINE, apply=client.apply, config=config,
                        workload={"params": 1000}, clock=itertools.count().__next__,
                        fingerprint=fake_fingerprint, **kwargs)
    tuner.start()
    return tuner


def valley(best: dict[str, Any], *, gap: float = 0.3) -> Cost:
    """1.0 at ``best``; every knob step away (in ladder position) costs ``gap`` more."""
    space = make_space()

    def cost(setting: dict[str, Any]) -> float:
        return 1.0 + gap * sum(
            abs(knob.values.index(setting[knob.name]) - knob.values.index(best[knob.name])) for knob in space.knobs
        )

    return cost


def table(values: dict[tuple[int, int], float], default: float = 2.0) -> Cost:
    return lambda s: values.get((s["threads"], s["chunk_numel"]), default)


# --- search space ---------------------------------------------------------------------------


def test_space_doctests_pass():
    for module in (_space, _measurement, _paired):
        assert doctest.testmod(module).failed == 0


def test_geometric_ladder_keeps_bounds_and_the_plan_value():
    assert geometric_ladder(1, 30, include=(12,)) == (1, 2, 4, 8, 12, 16, 30)
    assert geometric_ladder(1, 1) == (1,)
    thinned = geometric_ladder(1, 64, include=(24,), max_count=5)
    assert len(thinned) == 5 and {1, 24, 64} <= set(thinned)
    with pytest.raises(ValueError, match="outside"):
        geometric_ladder(1, 8, include=(9,))
    with pytest.raises(ValueError, match="max_count"):
        geometric_ladder(1, 64, include=(3, 24), max_count=3)
    with pytest.raises(ValueError, match="hi"):
        geometric_ladder(4, 2)


def test_powers_of_two_between_bounds_capped_by_count():
    assert powers_of_two(1 << 20, (1 << 22) + 5) == (1 << 20, 1 << 21, 1 << 22)
    assert powers_of_two(3, 3) == ()
    capped = powers_of_two(1 << 20, 1 << 30, max_count=4)
    assert len(capped) == 4 and capped[0] == 1 << 20 and capped[-1] == 1 << 30
    assert powers_of_two(1, 8, max_count=1) == (8,)
    with pytest.raises(ValueError, match="max_count"):
        powers_of_two(1, 8, max_count=0)


def test_space_membership_is_type_strict_and_digest_is_stable():
    space = make_space()
    assert len(space) == 12 and len(space.candidates()) == 12
    assert space.contains({"threads": 2, "chunk_numel": 1 << 21})
    for bad in ({"threads": 16, "chunk_numel": 1 << 20}, {"threads": "2", "chunk_numel": 1 << 20},
                {"threads": True, "chunk_numel": 1 << 20}, {"threads": 2.0, "chunk_numel": 1 << 20},
                {"threads": 2}, {"threads": 2, "chunk_numel": 1 << 20, "x": 1}, [2, 1 << 20], None):
        assert not space.contains(bad), bad
        assert space.why_not(bad)
    shuffled = SearchSpace((Knob("threads", (8, 1, 4, 2)), Knob("chunk_numel", CHUNKS[::-1], prefer="high")))
    assert shuffled == space and shuffled.digest() == space.digest()
    assert SearchSpace.from_dict(space.to_dict()) == space
    assert space.preference({"threads": 1, "chunk_numel": 1 << 22}) < space.preference({"threads": 1, "chunk_numel": 1 << 20})
    for knobs, match in ((((Knob("a", (1,)), Knob("a", (2,)))), "duplicates"), ((), "at least one")):
        with pytest.raises(ValueError, match=match):
            SearchSpace(knobs)
    with pytest.raises(ValueError, match="one type per knob"):
        Knob("threads", (1, 2.0))
    with pytest.raises(ValueError, match="duplicates"):
        Knob("threads", (1, 1))


# --- measurement and the lock-in rule -------------------------------------------------------


def test_measurement_statistics_match_numpy():
    rng = random.Random(3)
    for n in (1, 2, 5, 8):
        samples = [rng.uniform(0.5, 1.5) for _ in range(n)]
        m = Measurement(samples)
        q25, q50, q75 = np.quantile(samples, [0.25, 0.5, 0.75])
        assert m.n == n and m.median == pytest.approx(q50) and m.iqr == pytest.approx(q75 - q25)
    assert "median" in str(Measurement([1.0, 1.1], "x")) and "n=2" in str(Measurement([1.0, 1.1]))
    for bad in ([], [float("nan")], [-1.0], [True], "1"):
        with pytest.raises(ValueError):
            Measurement(bad)


def test_gain_must_beat_noise_and_minimum_margin():
    base = Measurement([1.0, 1.0, 1.0])
    assert significantly_faster(Measurement([0.9, 0.9, 0.9]), base)
    assert not significantly_faster(Measurement([0.993, 0.993, 0.993]), base)  # under min_gain (1 %)
    noisy = Measurement([0.6, 0.9, 1.2])  # 10 % faster median, but IQR 0.3
    se = _measurement.MEDIAN_SE_PER_IQR * 0.3 / math.sqrt(3)  # standard error of its median
    assert gain_threshold(base, noisy) == pytest.approx(_measurement.NOISE_FACTOR * se)
    assert not significantly_faster(noisy, base)
    # The same spread over more samples pins the median down better: the noise term shrinks.
    assert gain_threshold(base, Measurement([0.6, 0.9, 1.2] * 4)) < gain_threshold(base, noisy)
    assert significantly_faster(Measurement([0.8, 0.9, 1.0] * 6), base)


def test_unpaired_rule_never_filters_a_candidates_own_slow_samples():
    # Without finals (finalists < 2) the rule compares unfiltered medians: a candidate fast once
    # in five (its lucky sample) is slow, and a candidate slow in two of five is judged on them.
    space, config = make_space(), AutotuneConfig()
    base = space.key(BASELINE)
    ms = {base: Measurement([1.0, 1.01, 0.99, 1.0, 1.02]), (4, 1 << 22): Measurement([0.3, 5.0, 4.8, 5.1, 4.9])}
    assert choose(space, base, ms, config)[0] == base
    ms[(4, 1 << 22)] = Measurement([0.90, 1.80, 0.91, 1.85, 0.90])  # 10 % faster 3 times in 5, 80 % slower twice
    assert choose(space, base, ms, config)[0] == base
    # Do-no-harm: a gain under min_gain (1 %) never replaces the static plan.
    ms[(4, 1 << 22)] = Measurement([0.993] * 5)
    assert choose(space, base, ms, config)[0] == base
    ms[(4, 1 << 22)] = Measurement([0.9] * 5)
    assert choose(space, base, ms, config)[0] == (4, 1 << 22)


def test_choose_breaks_ties_deterministically():
    space, config = make_space(), AutotuneConfig()
    base = space.key(BASELINE)
    fast = Measurement([0.5, 0.5, 0.5])
    ms = {base: Measurement([1.0] * 3), (4, 1 << 22): fast, (2, 1 << 21): fast, (2, 1 << 22): fast}
    assert choose(space, base, ms, config)[0] == (2, 1 << 22)  # fewer threads, then larger chunk
    ms[base] = Measurement([0.501, 0.501, 0.501])
    winner, reason = choose(space, base, ms, config)
    assert winner == base and "as fast as" in reason  # the static plan stays when tied


# --- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"probe_steps": 0}, "probe_steps"), ({"warmup_steps": -1}, "warmup_steps"),
    ({"measure_steps": 0}, "measure_steps"), ({"min_gain": math.nan}, "min_gain"),
    ({"timeout_s": 0}, "timeout_s"), ({"watch_cost": 0.0}, "watch_cost"),
    ({"watch_cost": 0.9}, "watch_cost"), ({"recheck_rounds": 0}, "recheck_rounds"), ({"watch": 1}, "watch"),
    ({"force_retune": "yes"}, "force_retune"), ({"probe_steps": 7}, "probe_steps"),
    ({"tie_tolerance": 0.05}, "tie_tolerance"), ({"seed": 1.5}, "seed"),
])
def test_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"AutotuneConfig.{field}="):
        AutotuneConfig(**kwargs)


def test_config_accepts_path_objects_and_stores_str(tmp_path: Path) -> None:
    config = AutotuneConfig(cache_path=tmp_path / "c.json", trace_dir=tmp_path / "trace")
    assert config.cache_path == str(tmp_path / "c.json") and isinstance(config.cache_path, str)
    assert config.trace_dir == str(tmp_path / "trace") and isinstance(config.trace_dir, str)
    assert config == AutotuneConfig(cache_path=str(tmp_path / "c.json"), trace_dir=str(tmp_path / "trace"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache_path = "other.json"  # type: ignore[misc]
    assert dataclasses.replace(config, trace_dir=Path("t")).trace_dir == "t"


@pytest.mark.parametrize("bad", ["", b"c.json", 3])
def test_config_refuses_other_paths(bad: object) -> None:
    with pytest.raises(ValueError, match="AutotuneConfig.cache_path=.*os.PathLike"):
        AutotuneConfig(cache_path=bad)  # type: ignore[arg-type]


def test_inputs_are_validated():
    client = Client(valley(BASELINE))
    with pytest.raises(ValueError, match="baseline"):
        OnlineTuner(make_space(), baseline={"threads": 16, "chunk_numel": 1 << 20}, apply=client.apply)
    tuner = OnlineTuner(make_space(), baseline=BASELINE, apply=client.apply)
    with pytest.raises(RuntimeError, match="before start"):
        tuner.observe(StepSample(time_s=1.0))
    for bad in (math.nan, -1.0, "1", True):
        with pytest.raises(ValueError, match="time_s"):
            StepSample(time_s=bad)


# --- search ---------------------------------------------------------------------------------


def test_certain_winner_found_with_grid_and_settings_change_only_between_steps():
    best = {"threads": 4, "chunk_numel": 1 << 22}
    client = Client(valley(best))
    tuner = make_tuner(client, config=AutotuneConfig(probe_steps=80))
    assert client.applied == [(0, BASELINE)]  # start() applies the static plan
    client.run(tuner, 100)
    s = tuner.summary()
    assert s["state"] == "locked" and s["sampler"] == "grid" and s["winner"] == best
    assert s["speedup"] == pytest.approx(valley(best)(BASELINE) / 1.0)
    # 12 candidates x (1 warm-up + 3) (exploring: paired round 0), two paired rounds of 3
    # finalists (the second starts with the arm that ended the first: no warm-up), then one duel
    # round of the best and the static plan: a switch needs 4 rounds.
    assert s["probe_steps"] == 12 * 4 + (3 * 2 + 5) + 4 <= 80
    assert len(s["measurements"]) == 12  # every candidate measured once
    assert s["measurements"][0]["candidate"] == BASELINE  # the static plan first
    # One apply per change of setting, none after lock-in; the step after the last probe runs the winner.
    settings = [setting for _, setting in client.applied]
    assert all(a != b for a, b in itertools.pairwise(settings))
    assert client.applied[-1] == (s["probe_steps"], best)
    assert client.states[s["probe_steps"]:] == ["locked"] * (100 - s["probe_steps"])


def test_warmup_steps_are_discarded():
    best = {"threads": 2, "chunk_numel": 1 << 21}
    client = Client(valley(best), switch_penalty=50.0)  # the first step after any switch is very slow
    tuner = make_tuner(client, config=AutotuneConfig(probe_steps=80))
    client.run(tuner, 80)
    s = tuner.summary()
    assert s["winner"] == best
    assert all(sample < 50.0 for m in s["measurements"] for sample in m["samples"])


def test_finalists_are_remeasured_interleaved():
    client = Client(valley({"threads": 4, "chunk_numel": 1 << 22}))
    trace = FakeTrace()
    tuner = make_tuner(client, config=AutotuneConfig(probe_steps=80, final_rounds=2), trace=trace)
    client.run(tuner, 80)
    finals = [(row["phase"], tuner.space.key(row["candidate"])) for row in trace.rows if row["phase"].startswith("final")]
    finalists = [tuner.space.key(c) for c in tuner.summary()["finalists"]]
    assert finalists[0] == tuner.space.key(BASELINE) and len(set(finalists)) == 3
    # Exploring was round 0 (P first, the finalists in the order explored); the finals reverse it,
    # then alternate (b a P | P a b); a visit that continues the arm already running needs no
    # warm-up. Then one duel round of the winner and P (reversed again): a switch needs 4 rounds.
    p, a, b = finalists
    expected = [("final_warmup", b), ("final", b), ("final_warmup", a), ("final", a), ("final_warmup", p),
                ("final", p), ("final", p), ("final_warmup", a), ("final", a), ("final_warmup", b), ("final", b)]
    assert finals[:11] == expected
    winner = tuner.space.key(tuner.summary()["winner"])
    assert [key for phase, key in finals[11:] if phase == "final"] == [winner, p]
    rounds = next(r for r in tuner.summary()["paired"] if tuner.space.key(r["candidate"]) == winner)["rounds"]
    assert rounds == 4 and next(
        m for m in tuner.summary()["measurements"] if tuner.space.key(m["candidate"]) == winner
    )["n"] == 3 + 3


@pytest.mark.parametrize("seed", range(4))
def test_noise_still_picks_the_right_winner(seed):
    best = {"threads": 2, "chunk_numel": 1 << 22}
    costs = {(2, 1 << 22): 0.80, (4, 1 << 22): 0.94, (2, 1 << 21): 0.95}
    client = Client(table(costs, default=1.2), noise=0.03, seed=seed)
    tuner = make_tuner(client, config=AutotuneConfig(probe_steps=80, seed=seed))
    client.run(tuner, 80)
    assert tuner.summary()["winner"] == best


@pytest.mark.parametrize("seed", range(2))
def test_ties_break_to_fewer_threads_then_larger_chunks(seed):
    fast = 0.5
    costs = {(2, 1 << 21): fast, (2, 1 << 22): fast, (4, 1 << 22): fast, (8, 1 << 20): 1.0}
    client = Client(table(costs, default=0.9))
    tuner = make_tuner(client, config=AutotuneConfig(probe_steps=80, seed=seed))
    client.run(tuner, 80)
    assert tuner.summary()["winner"] == {"threads": 2, "chunk_numel": 1 << 22}


def test_do_no_harm_keeps_the_static_plan_for_a_gain_under_min_gain(caplog):
    costs = {(8, 1 << 20): 1.0, (4, 1 << 21): 0.993}  # 0.7 %: above the tie tolerance, under min_gain (1 %)
    client = Client(table(costs, default=1.3))
    with caplog.at_level(logging.INFO, logger="autotune"):
        tuner = make_tuner(client, config=AutotuneConfig(probe_steps=80))
        client.run(tuner, 80)
    s = tuner.summary()
    assert s["state"] == "locked" and s["winner"] == BASELINE and s["kept_baseline"] is True
    assert "not clearly faster" in s["reason"]
    assert client.current == BASELINE
    text = caplog.text
    assert "candidate 12 of 12" in text and "locked in threads=8 chunk_numel=1048576 (the static plan)" in text
    assert s["probe_steps"] == 12 * 4 + 3 * 2 + 5  # noise-free: no duel, the gain cannot reach 1 %


def test_undecided_finals_are_settled_by_a_duel_with_the_static_plan():
    # Beyond the grid, 8 % faster under 3 % noise: exploring (round 0) and the two planned rounds
    # of finals do not yet make it clearly faster on this seed, so the fastest finalist and the
    # static plan get duel rounds (the budget reserves one), and the winner is then clearly faster.
    space = make_space(threads=(1, 2, 4, 8, 16), chunks=(1 << 20, 1 << 22, 1 << 25, 1 << 30))
    baseline, best = {"threads": 16, "chunk_numel": 1 << 22}, {"threads": 8, "chunk_numel": 1 << 22}
    client = Client(lambda s: 0.92 if s == best else 1.0 if s["threads"] == 16 else 1.3, noise=0.03, seed=1)
    trace = FakeTrace()
    tuner = make_tuner(client, space=space, baseline=baseline, config=AutotuneConfig(seed=1), trace=trace)
    client.run(tuner, 60)
    s = tuner.summary()
    plan = plan_budget(len(space), AutotuneConfig())
    assert s["sampler"] == "tpe" and plan.duel_rounds >= 1 and s["winner"] == best and s["probe_steps"] <= 40
    finals = [(r["phase"], tuner.space.key(r["candidate"])) for r in trace.rows if r["phase"].startswith("final")]
    measured = [key for phase, key in finals if phase == "final"]
    duel = measured[plan.finalists * plan.final_rounds:]  # after the one planned round of every finalist
    assert duel and set(duel) == {(16, 1 << 22), (8, 1 << 22)}
    assert duel.count((16, 1 << 22)) == duel.count((8, 1 << 22)) >= 1  # one visit each per round
    # A grid never duels (it probes exactly its planned steps): see the do-no-harm case above.


@pytest.mark.parametrize("period,offset", [(16, 0), (16, 8), (20, 4), (24, 10)])
def test_a_lighter_challenger_faster_on_the_mean_in_a_minority_of_rounds_gets_the_rounds_a_lean_needs(
        period: int, offset: int) -> None:
    # Stock AdamW's space (1 or 2 threads, the plan 2): 2 threads run 0.9 a step and 6.0 in a
    # burst of 4 steps every `period`, 2.1 on the mean, 1 thread 1.0. After the planned rounds 1
    # thread is faster on the mean but in fewer than half of the rounds (the bursts hit a few):
    # the duel used to end there and keep 2 threads (in all 30 phases of periods 16, 20 and 24;
    # now 11, those whose rounds no burst hit, so that 2 threads look faster). It goes on while
    # the budget allows, and the lean to the lighter setting decides.
    space = make_space(threads=(1, 2), chunks=(1 << 22,))
    plan = {"threads": 2, "chunk_numel": 1 << 22}

    def cost(setting: dict[str, Any]) -> float:
        if setting["threads"] == 1:
            return 1.0
        return 6.0 if (client.steps + offset) % period < 4 else 0.9

    client = Client(cost, noise=0.02, seed=offset)
    tuner = make_tuner(client, space=space, baseline=plan, config=AutotuneConfig(probe_steps=40))
    client.run(tuner, 40, until_locked=True)
    s = tuner.summary()
    assert s["winner"] == {"threads": 1, "chunk_numel": 1 << 22}, s["reason"]
    assert s["probe_steps"] <= 40


def test_budget_plan_never_exceeds_the_budget():
    for n, probe, warm, k, fin, rounds in itertools.product(
        range(1, 40, 3), (8, 13, 40, 64), (0, 1, 2), (1, 3), (0, 2, 3, 5), (0, 1, 2)
    ):
        if probe < 2 * (warm + k):
            continue
        config = AutotuneConfig(probe_steps=probe, warmup_steps=warm, measure_steps=k, finalists=fin,
                                final_rounds=rounds, min_gain=0.03)
        plan = plan_budget(n, config)
        assert plan.steps <= probe, (n, config, plan)
        assert plan.sampler == ("none" if n == 1 else "grid" if plan.explore == n else "tpe")


def test_budget_never_exceeded_over_random_spaces():
    rng = random.Random(11)
    samplers = set()
    for case in range(24):
        knobs = tuple(
            Knob(f"k{i}", tuple(sorted(rng.sample(range(1, 50), rng.randint(1, 5)))), prefer=rng.choice(("low", "high")))
            for i in range(rng.randint(1, 3))
        )
        space = SearchSpace(knobs)
        warm, k = rng.randint(0, 2), rng.randint(1, 4)
        config = AutotuneConfig(probe_steps=rng.randint(2 * (warm + k), 50), warmup_steps=warm, measure_steps=k,
                                finalists=rng.randint(0, 4), final_rounds=rng.randint(0, 2), seed=case)
        weights = {knob.name: rng.uniform(-1, 1) for knob in knobs}
        baseline = {knob.name: rng.choice(knob.values) for knob in knobs}
        client = Client(lambda s, w=weights: 2.0 + sum(w[n] * math.log(v) for n, v in s.items()) / 10, noise=0.05,
                        seed=case)
        tuner = make_tuner(client, space=space, baseline=baseline, config=config)
        client.run(tuner, config.probe_steps + 5)
        s = tuner.summary()
        assert s["state"] == "locked", (case, s)
        assert s["probe_steps"] == client.states.count("probing") <= config.probe_steps, (case, config, s)
        assert space.contains(s["winner"]) and all(space.contains(a) for _, a in client.applied)
        samplers.add(s["sampler"])
    assert {"grid", "tpe"} <= samplers


def test_tpe_drives_a_space_too_big_for_the_budget():
    space = make_space(threads=(1, 2, 3, 4, 6, 8, 12, 16), chunks=tuple(1 << p for p in range(18, 24)))
    baseline = {"threads": 16, "chunk_numel": 1 << 18}
    client = Client(lambda s: 1.0 + abs(math.log2(s["threads"] / 6)) * 0.2 + abs(math.log2(s["chunk_numel"]) - 22) * 0.05)
    tuner = make_tuner(client, space=space, baseline=baseline)
    client.run(tuner, 60)
    s = tuner.summary()
    plan = plan_budget(len(space), AutotuneConfig())
    assert s["sampler"] == plan.sampler == "tpe" and len(space) == 48
    assert len(s["measurements"]) >= plan.explore and s["probe_steps"] <= 40
    assert s["measurements"][0]["candidate"] == baseline
    assert s["winner"] != baseline and s["winner_median_s"] < s["baseline_median_s"]


def _separable(threads_best: int, chunk_best: int) -> Cost:
    """A node-like cost: each knob's rung distance from its best costs, both knobs add up."""
    def cost(s: dict[str, Any]) -> float:
        return 1.0 + 0.06 * abs(math.log2(s["threads"] / threads_best)) + 0.03 * abs(
            math.log2(s["chunk_numel"] / chunk_best))
    return cost


def test_beyond_the_grid_a_coordinate_sweep_finds_a_best_that_needs_both_knobs():
    space = make_space(threads=(1, 2, 4, 8, 16), chunks=(1 << 20, 1 << 22, 1 << 25, 1 << 30))
    baseline = {"threads": 16, "chunk_numel": 1 << 22}
    best = {"threads": 8, "chunk_numel": 1 << 25}  # 6 + 3 = 9 % faster than the static plan
    client = Client(_separable(8, 1 << 25))
    trace = FakeTrace()
    tuner = make_tuner(client, space=space, baseline=baseline, trace=trace)
    client.run(tuner, 60)
    s = tuner.summary()
    assert s["sampler"] == "tpe" and s["winner"] == best and s["probe_steps"] <= 40
    order = [(m["candidate"]["threads"], m["candidate"]["chunk_numel"]) for m in s["measurements"]]
    # The static plan, the thread ladder down from it at the static chunk until it stops improving,
    # then the chunk ladder at the best thread count (larger chunks first: the preferred side).
    assert order[:5] == [(16, 1 << 22), (8, 1 << 22), (4, 1 << 22), (8, 1 << 25), (8, 1 << 30)]
    # A clearly slower candidate is dropped after two measured steps; the static plan never is.
    n = {(m["candidate"]["threads"], m["candidate"]["chunk_numel"]): m["n"] for m in s["measurements"]}
    assert n[(4, 1 << 22)] == 2 and n[(16, 1 << 22)] >= 3


def test_two_stalls_in_a_row_do_not_stop_a_candidate_but_a_slow_one_stops_after_a_third_sample():
    """Early stopping beyond the grid: a candidate whose first two measured steps both stalled
    (2x, as one rank's stall stalls a node's step) looks twice as slow; it gets a third sample,
    which shows it is the fastest thread count, and the sweep goes on from it. A truly 2x slower
    candidate stops after that third sample; one 10 % slower after two, as before."""
    space = make_space(threads=(1, 2, 4, 8, 16), chunks=(1 << 20, 1 << 22, 1 << 25, 1 << 30))
    baseline = {"threads": 16, "chunk_numel": 1 << 22}
    separable = _separable(8, 1 << 25)
    calls: dict[tuple[int, int], int] = {}

    def cost(s: dict[str, Any]) -> float:
        key = (s["threads"], s["chunk_numel"])
        calls[key] = calls.get(key, 0) + 1
        t = separable(s) * (2.0 if s["threads"] == 4 else 1.0)  # 4 threads: truly twice as slow
        stalled = key == (8, 1 << 22) and calls[key] in (2, 3)  # its first two measured steps (after the warm-up)
        return 2.0 * t if stalled else t

    client = Client(cost)
    tuner = make_tuner(client, space=space, baseline=baseline, config=AutotuneConfig(measure_steps=5, probe_steps=60))
    client.run(tuner, 80)
    s = tuner.summary()
    n = {(m["candidate"]["threads"], m["candidate"]["chunk_numel"]): m["n"] for m in s["measurements"]}
    assert s["sampler"] == "tpe" and s["winner"] == {"threads": 8, "chunk_numel": 1 << 25}
    assert n[(8, 1 << 22)] >= 5  # not stopped: its third sample showed the two stalls for what they were
    assert n[(4, 1 << 22)] == 3  # truly 2x slower: stopped once a third sample confirmed it
    assert n[(8, 1 << 30)] == 2  # 10 % slower (1 + 0.03 x 5): stopped after two, no stall suspected


def test_sweep_is_a_deterministic_function_of_the_results():
    from autotune.decide._probe import sweep_next

    space = make_space(threads=(1, 2, 4, 8, 16), chunks=(1 << 20, 1 << 22, 1 << 25))
    cost = _separable(4, 1 << 20)
    base = (16, 1 << 22)
    measured: dict[Any, float] = {base: cost(space.setting(base))}
    seen = []
    while (key := sweep_next(space, base, measured)) is not None:
        assert key not in measured
        seen.append(key)
        measured[key] = cost(space.setting(key))
    assert len(measured) == len(space)  # once the sweep is done, it still offers every candidate
    assert seen[:4] == [(8, 1 << 22), (4, 1 << 22), (2, 1 << 22), (4, 1 << 25)]
    assert min(measured, key=measured.get) == (4, 1 << 20) and seen.index((4, 1 << 20)) < 6


def test_optuna_logging_is_silenced_and_restored():
    optuna = pytest.importorskip("optuna")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    previous = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.INFO)
    logging.getLogger("optuna").addHandler(handler)
    try:
        client = Client(valley({"threads": 2, "chunk_numel": 1 << 21}))
        tuner = make_tuner(client, config=AutotuneConfig(probe_steps=20))
        client.run(tuner, 25)
        assert tuner.summary()["sampler"] == "tpe"
        assert optuna.logging.get_verbosity() == optuna.logging.INFO
        assert [r for r in records if r.levelno < logging.WARNING] == []
    finally:
        logging.getLogger("optuna").removeHandler(handler)
        optuna.logging.set_verbosity(previous)


def test_single_candidate_space_locks_at_start_without_optuna(monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)  # any import of optuna now fails
    client = Client(lambda s: 1.0)
    tuner = make_tuner(client, space=make_space(threads=(8,), chunks=(1 << 20,)))
    assert tuner.state == "locked"
    client.run(tuner, 5)
    s = tuner.summary()
    assert s["probe_steps"] == 0 and s["winner"] == BASELINE and client.applied == [(0, BASELINE)]


def test_a_failing_trace_never_stops_tuning(caplog):
    class BrokenTrace(FakeTrace):
        def add_step(self, row: dict[str, Any]) -> None:
            raise OSError("disk full")

    client = Client(valley({"threads": 4, "chunk_numel": 1 << 22}))
    with caplog.at_level(logging.WARNING, logger="autotune"):
        tuner = make_tuner(client, trace=BrokenTrace(), config=AutotuneConfig(probe_steps=80))
        client.run(tuner, 80)
    assert "trace disabled" in caplog.text and tuner.summary()["winner"] == {"threads": 4, "chunk_numel": 1 << 22}


def test_trace_gets_one_row_per_probe_step_and_the_summary():
    client = Client(valley({"threads": 4, "chunk_numel": 1 << 22}))
    trace = FakeTrace()
    tuner = make_tuner(client, trace=trace, config=AutotuneConfig(probe_steps=80))
    client.run(tuner, 80)
    s = tuner.summary()
    assert len(trace.rows) == s["probe_steps"] == len(trace.spans)
    row = trace.rows[0]
    assert row["step"] == 1 and row["phase"] == "warmup" and row["candidate"] == BASELINE
    assert row["node_time_s"] == row["ranks"][0]["time_s"] and "step_s" in row["ranks"][0]
    assert trace.rows[-1]["decision"] == "locked threads=4 chunk_numel=4194304"
    # The lock-in row, and only it, states the probing cost, the same figures as the summary.
    assert trace.rows[-1]["probe_cost_s"] == s["probe_cost_s"] > 0
    assert trace.rows[-1]["probe_cost_pct_of_1000_steps"] == s["probe_cost_pct_of_1000_steps"] > 0
    assert not any("probe_cost_s" in row for row in trace.rows[:-1])
    assert [t["state"] for t in trace.summaries] == ["locked"] and trace.summaries[0]["winner"] == s["winner"]


# --- cache ----------------------------------------------------------------------------------


def cached_entry(winner: dict[str, Any], winner_median_s: float = 1.0, baseline_median_s: float = 1.5) -> dict[str, Any]:
    return {"winner": winner, "baseline": BASELINE, "winner_median_s": winner_median_s,
            "baseline_median_s": baseline_median_s, "measurements": [], "probe_steps": 30,
            "created_unix": 0.0, "fingerprint": {}}


def cache_for(entry: Any) -> FakeCache:
    return FakeCache({fake_fingerprint(workload=None, space=make_space(), local_world_size=1).key: entry})


def test_cache_hit_skips_probing_and_never_imports_optuna(monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)
    winner = {"threads": 4, "chunk_numel": 1 << 22}
    client = Client(valley(winner))
    cache = cache_for(cached_entry(winner, winner_median_s=1.0))
    tuner = make_tuner(client, cache=cache)
    assert tuner.state == "checking" and client.applied == [(0, winner)]
    client.run(tuner, 14)
    s = tuner.summary()
    assert s["state"] == "locked" and s["cache_hit"] and s["cache_status"] == "hit"
    # Four paired rounds with the static plan (w p | p w | w p | p w), a warm-up step at each switch.
    assert s["probe_steps"] == 0 and s["check_steps"] == 4 + 3 + 3 + 3 and s["winner"] == winner
    assert client.applied == [(0, winner), (2, BASELINE), (5, winner), (8, BASELINE), (11, winner)]
    assert cache.puts == []


@pytest.mark.parametrize("winner", [
    {"threads": 64, "chunk_numel": 1 << 20},          # more threads than the plan allows
    {"threads": 2, "chunk_numel": 1 << 30},           # chunk size out of range
    {"threads": "2", "chunk_numel": 1 << 20},         # wrong types
    {"threads": True, "chunk_numel": 1 << 20},
    {"threads": 2.0, "chunk_numel": 1 << 20},
    {"threads": 2},
    [2, 1 << 20],
])
def test_hostile_cached_winner_warns_and_retunes(winner, caplog):
    client = Client(valley({"threads": 2, "chunk_numel": 1 << 21}))
    cache = cache_for(cached_entry(winner))
    with caplog.at_level(logging.WARNING, logger="autotune"):
        tuner = make_tuner(client, cache=cache, config=AutotuneConfig(probe_steps=80))
    assert "ignoring the cached choice" in caplog.text
    client.run(tuner, 80)
    s = tuner.summary()
    assert s["cache_status"] == "invalid" and not s["cache_hit"] and s["probe_steps"] > 0
    assert s["winner"] == {"threads": 2, "chunk_numel": 1 << 21}
    assert all(make_space().contains(a) for _, a in client.applied)
    assert len(cache.puts) == 1 and cache.puts[0][1]["winner"] == s["winner"]


@pytest.mark.parametrize("entry", ["garbage", cached_entry({"threads": 2, "chunk_numel": 1 << 21}, -1.0),
                                   cached_entry({"threads": 2, "chunk_numel": 1 << 21}, math.inf),
                                   cached_entry({"threads": 2, "chunk_numel": 1 << 21}, 1.0, "fast")])
def test_hostile_cached_entry_warns_and_retunes(entry, caplog):
    client = Client(valley({"threads": 2, "chunk_numel": 1 << 21}))
    with caplog.at_level(logging.WARNING, logger="autotune"):
        tuner = make_tuner(client, cache=cache_for(entry))
    assert "ignoring the cached choice" in caplog.text and tuner.state == "probing"


def test_cached_choice_beaten_by_the_static_plan_today_is_retuned(caplog):
    stale = {"threads": 1, "chunk_numel": 1 << 20}
    best = {"threads": 4, "chunk_numel": 1 << 22}
    client = Client(valley(best))  # the cached choice now costs 2.2 s, the static plan 1.9 s
    cache = cache_for(cached_entry(stale, winner_median_s=1.0))
    with caplog.at_level(logging.WARNING, logger="autotune"):
        tuner = make_tuner(client, cache=cache, config=AutotuneConfig(probe_steps=80))
        client.run(tuner, 100)
    s = tuner.summary()
    assert "the static plan is clearly faster than the cached choice" in caplog.text
    # Four paired rounds (13 steps), then re-tuning from the static plan.
    assert s["cache_status"] == "stale" and s["cache_hit"] and s["check_steps"] == 13 and s["probe_steps"] > 0
    assert s["winner"] == best and cache.puts[-1][1]["winner"] == best
    assert client.applied[:4] == [(0, stale), (2, BASELINE), (5, stale), (8, BASELINE)]


@pytest.mark.parametrize("seed", range(6))
def test_a_noisy_host_keeps_a_good_cached_choice(seed):
    """Today every step is 2.5x slower than recorded and noisy (another job on the node): the
    cached choice, paired with the static plan, still beats it, so it is kept, not re-tuned."""
    winner = {"threads": 4, "chunk_numel": 1 << 22}
    fast = valley(winner)
    client = Client(lambda setting: 2.5 * fast(setting), noise=0.25, seed=seed)
    cache = cache_for(cached_entry(winner, winner_median_s=1.0, baseline_median_s=fast(BASELINE)))
    tuner = make_tuner(client, cache=cache, config=AutotuneConfig(probe_steps=80))
    client.run(tuner, 20)
    s = tuner.summary()
    assert s["state"] == "locked" and s["cache_status"] == "hit" and s["probe_steps"] == 0
    assert s["check_steps"] == 13 and s["winner"] == winner and cache.puts == []
    assert "kept" in s["reason"] and s["paired"][0]["candidate"] == winner and s["paired"][0]["rounds"] == 4


def test_a_cached_choice_as_fast_as_the_plan_is_kept_under_noise():
    """Not clearly faster than the static plan today (the same time, heavy noise): kept; only a
    plan *clearly* faster replaces it."""
    winner = {"threads": 4, "chunk_numel": 1 << 22}
    kept = 0
    for seed in range(50):
        client = Client(lambda setting: 1.0, noise=0.3, seed=seed)
        tuner = make_tuner(client, cache=cache_for(cached_entry(winner)), config=AutotuneConfig(probe_steps=80))
        client.run(tuner, 13)
        kept += tuner.summary()["cache_status"] == "hit"
    # The level is 10.6 % (noise_factor 1.25); 4 rounds can only reach p = 1/16 when all four agree.
    assert kept >= 45


def test_a_cached_static_plan_is_measured_and_kept():
    """A cached choice that is the static plan itself has nothing to be compared with: it is
    measured (warm-up + 3 steps) and kept, however slower than recorded."""
    client = Client(lambda setting: 2.5)
    cache = cache_for(cached_entry(BASELINE, winner_median_s=1.0, baseline_median_s=1.0))
    tuner = make_tuner(client, cache=cache, config=AutotuneConfig(probe_steps=80))
    client.run(tuner, 10)
    s = tuner.summary()
    assert s["cache_status"] == "hit" and s["check_steps"] == 4 and s["probe_steps"] == 0


def test_force_retune_ignores_a_valid_cached_choice():
    winner = {"threads": 4, "chunk_numel": 1 << 22}
    client = Client(valley({"threads": 2, "chunk_numel": 1 << 21}))
    cache = cache_for(cached_entry(winner))
    tuner = make_tuner(client, cache=cache, config=AutotuneConfig(probe_steps=80, force_retune=True))
    client.run(tuner, 80)
    s = tuner.summary()
    assert s["cache_status"] == "forced" and s["probe_steps"] > 0 and s["winner"] == {"threads": 2, "chunk_numel": 1 << 21}
    assert len(cache.puts) == 1


def test_real_cache_file_round_trip(tmp_path, monkeypatch):
    from autotune import TuningCache

    best = {"threads": 2, "chunk_numel": 1 << 22}
    first = Client(valley(best))
    tuner = make_tuner(first, cache=TuningCache(tmp_path / "cache.json"), config=AutotuneConfig(probe_steps=80))
    first.run(tuner, 80)
    assert tuner.summary()["cache_status"] == "miss" and tuner.summary()["winner"] == best
    monkeypatch.setitem(sys.modules, "optuna", None)
    second = Client(valley(best))
    again = make_tuner(second, cache=TuningCache(tmp_path / "cache.json"))
    second.run(again, 20)
    s = again.summary()
    assert s["cache_hit"] and s["probe_steps"] == 0 and s["winner"] == best and second.applied[0] == (0, best)
    assert second.current == best and s["cache_status"] == "hit"


# --- internals ------------------------------------------------------------------------------


def test_sampler_that_repeats_itself_still_yields_every_candidate_once():
    from autotune.decide import _probe

    space = make_space(threads=(1, 2, 4, 8), chunks=(1 << 20,))
    plan = _probe.BudgetPlan("tpe", 4, 0, 0, 16)
    for seed in range(4):  # max_repeated_asks=1: fall back after the first repeat
        order = _probe._OptunaOrder(space, (8, 1 << 20), plan, seed, max_repeated_asks=1)
        measured: dict[Any, float] = {}
        for _ in range(len(space)):
            key = order.ask(measured)
            assert key is not None and key not in measured
            measured[key] = float(key[0])
            order.tell(key, measured[key], measured=len(measured))
        assert next(iter(measured)) == (8, 1 << 20)
        assert order.ask(measured) is None


def test_single_process_agreement_needs_no_process_group():
    from autotune.agree._agree import LocalAgreement, make_agreement

    agreement = make_agreement(None, timeout_s=1.0)
    assert isinstance(agreement, LocalAgreement)
    assert agreement.all_gather({"a": 1}, step=0, what="x") == [{"a": 1}]
    assert agreement.broadcast(3, step=0, what="x") == 3 and agreement.max_float(2, step=0, what="x") == 2.0
    with pytest.raises(ValueError, match="expected None, a gloo ProcessGroup or an Agreement"):
        make_agreement("nccl", timeout_s=1.0)


def test_grid_with_fewer_final_rounds_beats_sampling_when_it_fits() -> None:
    from autotune.decide._probe import plan_budget

    # 47 steps; 8 candidates x 4 = 32 (exploring: round 0); two rounds of 3 finalists (12) and one
    # duel round (4) to reach the 4 paired rounds a rank test needs would be 48; one round (6) and
    # two duel rounds (8): 46.
    config = AutotuneConfig(probe_steps=47)
    plan = plan_budget(8, config)
    assert plan.sampler == "grid" and plan.explore == 8 and plan.final_rounds == 1 and plan.duel_rounds == 2
    assert plan.steps == 46 <= config.probe_steps
    # Two rounds still used when they fit; sampling when even one round does not.
    assert plan_budget(8, AutotuneConfig(probe_steps=48)).final_rounds == 2
    assert plan_budget(6, AutotuneConfig()).sampler == "grid" and plan_budget(7, AutotuneConfig()).sampler == "tpe"


# --- what a loaded host does to the evidence (injected step times) ---------------------------

TWO = make_space(threads=(1, 2), chunks=(1 << 20,))
PLAN2 = {"threads": 2, "chunk_numel": 1 << 20}
ONE = {"threads": 1, "chunk_numel": 1 << 20}


class Scripted:
    """Step times per setting from a per-setting cycle (its own slowness, in the order it comes),
    times a node-wide factor per step index (a stall of the machine, whichever setting runs)."""

    def __init__(self, cycles: dict[int, list[float]], stalls: dict[int, float] | None = None) -> None:
        self.cycles, self.stalls, self.seen = cycles, stalls or {}, {k: 0 for k in cycles}
        self.client: Client | None = None

    def __call__(self, setting: dict[str, Any]) -> float:
        assert self.client is not None
        cycle = self.cycles[setting["threads"]]
        t = cycle[self.seen[setting["threads"]] % len(cycle)]
        self.seen[setting["threads"]] += 1
        return t * self.stalls.get(self.client.steps, 1.0)


def scripted_run(cycles: dict[int, list[float]], stalls: dict[int, float] | None = None) -> tuple[OnlineTuner, Client]:
    cost = Scripted(cycles, stalls)
    client = Client(cost)
    cost.client = client
    tuner = make_tuner(client, space=TWO, baseline=PLAN2, config=AutotuneConfig(probe_steps=40))
    client.run(tuner, 40, until_locked=True)
    assert tuner.state == "locked"
    return tuner, client


@pytest.mark.parametrize("phase", range(5))
def test_a_candidate_fast_once_in_five_never_wins(phase):
    # 1 thread is 10x slower four steps in five (an oversubscribed team preempted in its
    # barriers) and 3x faster on the fifth; the static plan runs 1.0 every step.
    lucky = [5.0, 5.0, 5.0, 5.0, 0.3]
    tuner, _ = scripted_run({1: lucky[phase:] + lucky[:phase], 2: [1.0]})
    assert tuner.summary()["winner"] == PLAN2, tuner.summary()["reason"]


@pytest.mark.parametrize("seed", range(6))
def test_a_candidate_faster_in_most_rounds_but_slower_on_the_mean_never_wins(seed):
    # Faster (0.6) in about two steps of three, ten times slower (6.0) in the others, at random:
    # slower on the mean (about 2.4 vs 1.0), which is what a run pays.
    rng = random.Random(seed)
    often = [6.0 if rng.random() < 1 / 3 else 0.6 for _ in range(60)]
    tuner, _ = scripted_run({1: often, 2: [1.0]})
    assert tuner.summary()["winner"] == PLAN2, tuner.summary()["reason"]


@pytest.mark.parametrize("stall_step", range(8, 30))
def test_a_node_wide_stall_in_one_round_loses_no_candidate(stall_step):
    # 1 thread is 20 % faster; one step of the session (any arm, any phase) stalls 2x.
    tuner, _ = scripted_run({1: [0.8], 2: [1.0]}, stalls={stall_step: 2.0})
    assert tuner.summary()["winner"] == ONE, (stall_step, tuner.summary()["reason"])


def _lull_then_load(client_steps: Callable[[], int], lull_steps: int) -> Cost:
    """The static plan's 2 threads run 0.6 in a lull of the load (its first ``lull_steps`` steps),
    then 5.0 once the load is back (a team preempted in its barriers); 1 thread runs 1.0 throughout."""
    def cost(setting: dict[str, Any]) -> float:
        if setting["threads"] == 1:
            return 1.0
        return 0.6 if client_steps() < lull_steps else 5.0
    return cost


def test_a_lull_over_the_first_rounds_does_not_settle_the_duel_for_the_plan():
    # bench.tuner_load --load bursts: a grid of two candidates and its two finals rounds take 14
    # steps, a fraction of a second for stock AdamW, all of it in one lull of the load. Three
    # rounds that favour the plan are not yet "clearly faster" (p = 1/8): the duel runs on, the load
    # comes back, and 1 thread wins on the mean.
    client = Client(lambda s: 1.0)
    client.cost = _lull_then_load(lambda: client.steps, lull_steps=14)
    tuner = make_tuner(client, space=TWO, baseline=PLAN2, config=AutotuneConfig(probe_steps=40))
    client.run(tuner, 40, until_locked=True)
    s = tuner.summary()
    assert s["state"] == "locked" and s["winner"] == ONE, s["reason"]
    assert "clearly faster than the static plan" in s["reason"]


def test_a_plan_clearly_faster_ends_the_duel_as_soon_as_it_is_clearly_faster():
    # Without a lull (2 threads 0.6 throughout) the plan is clearly faster after exploring's round,
    # the two finals rounds and one duel round (4 of 4, p = 1/16): 8 + 3 + 3 + 3 steps, no more.
    client = Client(_lull_then_load(lambda: 0, lull_steps=1))
    tuner = make_tuner(client, space=TWO, baseline=PLAN2, config=AutotuneConfig(probe_steps=40))
    client.run(tuner, 40, until_locked=True)
    s = tuner.summary()
    assert s["winner"] == PLAN2 and s["probe_steps"] == 17, (s["probe_steps"], s["reason"])


# --- under doubt, the lighter setting (issue 36: a loaded host's undecided sessions) -----------

def _rounds(one: list[float], two: list[float]) -> list[dict[tuple[Any, ...], float]]:
    return [{(1, 1 << 20): a, (2, 1 << 20): b} for a, b in zip(one, two)]


LEANING = [0.5, 0.6, 1.6, 0.55, 1.1, 0.6, 1.5, 0.55]  # a mean of 0.875 of 1.0, faster in 5 of 8


def test_an_undecided_lighter_arm_that_leans_faster_replaces_the_plan_once_the_budget_is_spent():
    # 1 thread against the static plan's 2: faster on the mean (0.875) but in only 5 of 8 rounds,
    # three of them against it by a lot: not clearly faster (the load came and went under the rounds).
    assert len(LEANING) == LEAN_ROUNDS
    rounds = _rounds(LEANING, [1.0] * len(LEANING))
    config = AutotuneConfig()
    comparison = _paired.PairedComparison.of(LEANING, [1.0] * len(LEANING))
    assert not comparison.clearly_faster(min_gain=config.min_gain, noise_factor=config.noise_factor)
    winner, reason, runner_up = decide_paired(TWO, (2, 1 << 20), rounds, config)
    assert winner == (1, 1 << 20) and "under doubt the lighter setting is kept" in reason
    assert runner_up == (2, 1 << 20)  # the watch's first challenger is the static plan
    # While rounds may still be added (the duel asks), a lean decides nothing.
    assert decide_paired(TWO, (2, 1 << 20), rounds, config, final=False)[0] == (2, 1 << 20)


def test_an_undecided_heavier_arm_never_replaces_the_plan():
    # The mirror image: the static plan is 1 thread, 2 threads lean faster but not clearly.
    rounds = _rounds([1.0] * len(LEANING), LEANING)
    winner, reason, _ = decide_paired(TWO, (1, 1 << 20), rounds, AutotuneConfig())
    assert winner == (1, 1 << 20) and "not clearly faster" in reason


@pytest.mark.parametrize("one, why", [
    (LEANING[:-1], "fewer than LEAN_ROUNDS rounds"),
    ([1.0, 0.995, 1.0, 0.99] * 2, "within min_gain on the mean"),
    ([0.5, 0.6, 3.0, 0.55] * 2, "slower on the mean"),
])
def test_a_lighter_arm_without_a_lean_leaves_the_plan(one: list[float], why: str):
    assert len(one) < LEAN_ROUNDS or why != "fewer than LEAN_ROUNDS rounds"
    rounds = _rounds(one, [1.0] * len(one))
    assert decide_paired(TWO, (2, 1 << 20), rounds, AutotuneConfig())[0] == (2, 1 << 20), why


def test_a_session_that_ends_undecided_locks_the_lighter_arm_that_leans_faster():
    # End to end, the shape bench.tuner_load saw: the static plan's 2 threads run 0.6 three steps in
    # four and 2.5 in the fourth (a mean of 1.075), 1 thread 1.0. The rounds disagree wildly both
    # ways, so the duel runs to the end of the budget without a clear winner.
    tuner, client = scripted_run({1: [1.0], 2: [0.6, 2.5, 0.6, 0.6]})
    s = tuner.summary()
    assert s["winner"] == ONE and "under doubt" in s["reason"], s["reason"]
    assert s["probe_steps"] > 30  # a grid of two candidates plans 14: the duel ran on
    assert client.current == ONE
