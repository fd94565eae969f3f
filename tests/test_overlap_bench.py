"""``python -m bench.overlap``: the emulated-accelerator benchmark runs end to end on a tiny model
and writes its .json/.md (and plot) with every figure; the hidden fraction, the forward+backward
slowdown and the redo cost are the arithmetic the report says, checked on injected numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from bench.overlap import _main as overlap
from bench.overlap._emulation import redo_kernel_s
from bench.overlap._ranks import slowest
from bench.overlap._report import compare, hidden_fraction, mode_summary
from offload import StageSpan

#: A model of two Linear(64, 64), chunks of 2048 elements (several per layer), two rounds.
TINY = ["--quick", "--layers", "2", "--width", "64", "--chunk-numel", "2048", "--rounds", "2",
        "--calibration-steps", "1", "--ratios", "1,3"]


@pytest.fixture
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _rec(iter_s: float, fb_s: float, *, speculated: int = 2, committed: int = 2, redo: float = 0.0,
         norm: float | None = None) -> dict:
    return {"iter_s": iter_s, "fb_s": fb_s, "exposed_s": iter_s - fb_s, "clip_s": 0.0, "step_s": iter_s - fb_s,
            "redo_kernel_s": redo, "materialize_s": 0.0, "speculated": speculated, "committed": committed,
            "num_chunks": 2, "paused": False, "grad_norm": norm}


def test_defaults_write_no_committed_results() -> None:
    assert overlap.build_parser().get_default("out_dir") is None


@pytest.mark.usefixtures("keep_threads")
def test_quick_run_writes_json_and_markdown(tmp_path: Path) -> None:
    out = tmp_path / "ov"
    assert overlap.main([*TINY, "--out-dir", str(out)]) == 0
    r = json.loads((out / "overlap-quick.json").read_text())
    md = (out / "overlap-quick.md").read_text()
    assert r["benchmark"] == "bench.overlap" and r["quick"] is True and r["modes"] == ["off", "on"]
    assert r["command"] == "python -m bench.overlap " + " ".join([*TINY, "--out-dir", str(out)])
    assert r["params"] == 2 * (64 * 64 + 64) and r["ranks"] == 1 and r["optimizer_threads"] == 1
    assert [d["dtype"] for d in r["dtypes"]] == ["fp32", "bf16"]
    assert all(d["step_s"]["n"] == 1 and d["step_s"]["median"] > 0 for d in r["dtypes"])
    assert [(c["dtype"], c["clip"], c["ratio"]) for c in r["cases"]] == [
        (d, clip, ratio) for d in ("fp32", "bf16") for clip in (None, 1.0) for ratio in (1.0, 3.0)]
    for c in r["cases"]:
        assert set(c["modes"]) == {"off", "on"} and set(c["compare"]) == {"on"}
        assert len(c["rounds"]) == 2 and all(len(rnd[m]) == 1 for rnd in c["rounds"] for m in ("off", "on"))
        calibrated = next(d for d in r["dtypes"] if d["dtype"] == c["dtype"])["step_s"]["median"]
        assert c["backward_wait_s"] == pytest.approx(c["ratio"] * calibrated)
        assert c["params_equal_to_off"] is True  # overlap is exact: same parameters as off
        for name, m in c["modes"].items():
            assert m["iterations"] == 2 and m["iter_s"]["n"] == 2
            assert set(m) >= {"fb_s", "exposed_s", "commit_rate", "redone_chunks_per_step", "host_bytes_per_param"}
            assert m["committed_chunks"] <= m["speculated_chunks"]
        assert c["modes"]["off"]["speculated_chunks"] == 0 and c["modes"]["off"]["commit_rate"] is None
        assert c["modes"]["on"]["host_bytes_per_param"] > c["modes"]["off"]["host_bytes_per_param"]  # backups
        if c["clip"] is None:  # nothing changes the gradients after backward: every early chunk commits
            assert c["modes"]["on"]["commit_rate"] == 1.0 and c["compare"]["on"]["redo_cost_s"] is None
        else:
            assert c["modes"]["on"]["grad_norm_min"] > c["clip"]  # every step clips
        k = c["compare"]["on"]
        assert set(k) >= {"hidden_fraction", "fb_slowdown", "exposed_delta_s", "redo_cost_s", "redo_steps"}
        assert k["per_round_hidden_fraction"] == [
            hidden_fraction(rnd["off"][0]["iter_s"], rnd["on"][0]["iter_s"], rnd["off"][0]["exposed_s"])
            for rnd in c["rounds"]]
    assert "| case | mode | bwd/step |" in md and "hidden fraction" in md and "What this measures" in md
    assert "What it cannot measure" in md and r["machine"]["cpu_model"] in md and r["command"] in md
    assert "1 rank (`--ranks 2` runs two side by side)" in md
    if r["plot"] is not None:
        assert Path(r["plot"]) == out / "overlap-quick.png" and Path(r["plot"]).stat().st_size > 0


@pytest.mark.usefixtures("keep_threads")
def test_one_mode_alone_is_reported_without_comparison(tmp_path: Path) -> None:
    argv = [*TINY, "--overlap", "on", "--dtypes", "fp32", "--clip", "off", "--ratios", "1", "--out-dir", str(tmp_path)]
    assert overlap.main(argv) == 0
    r = json.loads((tmp_path / "overlap-quick.json").read_text())
    assert r["modes"] == ["on"] and len(r["cases"]) == 1
    c = r["cases"][0]
    assert set(c["modes"]) == {"on"} and c["compare"] == {} and c["params_equal_to_off"] is None
    assert r["plot"] is None  # nothing compared, nothing to plot
    assert "| case | mode | bwd/step | bwd wait ms | iteration |" in (tmp_path / "overlap-quick.md").read_text()


@pytest.mark.usefixtures("keep_threads")
def test_drain_threads_apart_from_backward_threads(tmp_path: Path) -> None:
    """--threads 2 --backward-threads 1: every mode's step() on 2 threads, the overlapped mode's
    early chunks on 1; still bitwise the plain run, and the report names both counts."""
    argv = [*TINY, "--threads", "2", "--backward-threads", "1", "--dtypes", "fp32", "--clip", "off",
            "--ratios", "1", "--out-dir", str(tmp_path)]
    assert overlap.main(argv) == 0
    r = json.loads((tmp_path / "overlap-quick.json").read_text())
    assert r["optimizer_threads"] == 2 and r["backward_threads"] == 1
    assert r["cases"][0]["params_equal_to_off"] is True
    md = (tmp_path / "overlap-quick.md").read_text()
    assert "OffloadSettings(threads=2, chunk_numel=2048))`, overlapped with `backward_threads=1`" in md


def test_two_ranks_side_by_side_report_the_slowest_rank(tmp_path: Path) -> None:
    """--ranks 2: two torchrun ranks (gloo) run the cases side by side, each on its share of the
    CPUs; every record kept is one rank's, the slowest of its iteration; both ranks' parameters
    equal overlap off."""
    argv = [*TINY, "--dtypes", "bf16", "--clip", "off", "--ratios", "1", "--ranks", "2", "--out-dir", str(tmp_path)]
    assert overlap.main(argv) == 0
    r = json.loads((tmp_path / "overlap-quick.json").read_text())
    md = (tmp_path / "overlap-quick.md").read_text()
    assert r["ranks"] == 2 and len(r["rank_cpus"]) == 2 and all(r["rank_cpus"])
    assert r["command"] == "python -m bench.overlap " + " ".join(argv)
    (c,) = r["cases"]
    assert c["params_equal_to_off"] is True and c["modes"]["on"]["commit_rate"] == 1.0
    assert {rec["rank"] for rnd in c["rounds"] for m in ("off", "on") for rec in rnd[m]} <= {0, 1}
    assert "2 ranks (torchrun, gloo) side by side" in md


def test_slowest_rank_record_is_kept() -> None:
    a = [{"off": [_rec(0.10, 0.08)], "on": [_rec(0.09, 0.08)]}]
    b = [{"off": [_rec(0.12, 0.09)], "on": [_rec(0.08, 0.07)]}]
    (merged,) = slowest([a, b])
    assert merged["off"][0]["iter_s"] == 0.12 and merged["off"][0]["rank"] == 1
    assert merged["on"][0]["iter_s"] == 0.09 and merged["on"][0]["rank"] == 0


def test_hidden_fraction_arithmetic() -> None:
    assert hidden_fraction(0.100, 0.080, 0.040) == pytest.approx(0.5)  # 20 of the 40 ms step hidden
    assert hidden_fraction(0.100, 0.100, 0.040) == 0.0
    assert hidden_fraction(0.100, 0.120, 0.040) == pytest.approx(-0.5)  # slower than off
    assert math.isnan(hidden_fraction(0.1, 0.1, 0.0))


def test_compare_on_injected_rounds() -> None:
    # Round 1: off 100 ms (60 fwd+bwd, 40 exposed), on 80 ms (66 + 14): hides 0.5 of the step.
    # Round 2: off 110 (70 + 40), on 120 (70 + 50) with every chunk redone: -0.25, redo cost 10 ms.
    rounds = [
        {"off": [_rec(0.100, 0.060, speculated=0, committed=0)], "on": [_rec(0.080, 0.066)]},
        {"off": [_rec(0.110, 0.070, speculated=0, committed=0)],
         "on": [_rec(0.120, 0.070, committed=0, redo=0.004, norm=5.0)]},
    ]
    k = compare(rounds, "on")
    assert k["per_round_hidden_fraction"] == pytest.approx([0.5, -0.25])
    assert k["hidden_fraction"]["median"] == pytest.approx(0.125) and k["hidden_fraction"]["n"] == 2
    assert k["hidden_fraction"]["min"] == pytest.approx(-0.25)
    assert k["fb_slowdown"]["median"] == pytest.approx((1.1 + 1.0) / 2)
    assert k["exposed_delta_s"]["median"] == pytest.approx((-0.026 + 0.010) / 2)
    assert k["redo_steps"] == 1 and k["redo_cost_s"] == pytest.approx(0.010) and k["redo_kernel_s"] == 0.004
    # Of the medians: off 105 ms, on 100 ms, off exposed 40 ms.
    assert k["hidden_fraction_of_medians"] == pytest.approx(0.125)
    on = mode_summary(rounds, "on")
    assert on["commit_rate"] == pytest.approx(0.5) and on["redone_chunks_per_step"] == pytest.approx(1.0)
    assert on["grad_norm_min"] == 5.0 and on["iter_s"]["median"] == pytest.approx(0.100)
    assert mode_summary(rounds, "off")["commit_rate"] is None


def test_redo_kernel_time_counts_second_runs_only() -> None:
    spans = [StageSpan("adam_kernel", 1, -0.050, -0.040), StageSpan("adam_kernel", 0, -0.020, -0.010),
             StageSpan("materialize", 1, 0.001, 0.002), StageSpan("adam_kernel", 1, 0.003, 0.013),
             StageSpan("adam_kernel", 2, 0.013, 0.020)]
    assert redo_kernel_s(spans) == pytest.approx(0.010)  # chunk 1 ran twice; chunk 2 only in step()
    assert redo_kernel_s([]) == 0.0


@pytest.mark.parametrize("argv", [["--ratios", "0"], ["--dtypes", "fp16"], ["--rounds", "0"],
                                  ["--chunk-numel", "10"], ["--overlap", "maybe"], ["--max-norm", "inf"],
                                  ["--threads", "0"], ["--backward-threads", "2", "--threads", "1"]])
def test_bad_arguments_are_one_line(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        overlap.main(["--quick", *argv])
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err.strip().splitlines()[-1]
