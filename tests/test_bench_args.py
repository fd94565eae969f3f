"""The benchmarks' --threads never lets a value through that torch.set_num_threads would crash on."""

from __future__ import annotations

import importlib

import pytest

BENCHES = ["bench.bandwidth", "bench.fused_mp", "bench.fused_mp_optimizer", "bench.many_tensors"]


@pytest.mark.parametrize("module", BENCHES)
@pytest.mark.parametrize("value", ["100000", "0", "1,-2", "\u0663", "two", ""])
def test_bad_thread_counts_are_a_usage_error(module: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = importlib.import_module(module).build_parser()
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--threads", value])
    assert exc.value.code == 2
    assert "--threads" in capsys.readouterr().err


@pytest.mark.parametrize("module", BENCHES)
def test_good_thread_counts_parse(module: str) -> None:
    parser = importlib.import_module(module).build_parser()
    assert parser.parse_args(["--threads", "1,2,1024"]).threads == [1, 2, 1024]


@pytest.mark.parametrize("flags", [["--threads", "1"], ["--chunk-numel", "4096"]])
def test_trainer_threads_or_chunk_keep_the_default_kernel(flags: list[str]) -> None:
    """--threads / --chunk-numel set those knobs only: the kernel stays the default ("auto"), as
    without them (they once switched it to torch's silently)."""
    import torch

    from bench import train

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
    from bench import train

    with pytest.raises(SystemExit) as exc:
        train.build_parser().parse_args(["--optim-cpu-offload", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and value in err and "Traceback" not in err


def test_trainer_ctrl_c_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import train

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
    from bench import _dist, train

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
