"""The benchmarks' --threads never lets a value through that torch.set_num_threads would crash on."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench._cli import command_module

BENCHES = ["bench.membus.bandwidth", "bench.membus.fused_mp", "bench.membus.fused_mp_optimizer",
           "bench.membus.many_tensors"]


@pytest.mark.parametrize("module", BENCHES)
@pytest.mark.parametrize("value", ["100000", "0", "1,-2", "\u0663", "two", ""])
def test_bad_thread_counts_are_a_usage_error(module: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = command_module(module).build_parser()
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--threads", value])
    assert exc.value.code == 2
    assert "--threads" in capsys.readouterr().err


@pytest.mark.parametrize("module", BENCHES)
def test_good_thread_counts_parse(module: str) -> None:
    parser = command_module(module).build_parser()
    assert parser.parse_args(["--threads", "1,2,1024"]).threads == [1, 2, 1024]


@pytest.mark.parametrize("flags", [["--threads", "1"], ["--chunk-numel", "4096"]])
def test_trainer_threads_or_chunk_keep_the_default_kernel(flags: list[str]) -> None:
    """--threads / --chunk-numel set those knobs only: the kernel stays the default ("auto"), as
    without them (they once switched it to torch's silently)."""
    import torch

    from bench.train import _main as train

    parser = train.build_parser()
    model = torch.nn.Linear(8, 8)
    plain = train._make_optimizer(parser.parse_args(["--optim-cpu-offload"]), model, {})
    flagged = train._make_optimizer(parser.parse_args(["--optim-cpu-offload", *flags]), model, {})
    try:
        assert flagged.settings.kernel == plain.settings.kernel
    finally:
        plain.close()
        flagged.close()


@pytest.mark.parametrize(("flag", "value"), [("--threads", "5000"), ("--chunk-numel", "3"),
                                             ("--compute-threads", "5000"), ("--weight-decay", "-5"),
                                             ("--weight-decay", "nan")])
def test_trainer_bad_values_are_one_line_usage_errors(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.train import _main as train

    with pytest.raises(SystemExit) as exc:
        train.build_parser().parse_args(["--optim-cpu-offload", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and value in err and "Traceback" not in err


def test_trainer_ctrl_c_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.train import _main as train

    def interrupted(args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "run", interrupted)
    assert train.main(["--steps", "1"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["python -m bench.train: interrupted"]


def test_trainer_ctrl_c_under_a_launcher_names_the_rank(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The rank is read before run() tears the process group down (it was lost there)."""
    import offload
    from bench.train import _dist
    from bench.train import _main as train

    torn_down = []

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # Ctrl-C while training (the first call of the run's body)

    monkeypatch.setattr(_dist, "setup", lambda *a, **k: _dist.DistInfo(
        rank=0, world_size=2, local_rank=0, local_world_size=2, backend="gloo"))
    monkeypatch.setattr(_dist, "teardown", torn_down.append)
    monkeypatch.setattr(offload, "plan_cpu_threads", interrupted)
    assert train.main(["--steps", "1"]) == 130
    assert len(torn_down) == 1
    assert capsys.readouterr().err.strip().splitlines() == ["python -m bench.train: interrupted (rank 0)"]


ALL_PARSERS = ["membus.bandwidth", "clip", "deepspeed_step", "fsdp_memory", "membus.fused_mp", "membus.fused_mp_optimizer",
               "membus.grad_stats", "membus.many_tensors",
               "simulate", "stock_threads", "suite", "train", "tuner_quality"]


def _option_helps(parser) -> dict[str, str]:
    """Each option's help as --help prints it, on one line."""
    helps: dict[str, str] = {}
    current = None
    for line in parser.format_help().split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            helps[current] = line
        elif current is not None:
            helps[current] += " " + line.strip()
    return {k: " ".join(v.split()) for k, v in helps.items()}


@pytest.mark.parametrize("module", ALL_PARSERS)
def test_help_shows_each_default_once(module: str) -> None:
    """A hand-written "(default X; Y with --quick)" is not followed by argparse's "(default: None)",
    and every flag whose default means something shows it."""
    import argparse

    parser = command_module(f"bench.{module}").build_parser()
    helps = _option_helps(parser)
    for action in parser._actions:
        if action.help is argparse.SUPPRESS or action.dest == "help":
            continue
        text = helps[action.option_strings[0]]
        assert text.count("(default") <= 1 and "(default: None)" not in text and "(default: False)" not in text, text
        if action.default not in (None, False, ""):
            assert "default" in text, text


def test_list_defaults_are_shown_as_typed() -> None:
    from bench.membus import bandwidth

    assert "(default: fp32,bf16)" in _option_helps(bandwidth.build_parser())["--dtypes"]


def test_trainer_seq_len_above_the_model_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.train import _main as train

    with pytest.raises(SystemExit) as exc:
        train.main(["--model-size", "tiny", "--seq-len", "100000", "--steps", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    max_len = train.preset("tiny").max_seq_len
    assert err[-1] == (f"python -m bench.train: error: --seq-len 100000: the tiny model's max_seq_len is "
                       f"{max_len}; expected 1 to {max_len}")


def test_trainer_overlap_under_a_launcher_without_fsdp_is_a_usage_error(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.train import _dist
    from bench.train import _main as train

    monkeypatch.setattr(_dist, "setup", lambda *a, **k: _dist.DistInfo(
        rank=0, world_size=2, local_rank=0, local_world_size=2, backend="gloo"))
    monkeypatch.setattr(_dist, "teardown", lambda info: None)
    assert train.main(["--optim-cpu-offload", "--overlap-backward", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m bench.train: error: --overlap-backward with world size 2")


#: (module, flag, what the flag names): every output path a command line takes.
OUTPUT_FLAGS = [("train", "--trace-dir", "dir"), ("train", "--summary-json", "file"), ("train", "--cache", "file"),
                ("tuner_quality", "--trace-dir", "dir"), ("suite", "--keep-runs", "dir"),
                *((m, "--out-dir", "dir") for m in ALL_PARSERS if m != "train")]


@pytest.mark.parametrize(("module", "flag", "kind"), OUTPUT_FLAGS)
def test_output_paths_never_make_a_folder_tree_outside_the_working_directory(
        module: str, flag: str, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A typo such as /nonexistent/a/b is refused as it is parsed (one usage line naming the
    path, exit status 2, nothing made); below the working directory missing folders are made,
    elsewhere only the last one."""
    parser = command_module(f"bench.{module}").build_parser()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    leaf = "x.json" if kind == "file" else "c"
    bad = tmp_path / "missing" / "b" / leaf
    with pytest.raises(SystemExit) as exc:
        parser.parse_args([flag, str(bad)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    missing = bad.parent if kind == "dir" else bad.parent.parent  # a file's folder may be made, not above it
    assert err.startswith(f"{parser.prog}: error: argument {flag}: '{bad}': {missing} does not exist"), err
    assert not (tmp_path / "missing").exists()
    for good in (tmp_path / leaf, Path("runs") / "new" / leaf):  # the last folder only; any below cwd
        assert getattr(parser.parse_args([flag, str(good)]), flag[2:].replace("-", "_")) == good
