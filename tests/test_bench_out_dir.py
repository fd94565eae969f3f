"""Benchmarks write a new runs/bench/<name>-N unless --out-dir is given: a README command never
overwrites the committed results in bench/results."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from bench._args import new_result_dir, resolve_out_dir
from bench._cli import command_module
from bench.membus import many_tensors

REPO = Path(__file__).absolute().parents[1]


def test_new_result_dir_numbers_from_1(tmp_path: Path) -> None:
    root = tmp_path / "runs" / "bench"
    assert new_result_dir("x", root) == root / "x-1"
    assert new_result_dir("x", root) == root / "x-2"
    assert new_result_dir("y", root) == root / "y-1" and (root / "y-1").is_dir()


def test_an_explicit_out_dir_is_kept(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(out_dir=tmp_path / "mine")
    assert resolve_out_dir(args, "n") == tmp_path / "mine" and not (tmp_path / "runs").exists()
    args = argparse.Namespace(out_dir=None)
    assert resolve_out_dir(args, "n") == Path("runs/bench/n-1") and args.out_dir == Path("runs/bench/n-1")


@pytest.mark.parametrize("module", ["membus.bandwidth", "clip", "deepspeed_step", "fsdp_memory", "membus.fused_mp", "membus.fused_mp_optimizer",
                                    "membus.grad_stats", "membus.many_tensors", "stock_threads", "suite", "tuner_quality",
                                    "simulate"])
def test_no_benchmark_defaults_to_bench_results(module: str) -> None:
    parser = command_module(f"bench.{module}").build_parser()
    assert parser.get_default("out_dir") is None


def test_a_run_without_out_dir_leaves_bench_results_alone(tmp_path: Path, monkeypatch) -> None:
    results = REPO / "bench" / "results"
    before = sorted(p.name for p in results.iterdir())
    monkeypatch.chdir(tmp_path)
    previous = torch.get_num_threads()
    try:
        assert many_tensors.main(["--quick", "--threads", "1", "--repeats", "1", "--steps", "1"]) == 0
    finally:
        torch.set_num_threads(previous)
    out = tmp_path / "runs" / "bench" / "many_tensors-quick-1"
    assert json.loads((out / "many_tensors-quick.json").read_text())["tensors"] > 0
    assert sorted(p.name for p in results.iterdir()) == before
