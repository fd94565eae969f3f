"""``python -m bench.clip --quick``: the interleaved step benchmark and the trainer part write
their .json/.md into --out-dir (never bench/results by default), with every variant measured,
the ratios against the issue-16 targets, and the overlap run bitwise equal to the plain one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import clip


@pytest.fixture
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_defaults_write_no_committed_results() -> None:
    assert clip.build_parser().get_default("out_dir") is None


@pytest.mark.usefixtures("isolated_trainer", "keep_threads")
def test_quick_run_writes_json_and_markdown(tmp_path: Path) -> None:
    out = tmp_path / "tmp"
    assert clip.main(["--quick", "--out-dir", str(out)]) == 0
    r = json.loads((out / "clip-quick.json").read_text())
    md = (out / "clip-quick.md").read_text()
    assert r["benchmark"] == "bench.clip" and r["quick"] is True and r["command"].endswith("--quick --out-dir " + str(out))
    assert [s["dtype"] for s in r["step"]] == ["fp32", "bf16"]
    for s in r["step"]:
        assert set(s["variants"]) == set(clip.VARIANTS)
        assert all(v["n"] == r["rounds"] * r["steps_per_visit"] and v["min_s"] > 0 for v in s["variants"].values())
        assert len(s["rounds"]) == r["rounds"] and s["clipped_over_unclipped"]["per_round"]["n"] == r["rounds"]
        ratio = s["torch_over_ours_clipped"]
        assert ratio["of_medians"] == s["variants"]["torch_clip"]["median_s"] / s["variants"]["ours_clip"]["median_s"]
        assert set(s["targets"]) == {"clip_overhead_met", "torch_over_ours_met"}
        assert s["grad_norm"]["ours_clip"] > r["max_norm"]  # the clip was active
        for v in ("ours_clip", "torch_clip"):
            assert s["clip_call"][v]["n"] == r["rounds"] * r["steps_per_visit"]
            assert 0 < s["clip_call"][v]["max_s"] <= s["variants"][v]["max_s"]
    rows = r["trainer"]
    assert [(t["ranks"], t["overlap"]) for t in rows] == [(1, False), (1, True)]
    assert rows[0]["commit_rate"] is None and rows[1]["speculated_chunks"] > 0
    assert all(t["bitwise_equal_to_plain"] for t in rows) and all(t["grad_norm_last"] > 0 for t in rows)
    assert "| ours clipped / ours |" in md and "torch clip+fused / ours clipped" in md
    assert md.count("met") >= 4 and "commit rate" in md and "the clip call alone" in md


@pytest.mark.parametrize("argv", [["--dtypes", "fp16"], ["--rounds", "0"], ["--max-norm", "inf"],
                                  ["--train-clip", "0"]])
def test_bad_arguments_are_one_line(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        clip.main(["--quick", *argv])
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err.strip().splitlines()[-1]
