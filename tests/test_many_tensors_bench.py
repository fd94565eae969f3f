"""bench.membus.many_tensors: the MoE-shaped preset's shape and a smoke run that writes its tables."""

from __future__ import annotations

import json

import torch

from bench.membus import many_tensors


def test_moe_preset_has_about_twenty_thousand_tensors() -> None:
    shape = many_tensors.PRESETS["moe"]
    assert 18_000 <= shape.num_tensors <= 22_000
    quick = many_tensors.make_params(many_tensors.PRESETS["quick"])
    assert len(quick) == many_tensors.PRESETS["quick"].num_tensors
    assert all(p.grad is not None and p.grad.shape == p.shape for p in quick)


def test_quick_run_compares_with_torch_and_writes_results(tmp_path) -> None:
    previous = torch.get_num_threads()
    try:
        assert many_tensors.main(["--quick", "--threads", "1", "--repeats", "1", "--steps", "1",
                                  "--out-dir", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(previous)
    result = json.loads((tmp_path / "many_tensors-quick.json").read_text())
    assert result["tensors"] == many_tensors.PRESETS["quick"].num_tensors
    (row,) = result["rows"]
    assert row["threads"] == 1 and row["ours_step_s"] > 0 and row["torch_step_s"] > 0
    assert result["build_s"]["ours"] > 0 and result["build_s"]["torch"] > 0
    md = (tmp_path / "many_tensors-quick.md").read_text()
    assert "torch fused AdamW step ms" in md and result["command"] in md
