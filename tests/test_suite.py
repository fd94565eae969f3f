"""The benchmark suite (``python -m bench``): row mapping, step selection, and real quick runs that
must write readable results. No timing is asserted: only structure, provenance and consistency."""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from bench import _scenarios as sc
from bench import suite


def _args(**kw) -> argparse.Namespace:
    p = suite.build_parser()
    argv = []
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", v]
    return suite._resolve(p, p.parse_args(argv))


# --------------------------------------------------------------------------- pure logic


def test_thread_rules() -> None:
    assert sc.thread_rules(cpu_count=8, affinity=8, ranks=2) == {"launcher": 1, "env": 4, "static": 4}
    # The old rule caps by the mask: 4 CPUs in the mask, 16 on the machine, 2 ranks -> 4 each (oversubscribes).
    assert sc.thread_rules(cpu_count=16, affinity=4, ranks=2) == {"launcher": 1, "env": 8, "static": 4}
    assert sc.thread_rules(cpu_count=2, affinity=2, ranks=4) == {"launcher": 1, "env": 1, "static": 1}
    with pytest.raises(ValueError, match="ranks=0"):
        sc.thread_rules(cpu_count=2, affinity=2, ranks=0)


def test_rows_map_to_trainer_flags() -> None:
    rows = {r.row: r for r in sc.build_rows(ranks=2, dtype="bf16", cpu_count=16, affinity=16)}
    assert list(rows) == ["1", "2", "3", "4", "5a", "5b", "6"]
    assert rows["1"].spec.flags == ("--optim-cpu-offload", "--threads", "1", "--compute-threads", "1")
    assert dict(rows["1"].spec.env) == {"OMP_NUM_THREADS": "1"}
    assert rows["2"].spec.flags[-4:] == ("--threads", "8", "--compute-threads", "8")
    assert dict(rows["2"].spec.env) == {"OMP_NUM_THREADS": "8"}
    assert rows["3"].threads == 8 and "--threads" in rows["3"].spec.flags
    assert rows["4"].spec.flags == ("--optim-cpu-offload",) and rows["4"].threads is None
    assert rows["5a"].spec == rows["5b"].spec and "--autotune" in rows["5a"].spec.flags
    assert "--optim-cpu-offload" not in rows["6"].spec.flags
    with pytest.raises(ValueError, match="rows"):
        sc.build_rows(ranks=1, dtype="fp32", cpu_count=2, affinity=2, rows=["9"])


def test_identical_rows_share_one_measurement() -> None:
    args = _args(ranks="1,2", dtypes="fp32")
    groups, units = suite._units(args, cpu_count=2, affinity=2)
    one, two = groups
    # 2 ranks on 2 CPUs: rows 1, 2, 3 all run --threads 1 with OMP_NUM_THREADS=1: one unit.
    assert two["unit_of"]["1"] == two["unit_of"]["2"] == two["unit_of"]["3"]
    assert len({two["unit_of"][r] for r in ("1", "4", "5a", "6")}) == 4
    # 1 rank: row 2 (OMP_NUM_THREADS=2) and row 3 (OMP_NUM_THREADS=1) differ in the environment.
    assert one["unit_of"]["2"] != one["unit_of"]["3"]
    assert one["unit_of"]["5a"] == one["unit_of"]["5b"] and units[one["unit_of"]["5a"]]["autotune"]
    assert len(units) == 6 + 4


def test_round_order_rotates_every_unit_once() -> None:
    orders = [suite._round_order(5, r, 3) for r in range(3)]
    assert all(sorted(o) == list(range(5)) for o in orders)
    assert len({o[0] for o in orders}) == 3
    assert suite._round_order(0, 0, 1) == []


