"""``python -m bench.membus.bandwidth --quick`` runs end to end, and its probes move the bytes they claim."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from bench.membus import bandwidth
from bench.membus._stream import PROBE_BYTES_PER_ELEMENT, ProbeBuffers, c_kernel_status


def _reference_update(b: ProbeBuffers) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The probes' update, computed out of place in float64 from copies of the buffers."""
    p, g, m, v = (t.double() for t in (b.p, b.g, b.m, b.v))
    m = m + 0.1 * (g - m)
    v = v + 1e-3 * g * g
    return p - 1e-6 * m * v, m, v


@pytest.mark.parametrize("probe", sorted(PROBE_BYTES_PER_ELEMENT))
@pytest.mark.parametrize("threads", [1, 3])
def test_probe_updates_every_element_once(probe: str, threads: int) -> None:
    b = ProbeBuffers(10_007, seed=3)  # not a multiple of the C kernel's 64-element split
    if probe not in b.probes:
        pytest.skip(f"probe {probe} unavailable here: {c_kernel_status()}")
    g_before = b.g.clone()
    want_p, want_m, want_v = _reference_update(b)
    sample = b.run(probe, threads)
    assert torch.equal(b.g, g_before)  # read-only stream
    for got, want in ((b.p, want_p), (b.m, want_m), (b.v, want_v)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert sample.bytes_moved == PROBE_BYTES_PER_ELEMENT[probe] * 10_007
    assert sample.threads == threads and sample.seconds > 0 and sample.gbps > 0


def test_unknown_probe_is_named() -> None:
    with pytest.raises(ValueError, match="'nope'"):
        ProbeBuffers(16).run("nope", 1)


def test_step_bytes_per_param() -> None:
    # fp32 on the CPU: in place, the kernel's bytes only; on CUDA the copies add theirs.
    assert bandwidth.step_bytes_per_param("fp32") == {"d2h": 0, "adam_kernel": 28, "materialize": 0, "total": 28}
    assert bandwidth.step_bytes_per_param("fp32", device="cuda") == {
        "d2h": 8, "adam_kernel": 28, "materialize": 8, "total": 44}
    assert bandwidth.step_bytes_per_param("bf16")["total"] == 40


def test_full_run_refuses_small_models(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bandwidth.main(["--sizes", "small"])
    assert exc.value.code == 2 and "50,000,000" in capsys.readouterr().err


def test_quick_run_writes_valid_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    threads_before = torch.get_num_threads()
    assert bandwidth.main(["--quick", "--threads", "1,2", "--out-dir", str(tmp_path)]) == 0
    assert torch.get_num_threads() == threads_before
    result = json.loads((tmp_path / "bandwidth-quick.json").read_text())  # strict JSON: no NaN
    md = (tmp_path / "bandwidth-quick.md").read_text()
    assert "adam_kernel / probe" in md and result["machine"]["cpu_model"] in md
    assert result["config"]["quick"] and result["config"]["threads"] == [1, 2]
    assert result["machine"]["torch"] == torch.__version__
    assert [(r["model_size"], r["dtype"]) for r in result["runs"]] == [("tiny", "fp32"), ("tiny", "bf16")]
    for run in result["runs"]:
        assert run["params"] == bandwidth.preset("tiny").num_params
        points = {(p["threads"], p["chunk_numel"]) for p in run["points"]}
        assert points == {(t, c) for t in (1, 2) for c in result["config"]["chunks"]}
        for p in run["points"]:
            assert p["step_s"]["n"] == result["config"]["repeats"] * result["config"]["steps_per_point"]
            assert p["num_chunks"] >= 1
            assert p["adam_gbps"]["median"] > 0 and p["step_gbps"]["median"] > 0
        probes = {(p["threads"], p["probe"]) for p in run["probes"]}
        assert {t for t, _ in probes} == {1, 2}
        assert [p["threads"] for p in run["per_thread"]] == [1, 2]
        for row in run["per_thread"]:
            assert math.isfinite(row["ratio"]) and row["ratio"] > 0
            assert row["probe_gbps"] == max(p["gbps"]["median"] for p in run["probes"] if p["threads"] == row["threads"])
        h = run["headline"]
        assert h["target"] == 0.9 and h["step_over_kernel"] > 0
        # A smoke run judges no target, whatever its figures.
        assert h["verdict"] == "smoke run" and h["meets_target"] is None and h["meets_step_target"] is None
    out = capsys.readouterr().out
    headlines = [line for line in out.splitlines() if "headline:" in line]
    assert len(headlines) == 2 and all("not judged: --quick is a smoke run" in line for line in headlines), out
    assert "NOT met" not in out and "not judged: --quick is a smoke run" in md and "not met" not in md


@pytest.mark.parametrize(("ratio", "verdict", "meets"), [(0.95, "met", True), (0.5, "not met", False),
                                                         (1.715, "noisy", None)])
def test_the_headline_judges_only_a_ratio_the_probe_allows(ratio: float, verdict: str, meets: bool | None) -> None:
    """The kernel moves the probe's bytes and computes on top: above 1 it did not win, the machine's
    bandwidth moved between the interleaved measurements, and the run says so instead of "met"."""
    h = {"target": bandwidth.TARGET_RATIO, **bandwidth.judge(ratio, 1.05, quick=False)}
    assert h["verdict"] == verdict and h["meets_target"] is meets and h["meets_step_target"] is True
    text = bandwidth.verdict_text(h)
    if verdict == "noisy":
        assert "not judged" in text and "re-measure" in text and "met" not in text
    else:
        assert text == f"target 0.9: {'met' if meets else 'NOT met'}"
    assert bandwidth.judge(ratio, 1.05, quick=True)["verdict"] == "smoke run"
