"""``python -m bench.stock_threads``: runs end to end (tiny sizes) and writes its two result files.

Wall-clock figures of this machine are never asserted; the simulated nodes' figures come from the
step-time model (the model is the clock), so their ordering is deterministic and checked."""

from __future__ import annotations

import json
from pathlib import Path

from bench import stock_threads


def test_bench_runs_and_the_tuner_beats_the_launcher_default_on_simulated_nodes(tmp_path: Path) -> None:
    argv = ["--params", "100000", "--rounds", "2", "--seeds", "2", "--sim-params", "100000000",
            "--out-dir", str(tmp_path)]
    assert stock_threads.main(argv) == 0
    result = json.loads((tmp_path / "stock_threads.json").read_text())
    assert "launcher | 1 |" in (tmp_path / "stock_threads.md").read_text()
    here = result["here"]
    assert set(here["variants"]) == {"launcher", "static_rule", "tuned"}
    assert here["variants"]["launcher"]["threads"] == 1 and all(v["n"] == 2 for v in here["variants"].values())
    assert here["tuner"]["state"] == "locked"
    assert [s["node"] for s in result["simulated"]] == list(stock_threads.SIM_NODES)
    for s in result["simulated"]:
        # The tuner's choices are candidates of the space, none slower than the static plan by more
        # than the lock-in rule allows, and all far faster than one thread per rank.
        assert s["tuned"]["median_true_s"] <= s["variants"]["static_plan"]["true_s"] * 1.05, s
        assert s["ratios"]["launcher"] > 2.0, s
        assert s["best_s"] == min(s["candidates_s"].values())