def _fake_run(times: list[float], tuner: dict | None = None) -> sc.TrainerRun:
    rows = [{"step": i + 1, "step_s": t, "threads": 2 if i < 5 else 1, "chunk_numel": 64,
             "stats": {"adam_kernel_s": t / 2, "materialize_s": t / 4, "drain_s": t / 8}}
            for i, t in enumerate(times)]
    spec = sc.RunSpec(ranks=1, dtype="fp32", flags=(), env=())
    return sc.TrainerRun(spec=spec, command=[], summary={"step_times_s": times, "tuner": tuner or {}},
                         step_rows=rows, wall_s=0.0)


def test_probing_excluded_uses_steps_after_lock_in() -> None:
    times = [9.0, 5.0, 5.0, 5.0, 5.0, 3.0, 1.0, 1.0, 1.0, 1.0]
    run = _fake_run(times, {"probe_steps": 4, "check_steps": 0})
    assert sc.select_steps(run, "all") == list(range(1, 10))
    assert sc.select_steps(run, "locked") == [5, 6, 7, 8, 9]  # step 5 (index 4) probes; index 5 is the switch
    locked = sc.run_stats(run, "locked")
    assert locked["n"] == 5 and locked["step_s_median"] == 1.0 and locked["knobs"] == [[1, 64]]
    assert locked["stages_s"]["adam_kernel_s"] == 0.5
    every = sc.run_stats(run, "all")
    assert every["step_s_mean"] == pytest.approx(sum(times[1:]) / 9) and every["step_s_median"] == 3.0
    hit = _fake_run(times, {"probe_steps": 0, "check_steps": 3})
    assert sc.select_steps(hit, "locked") == [4, 5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="which"):
        sc.select_steps(run, "some")


