"""``python -m bench.tuner_quality --quick`` end to end (one real tuner run, cache hit and sweep on a
small model), its numbers recomputed from the raw samples it stores, and its statistics helpers.
No timing is asserted: only structure, consistency and the tuner's protocol. The run passes a
``--recheck-rounds 1`` (one paired round can never show the static plan clearly faster), so the cache-hit run's re-check keeps the
cached choice whatever the machine's load (the slower-machine paths, 8 check steps or a re-tune,
are driven with injected step times in tests/test_tuner_logic.py)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.tuner_quality import _main as tq


def _strict_json(text: str) -> Any:
    def reject(constant: str) -> None:
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=reject)


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("tuner_quality")
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        for var in ("OFFLOAD_AUTOTUNE_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "OFFLOAD_AUTOTUNE_CACHE"):
            mp.delenv(var, raising=False)
        argv = ["--quick", "--out-dir", str(out), "--log-level", "WARNING", "--recheck-rounds", "1"]
        assert tq.main(argv) == 0
    assert torch.get_num_threads() == threads  # the benchmark restores the process-wide setting
    assert not (out / "tuner_quality-quick.png").exists()  # no plot in quick mode
    result = _strict_json((out / "tuner_quality-quick.json").read_text())
    return result, (out / "tuner_quality-quick.md").read_text()


def test_sweep_covers_the_tuners_space_interleaved(quick: tuple[dict[str, Any], str]) -> None:
    result, _ = quick
    cfg, space, raw = result["config"], result["space"], result["sweep_raw"]
    candidates = space["candidates"]
    assert len(candidates) == space["n"] == result["tuner_runs"][0]["summary"]["n_candidates"] >= 2
    assert space["static_plan"] == result["tuner_runs"][0]["summary"]["baseline"] in candidates
    assert [row["candidate"] for row in result["analysis"]["candidates"]] == candidates
    assert len(raw["orders"]) == cfg["rounds"]
    for order in raw["orders"]:  # every round visits every candidate once
        assert sorted(order) == list(range(len(candidates)))
    for rows in raw["step_s_by_round"]:
        assert len(rows) == cfg["rounds"] and all(len(r) == cfg["per_visit"] for r in rows)
        assert all(x > 0 for r in rows for x in r)


def test_statistics_and_regret_recomputed_from_raw_samples(quick: tuple[dict[str, Any], str]) -> None:
    result, _ = quick
    candidates = result["space"]["candidates"]
    flat = [[x for r in rows for x in r] for rows in result["sweep_raw"]["step_s_by_round"]]
    medians = [statistics.median(s) for s in flat]
    best = min(range(len(medians)), key=medians.__getitem__)
    a = result["analysis"]
    assert a["best"] == candidates[best]
    for i, row in enumerate(a["candidates"]):
        assert row["n"] == len(flat[i]) and row["median"] == pytest.approx(medians[i])
        assert row["ratio_to_best"] == pytest.approx(medians[i] / medians[best])
        assert row["is_best"] == (i == best) and row["is_static"] == (candidates[i] == a["static"])
        lo, hi = row["paired_ratio_to_best"]["ci"]
        assert lo <= row["paired_ratio_to_best"]["median"] <= hi
    assert a["candidates"][best]["paired_ratio_to_best"] == {"median": 1.0, "ci": [1.0, 1.0]}
    assert len(a["reps"]) == result["config"]["reps"] == len(result["tuner_runs"])
    for rep, run in zip(a["reps"], result["tuner_runs"]):
        w = candidates.index(run["summary"]["winner"])
        assert rep["winner"] == candidates[w]
        assert rep["regret"] == pytest.approx(medians[w] / medians[best] - 1.0) and rep["regret"] >= 0
        assert rep["meets_target"] == (rep["regret"] <= tq.TARGET_REGRET)
        static = candidates.index(a["static"])
        assert rep["slower_than_static_beyond_noise"] == tq.slower_beyond_noise(flat[w], flat[static])
        assert w in [i for i, row in enumerate(a["candidates"]) if rep["rep"] in row["winner_of_reps"]]
    h = result["headline"]
    assert h["regret"] == a["reps"][0]["regret"]
    assert h["regret_max"] == pytest.approx(max(r["regret"] for r in a["reps"]))
    assert h["never_slower_than_static"] == (not any(r["slower_than_static_beyond_noise"] for r in a["reps"]))


def test_tuner_runs_follow_the_protocol(quick: tuple[dict[str, Any], str]) -> None:
    result, _ = quick
    static = result["space"]["static_plan"]
    seeds = [run["seed"] for run in result["tuner_runs"]]
    assert seeds == list(range(result["config"]["seed"], result["config"]["seed"] + len(seeds)))
    for run in result["tuner_runs"]:
        s = run["summary"]
        assert s["state"] == "locked" and s["cache_status"] == "miss" and not s["cache_hit"]
        assert run["cache_status_at_start"] == "miss"
        assert run["cpu_use"]["own_share"] > 0 and run["cpu_use"]["others_share"] >= 0
        assert 0 < s["probe_steps"] == len(run["active_steps"]) <= s["probe_budget"]
        first = run["active_steps"][0]
        assert {"threads": first["threads"], "chunk_numel": first["chunk_numel"]} == static  # static plan first
        for step in run["locked_steps"]:
            assert {"threads": step["threads"], "chunk_numel": step["chunk_numel"]} == s["winner"]
        # probing cost, recomputed by its definition (the run's first step, state init, left out)
        walls = [x["wall_s"] for x in run["active_steps"]]
        assert run["first_step_s"] == walls[0]
        locked = statistics.median([x["wall_s"] for x in run["locked_steps"][1:]])
        cost = run["start_overhead_s"] + sum(walls[1:]) + run["locked_steps"][0]["wall_s"] - len(walls) * locked
        assert run["locked_step_s"] == pytest.approx(locked)
        assert run["startup_cost_s"] == pytest.approx(cost)
        assert run["share_of_1000_steps"] == pytest.approx(cost / (1000 * locked))


def test_second_run_hits_the_cache_and_only_rechecks(quick: tuple[dict[str, Any], str]) -> None:
    result, _ = quick
    first, second = result["tuner_runs"][0], result["second_run"]
    s = second["summary"]
    assert second["cache_status_at_start"] == "hit" and s["cache_hit"] and s["state"] == "locked"
    assert s["cache_key"] == first["summary"]["cache_key"]
    cfg = result["autotune_config"]
    cached, static = first["summary"]["winner"], first["summary"]["baseline"]
    # One paired round of the cached winner and the static plan (a warm-up step each), or, for a
    # cached static plan, warm-up + measured steps of it.
    checks = 2 * (cfg["warmup_steps"] + 1) if cached != static else cfg["warmup_steps"] + cfg["measure_steps"]
    assert s["check_steps"] == checks
    runs = [{"threads": step["threads"], "chunk_numel": step["chunk_numel"]} for step in second["active_steps"][:checks]]
    assert runs[0] == cached and all(r in (cached, static) for r in runs)
    view = result["cache_hit_run"]
    assert view["cache_hit"] and view["second_run"]["steps_to_lock"] == len(second["active_steps"])
    assert cfg["recheck_rounds"] == 1  # one round can never show the plan clearly faster: never "stale"
    assert s["cache_status"] == "hit" and s["probe_steps"] == 0 and len(second["active_steps"]) == checks
    assert s["winner"] == cached and view["same_winner_as_first_run"]
    assert view["second_run"]["steps_to_lock"] < view["first_run"]["steps_to_lock"]
    assert result["headline"]["cache_hit"] and result["headline"]["cache_probe_steps"] == 0


def test_markdown_reports_every_candidate_and_the_headline(quick: tuple[dict[str, Any], str]) -> None:
    result, md = quick
    assert result["command"] in md and result["uptime_before"] in md
    assert set(result["code"]) == {"commit", "changed"} and f"commit {result['code']['commit']}" in md
    for row in result["analysis"]["candidates"]:
        assert f"| {row['label']} | {row['median'] * 1e3:.2f} |" in md
    assert f"**regret {result['headline']['regret'] * 100:.2f}%**" in md
    h = result["headline"]
    assert f"cache_hit **{h['cache_hit']}**" in md and f"probe steps **{h['cache_probe_steps']}**" in md


def test_regret_and_paired_ratio() -> None:
    assert tq.regret(1.06, 1.0) == pytest.approx(0.06)
    assert tq.regret(2.0, 2.0) == 0.0
    with pytest.raises(ValueError, match="best_median=0"):
        tq.regret(1.0, 0)
    assert tq.paired_ratio([[2.0, 4.0], [3.0]], [[1.0, 3.0], [3.0]]) == [1.5, 1.0]
    with pytest.raises(ValueError, match="2 rounds of a vs 1"):
        tq.paired_ratio([[1.0], [1.0]], [[1.0]])


def test_bootstrap_ci_and_noise_rule() -> None:
    assert tq.bootstrap_ci([1.1] * 7) == (pytest.approx(1.1), pytest.approx(1.1))
    values = [0.9, 1.0, 1.05, 1.1, 1.2, 1.3, 2.0]
    lo, hi = tq.bootstrap_ci(values, seed=3)
    assert (lo, hi) == tq.bootstrap_ci(values, seed=3)  # seeded
    assert lo <= statistics.median(values) <= hi and lo < hi
    with pytest.raises(ValueError, match="at least one value"):
        tq.bootstrap_ci([])
    ref = [1.0, 1.01, 0.99, 1.0]
    assert tq.slower_beyond_noise([1.2, 1.21, 1.19, 1.2], ref)
    assert not tq.slower_beyond_noise([1.0, 1.3, 0.8, 1.02], ref)  # slower median, but within its IQR
    assert not tq.slower_beyond_noise([0.8, 0.8, 0.8, 0.8], ref)


def test_startup_cost_definition() -> None:
    # 0.5 s start + 3 steps of 2 s + a first locked step of 1.5 s, locked at 1 s: 0.5 + 6 + 1.5 - 4
    cost = tq.startup_cost(start_overhead_s=0.5, active_walls=[2.0, 2.0, 2.0], first_locked_wall=1.5, locked_step_s=1.0)
    assert cost == pytest.approx(4.0)


@pytest.mark.parametrize("flag", ["--rounds", "--locked-steps", "--reps"])
def test_bad_arguments_are_named(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        tq.main(["--quick", flag, "0"])
    assert exc.value.code == 2 and f"{flag} 0: expected an integer >=" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1"])
def test_bad_recheck_rounds_is_named(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        tq.main(["--quick", "--recheck-rounds", value])
    assert exc.value.code == 2 and f"--recheck-rounds {value}: expected an integer >= 1" in capsys.readouterr().err
