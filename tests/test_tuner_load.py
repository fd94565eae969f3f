"""``python -m bench.tuner_load --quick --load busy`` end to end (real tuners of both kinds under two
busy-loop processes, scored right after lock-in), its regrets recomputed from the raw samples it
stores, the regret arithmetic on injected numbers, and the background load's workers always
stopped (after the run, an exception, Ctrl-C, or a parent that died). No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from bench.tuner_load import _main as tl
from bench.tuner_load._load import BackgroundLoad, LoadSpec

REPO = Path(__file__).absolute().parents[1]


def _strict_json(text: str) -> Any:
    def reject(constant: str) -> None:
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=reject)


def _gone(pid: int) -> bool:
    """The worker is dead and reaped (or its pid now belongs to a process that is not ours)."""
    try:
        proc = psutil.Process(pid)
        return proc.ppid() != os.getpid()  # a zombie child of ours is not gone: it was not reaped
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("tuner_load")
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        for var in ("OFFLOAD_AUTOTUNE_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "OFFLOAD_AUTOTUNE_CACHE"):
            mp.delenv(var, raising=False)
        assert tl.main(["--quick", "--load", "busy", "--out-dir", str(out), "--log-level", "WARNING"]) == 0
    assert torch.get_num_threads() == threads
    result = _strict_json((out / "tuner_load-busy-quick.json").read_text())
    return result, (out / "tuner_load-busy-quick.md").read_text()


@pytest.mark.slow
def test_sessions_lock_in_a_setting_of_their_space_and_are_scored_interleaved(
        quick: tuple[dict[str, Any], str]) -> None:
    result, _ = quick
    cfg, sessions = result["config"], result["sessions"]
    assert cfg["quick"] and cfg["sessions_per_kind"] == 2 and cfg["rounds"] == 3 and cfg["params"] < 200_000
    assert [s["kind"] for s in sessions] == ["stock", "offload"] * 2  # alternated
    assert [s["seed"] for s in sessions] == [0, 0, 1, 1]
    for s in sessions:
        assert s["locked"] and s["state"] == "locked"
        assert s["winner"] in s["candidates"] and s["baseline"] in s["candidates"]
        assert s["space_size"] == len(s["candidates"]) >= 2
        assert s["probe_steps"] == len(s["probe_walls_s"]) == s["summary_probe_steps"] >= 1
        assert sorted(s["candidates"][0]) == (["threads"] if s["kind"] == "stock" else ["chunk_numel", "threads"])
        assert len(s["orders"]) == cfg["rounds"]
        for order in s["orders"]:  # every round visits every candidate once
            assert sorted(order) == list(range(s["space_size"]))
        assert len(s["samples_s"]) == s["space_size"]
        for rounds in s["samples_s"]:
            assert len(rounds) == cfg["rounds"] and all(len(v) == cfg["per_visit"] for v in rounds)
            assert all(x > 0 for v in rounds for x in v)


@pytest.mark.slow
def test_regrets_recomputed_from_the_raw_samples(quick: tuple[dict[str, Any], str]) -> None:
    result, _ = quick
    for s in result["sessions"]:
        flat = [[x for v in rounds for x in v] for rounds in s["samples_s"]]
        means = [sum(xs) / len(xs) for xs in flat]
        w, b = s["candidates"].index(s["winner"]), means.index(min(means))
        sc = s["score"]
        assert sc["winner_index"] == w and sc["best_index"] == b and sc["best"] == s["candidates"][b]
        assert sc["candidate_mean_s"] == pytest.approx(means)
        assert sc["regret"] >= 0 and sc["regret"] == pytest.approx(means[w] / means[b] - 1)
        run = tl.RUN_STEPS
        whole = (sum(s["probe_walls_s"]) + (run - s["probe_steps"]) * means[w]) / (run * means[b]) - 1
        assert sc["whole_run_regret"] == pytest.approx(whole)
        # The run went on with the watch before scoring; what it then followed is scored too.
        assert len(s["watch_walls_s"]) == result["config"]["watch_steps"] == 4 and s["settled"] in s["candidates"]
        f = s["candidates"].index(s["settled"])
        assert sc["settled_index"] == f and sc["settled_regret"] == pytest.approx(means[f] / means[b] - 1)
        paid = s["probe_walls_s"] + s["watch_walls_s"]
        watched = (sum(paid) + (run - len(paid)) * means[f]) / (run * means[b]) - 1
        assert sc["whole_run_regret_watched"] == pytest.approx(watched)
        assert sc["pooled_regret"] >= 0
    summary = result["summary"]
    assert list(summary) == ["stock", "offload"]
    for kind, k in summary.items():
        regrets = [s["score"]["regret"] for s in result["sessions"] if s["kind"] == kind]
        assert k["sessions"] == k["scored"] == 2 and k["never_locked"] == 0
        assert k["max_regret"] == pytest.approx(max(regrets))
        assert sum(k["winners"].values()) == 2


@pytest.mark.slow
def test_load_workers_are_gone_and_the_report_names_the_command(quick: tuple[dict[str, Any], str]) -> None:
    result, markdown = quick
    load = result["load"]
    assert load["kind"] == "busy" and len(load["pids"]) == 2
    assert all(_gone(pid) for pid in load["pids"])
    assert result["command"].startswith("python -m bench.tuner_load --quick --load busy")
    assert f"`{result['command']}`" in markdown
    assert "| stock | 2 | 2 | 0 |" in markdown and "| offload |" in markdown
    tl.build_parser().parse_args(result["command"].split()[3:])  # the stored command parses


@pytest.mark.slow
def test_a_load_that_starts_at_lock_in_runs_under_the_watched_steps_and_the_scoring(tmp_path: Path) -> None:
    with pytest.MonkeyPatch.context() as mp:
        for var in ("OFFLOAD_AUTOTUNE_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "OFFLOAD_AUTOTUNE_CACHE"):
            mp.delenv(var, raising=False)
        assert tl.main(["--quick", "--load", "busy", "--load-starts", "lock", "--kinds", "stock", "--sessions", "2",
                        "--out-dir", str(tmp_path), "--log-level", "WARNING"]) == 0
    result = _strict_json((tmp_path / "tuner_load-busy-at-lock-quick.json").read_text())
    assert result["config"]["load_starts"] == "lock" and result["load"]["pids"] == []  # none before lock-in
    pids = [s["load_pids_at_lock"] for s in result["sessions"]]
    assert all(len(p) == 2 for p in pids) and len({*pids[0], *pids[1]}) == 4  # a load of its own per session
    assert all(_gone(pid) for p in pids for pid in p)
    assert all("first_switch_step" in s and s["score"]["settled_index"] >= 0 for s in result["sessions"])
    markdown = (tmp_path / "tuner_load-busy-at-lock-quick.md").read_text()
    assert "starting at each session's lock-in" in markdown and "the first switch" in markdown


def test_regret_arithmetic_on_injected_samples() -> None:
    candidates = [{"threads": 1}, {"threads": 2}]
    # threads=1: median 1.0 but mean 3.25 (one slow step counts: a run pays it); threads=2: 2.0 flat.
    samples = [[[1.0, 1.0], [1.0, 10.0]], [[2.0, 2.0], [2.0, 2.0]]]
    score = tl.analyse_session(candidates, samples, {"threads": 1}, probe_walls=[4.0] * 10)
    assert score["candidate_median_s"] == [1.0, 2.0] and score["candidate_mean_s"] == [3.25, 2.0]
    assert score["best"] == {"threads": 2} and (score["winner_index"], score["best_index"]) == (0, 1)
    assert score["regret"] == pytest.approx(3.25 / 2.0 - 1)
    assert score["whole_run_regret"] == pytest.approx((40.0 + 1990 * 3.25) / (2000 * 2.0) - 1)
    best = tl.analyse_session(candidates, samples, {"threads": 2}, probe_walls=[2.0] * 10)
    assert best["regret"] == 0 and best["whole_run_regret"] == pytest.approx(0)
    assert tl.whole_run_regret([1.0, 3.0], 1.0, 1.0, run_steps=4) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="best_mean"):
        tl.lock_in_regret(1.0, 0.0)
    with pytest.raises(ValueError, match="run_steps"):
        tl.whole_run_regret([1.0] * 5, 1.0, 1.0, run_steps=4)


def test_regret_interval_is_a_bootstrap_over_rounds_with_the_best_fixed() -> None:
    same = [[1.0, 1.2], [0.9, 1.1], [1.0, 1.0]]
    assert tl.regret_interval(same, same) == (0.0, 0.0)
    slower = [[1.5, 1.6], [1.4, 1.5], [1.5, 1.5]]
    lo, hi = tl.regret_interval(slower, same)
    assert 0 < lo <= 1.5 / (6.2 / 6) - 1 <= hi  # the means' regret lies inside
    assert tl.regret_interval(slower, same) == (lo, hi)  # seeded
    noisy = [[0.5, 0.5], [3.0, 3.0], [0.5, 0.5]]  # mean 1.33 vs 1.03, but one round decides it
    lo, hi = tl.regret_interval(noisy, same)
    assert lo < 0 < hi


def test_summary_counts_bad_and_never_locked_sessions() -> None:
    def session(regret: float | None, winner: dict[str, int] | None, means: tuple[float, float] = (1.0, 1.0)
                ) -> dict[str, Any]:
        s: dict[str, Any] = {"kind": "stock", "locked": winner is not None, "winner": winner, "probe_steps": 16,
                             "session_s": 1.0, "space_size": 2, "candidates": [{"threads": 1}, {"threads": 2}]}
        if regret is not None:
            s["score"] = {"regret": regret, "whole_run_regret": regret + 0.01, "regret_ci95": (regret - 0.2, regret),
                          "candidate_mean_s": list(means), "settled_regret": regret / 10,
                          "whole_run_regret_watched": regret / 10 + 0.01}
            s["switches"] = [{"step": 30}] if regret > 0.2 else []
        return s

    # Pooled over the three scored sessions, 1 thread has a mean of 2.0 s and 2 threads 3.0 s, although
    # one session alone saw 2 threads faster.
    rows = [session(0.0, {"threads": 2}, (1.0, 0.9)), session(0.5, {"threads": 1}, (2.0, 4.1)),
            session(0.1, {"threads": 2}, (3.0, 4.0)), session(None, None)]
    k = tl.summarize(rows)["stock"]
    assert (k["sessions"], k["scored"], k["never_locked"], k["above_bad_regret"], k["beyond_noise"]) == (4, 3, 1, 1, 1)
    assert k["max_regret"] == 0.5 and k["median_regret"] == 0.1
    assert k["p90_regret"] == pytest.approx(0.42)  # linear interpolation between 0.1 and 0.5
    assert k["winners"] == {"threads=2": 2, "threads=1": 1}
    assert k["pooled_means_s"] == pytest.approx({"threads=1": 2.0, "threads=2": 3.0})
    assert [r["score"]["pooled_regret"] for r in rows[:3]] == pytest.approx([0.5, 0.0, 0.5])
    assert k["max_pooled_regret"] == pytest.approx(0.5) and k["above_bad_pooled_regret"] == 2
    # The scoring floor: the pooled best (1 thread) scored session by session lost only the first
    # session, where 2 threads scored 0.9 s against its 1.0 s.
    assert k["median_scoring_floor"] == 0.0 and k["max_scoring_floor"] == pytest.approx(1.0 / 0.9 - 1)
    # After the watch: the setting a run follows, and a run that paid the watch's steps.
    assert k["max_settled_regret"] == pytest.approx(0.05) and k["above_bad_settled_regret"] == 0
    assert k["median_whole_run_regret_watched"] == pytest.approx(0.02) and k["sessions_with_switches"] == 1


def test_a_session_scores_the_setting_the_watch_settled_on() -> None:
    samples = [[[1.0, 1.0]] * 3, [[2.0, 2.0]] * 3]  # 1 thread 1.0 s, 2 threads 2.0 s a step
    one, two = {"threads": 1}, {"threads": 2}
    sc = tl.analyse_session([one, two], samples, two, [2.0] * 10, settled=one, watch_walls=[2.0] * 40 + [1.0] * 50)
    assert sc["regret"] == 1.0 and sc["settled_index"] == 0 and sc["settled_regret"] == 0.0
    # 50 probe and watched steps at 2.0 s, then 1950 at 1.0 s, against 2000 at 1.0 s.
    assert sc["whole_run_regret_watched"] == pytest.approx(50 / 2000)
    assert sc["whole_run_regret"] == pytest.approx((10 * 2.0 + 1990 * 2.0) / 2000 - 1)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_load_workers_stop_when_the_block_fails(error: type[BaseException]) -> None:
    load = BackgroundLoad(LoadSpec(kind="busy", procs=2))
    with pytest.raises(error), load:
        assert len(load.pids) == 2 and not any(_gone(pid) for pid in load.pids)
        raise error("stop")
    assert all(_gone(pid) for pid in load.pids)


def test_load_workers_keep_openmps_default_wait_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The load stands for other jobs: its workers run without this process's OMP_WAIT_POLICY."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("TUNER_LOAD_TEST_MARK", "1")
    with BackgroundLoad(LoadSpec(kind="busy", procs=1)) as load:
        env = psutil.Process(load.pids[0]).environ()
    assert env.get("TUNER_LOAD_TEST_MARK") == "1" and "OMP_WAIT_POLICY" not in env


def test_a_worker_whose_parent_is_gone_exits() -> None:
    # --parent names a pid that is not the worker's parent: it must report ready, then leave.
    proc = subprocess.run([sys.executable, "-m", "bench.tuner_load._load", "--kind", "busy", "--parent", str(2**22 + 1)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split() == ["ready"]


def test_bad_values_are_refused_before_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for argv in (["--sessions", "0"], ["--kinds", "stock,sgd"], ["--load", "gpu"], ["--load-procs", "0"]):
        with pytest.raises(SystemExit) as exc:
            tl.main(argv)
        assert exc.value.code == 2
    assert not (tmp_path / "runs").exists()


def test_the_wait_policy_benchmark_measures_both_policies_in_their_own_processes(tmp_path: Path) -> None:
    """``python -m bench.tuner_load.wait_policy --quick``: one process per policy, each with only its
    ``OMP_WAIT_POLICY`` set, every kind and thread count measured, the summary recomputed from the
    raw samples; the load's workers are gone. No timing is asserted."""
    from bench.tuner_load import wait_policy as wp

    assert wp.main(["--quick", "--load", "busy", "--out-dir", str(tmp_path)]) == 0
    result = _strict_json((tmp_path / "wait_policy-busy-quick.json").read_text())
    assert [p["policy"] for p in result["processes"]] == ["default", "PASSIVE"]
    for proc in result["processes"]:
        assert set(proc["times"]) == {"stock", "offload"}
        assert all(len(proc["times"][kind][t]) == 2 for kind in proc["times"] for t in ("1", "2"))
    assert result["summary"] == wp.summarize(result["processes"])
    assert "| PASSIVE | offload |" in (tmp_path / "wait_policy-busy-quick.md").read_text()
    assert result["command"] == "python -m bench.tuner_load.wait_policy --quick --load busy --out-dir " + str(tmp_path)


def test_the_wait_policy_benchmark_sets_only_its_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measured process's environment is this one's with OMP_WAIT_POLICY as its arm says (unset
    for "default") and OMP_NUM_THREADS unset, whatever this process has."""
    from bench.tuner_load import wait_policy as wp

    seen: list[dict[str, str]] = []

    def fake_run(cmd: list[str], env: dict[str, str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        seen.append(env)
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"stock": {"1": [1.0], "2": [1.0]}}), "")

    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setattr(wp.subprocess, "run", fake_run)
    wp.measure_process("default", 1, 8)
    wp.measure_process("PASSIVE", 1, 8)
    assert "OMP_WAIT_POLICY" not in seen[0] and seen[1]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert all("OMP_NUM_THREADS" not in env for env in seen)