def test_missing_section_module_is_a_note(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(suite._EXTERNAL, "simulate", ("bench._no_such_module_here", "x"))
    out = suite.run_external("simulate", _args(out_dir=str(tmp_path)))
    assert out["status"] == "skipped" and "not present" in out["note"]


def test_present_section_module_is_called(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = []

    def fake_main(argv):
        calls.append(list(argv))
        out = Path(argv[argv.index("--out-dir") + 1])
        (out / f"{argv[argv.index('--name') + 1]}.json").write_text("{}")
        return 0

    mod = types.ModuleType("bench._fake_section")
    mod.__spec__ = importlib.machinery.ModuleSpec("bench._fake_section", None)
    mod.main = fake_main
    monkeypatch.setitem(sys.modules, "bench._fake_section", mod)
    monkeypatch.setitem(suite._EXTERNAL, "tuner_quality", ("bench._fake_section", "fake"))
    out = suite.run_external("tuner_quality", _args(out_dir=str(tmp_path)))
    assert out["status"] == "ok" and out["files"] == ["fake.json"]
    assert calls == [["--out-dir", str(tmp_path), "--name", "fake", "--log-level", "WARNING"]]


def test_bad_arguments_are_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--rows", "7"], ["--only", "everything"], ["--steps", "1"], ["--model-size", "huge"]):
        with pytest.raises(SystemExit) as exc:
            suite.main(argv)
        assert exc.value.code == 2
    assert "--steps 1" in capsys.readouterr().err


# --------------------------------------------------------------------------- real runs


@pytest.fixture
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow  # a real quick run of the benchmark suite (~9 s)
def test_quick_suite_writes_results(tmp_path: Path, _restore_threads, capsys: pytest.CaptureFixture[str]) -> None:
    """Real trainer runs (rows 1 and 5, one rank, tiny model) and the roofline, into tmp_path."""
    rc = suite.main(["--quick", "--ranks", "1", "--dtypes", "fp32", "--rows", "1,5", "--only", "scenarios,roofline",
                     "--out-dir", str(tmp_path), "--log-level", "WARNING"])
    assert rc == 0, capsys.readouterr().err[-3000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["roofline-quick.json", "roofline-quick.md", "roofline-quick.png",
                     "suite-quick.json", "suite-quick.md", "suite-quick.png"]
    res = json.loads((tmp_path / "suite-quick.json").read_text())
    s = res["scenarios"]
    assert s["errors"] == [] and s["runs"] == 3 and s["config"]["model_size"] == "tiny"
    (g,) = s["groups"]
    assert g["ranks"] == 1 and g["dtype"] == "fp32" and g["params"] == 136_960
    rows = {r["row"]: r for r in g["rows"]}
    assert list(rows) == ["1", "5a-incl", "5a-excl", "5b"]
    assert rows["1"]["ratio_to_row1"] == 1.0 and rows["5b"]["ratio_to_row5b"] == 1.0
    assert rows["1"]["threads_chunk_used"] == [[1, 4194304]] and rows["1"]["compute_threads"] == [1]
    assert "OMP_NUM_THREADS=1" in rows["1"]["mapping"] and rows["1"]["env"] == {"OMP_NUM_THREADS": "1"}
    assert "--threads 1 --compute-threads 1" in rows["1"]["command"]
    for r in rows.values():
        assert r["step_s_median"] > 0 and r["n"] >= 1 and r["stages_s"]["adam_kernel_s"] > 0
    first = rows["5a-incl"]["tuner"][0]
    assert rows["5a-excl"]["n"] == rows["5a-incl"]["n"] - first["probe_steps"]
    # Locked: the winner's setting, and other settings only in the watch's rounds (a pulse of a
    # tiny, noisy step may bring one forward right after lock-in).
    used, tuners = rows["5a-excl"]["threads_chunk_used"], rows["5a-incl"]["tuner"]
    assert [first["winner"]["threads"], first["winner"]["chunk_numel"]] in used or first["switches"]
    assert len(used) == 1 or any(t["watch_steps"] for t in tuners), (used, tuners)
    if first["n_candidates"] > 1:  # one CPU: a single candidate, nothing to tune or cache
        assert first["cache_status"] == "miss" and first["probe_steps"] > 0
        assert rows["5b"]["tuner"][0]["cache_hit"] is True
    assert any("row 7" in n for n in s["notes"])
    md = (tmp_path / "suite-quick.md").read_text()
    assert "Headline" in md and "4 ThreadPlan" not in md and "uptime before" in md
    roof = json.loads((tmp_path / "roofline-quick.json").read_text())
    (series,) = roof["series"]
    assert [p["threads"] for p in series["points"]] == roof["threads"]
    for p in series["points"]:
        assert p["ratio"] == pytest.approx(p["adam_gbps"] / p["probe_gbps"])
    assert (tmp_path / "roofline-quick.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_quick_two_ranks_under_torchrun(tmp_path: Path, _restore_threads) -> None:
    rc = suite.main(["--quick", "--ranks", "2", "--dtypes", "bf16", "--rows", "4", "--only", "scenarios",
                     "--out-dir", str(tmp_path), "--log-level", "WARNING"])
    assert rc == 0
    (g,) = json.loads((tmp_path / "suite-quick.json").read_text())["scenarios"]["groups"]
    assert g["ranks"] == 2 and "torchrun" in g["launcher"]
    (row,) = g["rows"]
    assert row["row"] == "4" and "torch.distributed.run" in row["command"] and len(row["compute_threads"]) == 2


def test_fused_mp_section_runs_the_whole_step_benchmark(tmp_path: Path) -> None:
    """The suite's fused-mp section: bench.membus.fused_mp_optimizer --quick, figures read back."""
    p = suite.build_parser()
    args = suite._resolve(p, p.parse_args(["--out-dir", str(tmp_path), "--quick"]))
    out = suite.run_external("fused_mp", args)
    if out["status"] == "skipped":
        assert "fused-mp kernel is unavailable" in out["note"]
        pytest.skip(out["note"])
    assert out["status"] == "ok", out
    assert out["files"] == ["fused_mp_optimizer-quick.json", "fused_mp_optimizer-quick.md"]
    assert "torch/fused-mp" in out["headline"] and "fused-mp/probe GB/s" in out["headline"]
