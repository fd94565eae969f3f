"""Every benchmark's ``main`` is one call of ``bench._cli.bench_main`` (most are made by
``bench_entry``): bad values are refused before a result folder exists, and the report is written
and named the same way by all of them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from bench._cli import bench_main, command_module

#: The benchmarks whose main() is bench_main (bench.simulate writes no files for --quick and
#: bench.train is the trainer: their mains differ on purpose).
BENCHES = ["membus.bandwidth", "clip", "deepspeed_step", "membus.follow_edits", "fsdp_memory", "membus.fused_mp",
           "membus.state_dtype", "state_dtype_loss", "membus.fused_mp_optimizer", "membus.grad_stats",
           "membus.many_tensors", "overlap", "stock_threads", "suite", "tuner_quality"]


@pytest.mark.parametrize("name", BENCHES)
def test_every_benchmark_main_is_bench_main(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = command_module(f"bench.{name}")
    calls: list[dict[str, Any]] = []

    def fake(argv: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append({"argv": argv, **kwargs})
        return {"header": [], "written": []}  # enough for the suite's own printing

    # (through bench_entry, which calls bench._cli.bench_main, or a main of the module's own)
    import bench._cli

    monkeypatch.setattr(bench._cli, "bench_main", fake)
    if hasattr(module, "bench_main"):
        monkeypatch.setattr(module, "bench_main", fake)
    assert module.main(["--quick"] if name != "fsdp_memory" else []) == 0
    assert len(calls) == 1
    assert calls[0]["build_parser"] is module.build_parser and calls[0]["run"] is module.run


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.fake")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--name", default="fake")
    return p


def _resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: expected an integer >= 1")


def test_a_refused_value_makes_no_result_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    ran = []
    with pytest.raises(SystemExit) as exc:
        bench_main(["--rounds", "0"], build_parser=_parser, run=lambda a, v: ran.append(a) or {},
                   resolve=_resolve, render_markdown=lambda r: "")
    assert exc.value.code == 2 and not ran and not (tmp_path / "runs").exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "python -m bench.fake: error: --rounds 0: expected an integer >= 1"


def test_results_are_written_and_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = bench_main(["--out-dir", str(tmp_path)], build_parser=_parser,
                        run=lambda args, argv: {"argv": argv, "rounds": args.rounds},
                        resolve=_resolve, render_markdown=lambda r: f"# fake, {r['rounds']} round\n")
    assert result == {"argv": ["--out-dir", str(tmp_path)], "rounds": 1}
    assert json.loads((tmp_path / "fake.json").read_text()) == result
    assert (tmp_path / "fake.md").read_text() == "# fake, 1 round\n"
    assert capsys.readouterr().out.splitlines() == [
        "# fake, 1 round", f"wrote {tmp_path / 'fake.json'} and {tmp_path / 'fake.md'}"]


def test_stock_threads_refuses_a_bad_count_like_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from bench import stock_threads

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        stock_threads.main(["--rounds", "0"])
    assert exc.value.code == 2 and not (tmp_path / "runs").exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "python -m bench.stock_threads: error: --rounds 0: expected an integer >= 1"
