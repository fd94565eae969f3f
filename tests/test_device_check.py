"""``bench/device_check.sh``: without a GPU it says so in one line and exits 0, writing nothing;
its plan (``DEVICE_CHECK_PLAN=1``) names test files that exist, flags the benchmarks accept, every
check of ``bench.device_checks``, and timeouts that fit the 8-minute budget."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.device_checks import _main as device_checks
from bench.membus import bandwidth
from bench.train import _main as train

REPO = Path(__file__).absolute().parents[1]
SCRIPT = REPO / "bench" / "device_check.sh"


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHON": sys.executable, "DEVICE_CHECK_OUT": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=full, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_a_gpu_it_prints_one_line_and_exits_0(tmp_path: Path) -> None:
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0] and "skipped" in lines[0], proc.stdout
    assert not (tmp_path / "out").exists()


def _python_without_torch(tmp_path: Path) -> Path:
    fake = tmp_path / "python-without-torch"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    return fake


def test_a_python_without_torch_on_a_gpu_machine_is_one_line_and_status_2(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"  # an nvidia-smi: the machine shows an NVIDIA device
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    proc = _run(tmp_path, PYTHON=str(_python_without_torch(tmp_path)),
                PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and "cannot import torch" in proc.stderr


_GPU_VISIBLE = shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists()


@pytest.mark.skipif(_GPU_VISIBLE, reason="checks a machine that shows no NVIDIA device")
@pytest.mark.parametrize("python", ["without-torch", "missing"])
def test_without_a_gpu_any_python_says_so_and_exits_0(tmp_path: Path, python: str) -> None:
    """Issue 24: without a GPU the script says so and exits 0, also where PYTHON has no torch
    (the default python3 of a CPU machine) or is not there at all."""
    path = _python_without_torch(tmp_path) if python == "without-torch" else tmp_path / "no-python"
    proc = _run(tmp_path, PYTHON=str(path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0] and "skipped" in lines[0], proc.stdout
    assert not (tmp_path / "out").exists()


def test_the_plan_fits_8_minutes_and_every_command_parses(tmp_path: Path) -> None:
    proc = _run(tmp_path, DEVICE_CHECK_PLAN="1")
    assert proc.returncode == 0, proc.stderr
    steps = [line.split("|", 2) for line in proc.stdout.splitlines()]
    names = [name for name, _, _ in steps]
    # issue 40: the native kernel built before anything timed, the 1B timing in a step of its own;
    # then issue 24's order: races and commits, NCCL, scaler/memory, timing, copy throughput, the tests
    assert names[:7] == ["prebuild", "checks-races", "checks-dist", "checks-scale", "checks-timing", "bandwidth",
                         "pytest"], names
    assert "train-overlap-clip" in names
    assert shlex.split(steps[0][2])[5:] == ["prebuild"], steps[0]
    assert shlex.split(steps[1][2])[5:8] == ["races", "producer", "commits"], steps[1]
    assert shlex.split(steps[4][2])[5:] == ["timing"], steps[4]
    checked: list[str] = []
    assert sum(int(limit) for _, limit, _ in steps) <= 8 * 60 - 20  # 20 s for the environment lines
    out = str(tmp_path / "out")
    for name, _, command in steps:
        words = shlex.split(command)
        assert words[:2] == [sys.executable, "-m"], command
        module, rest = words[2], words[3:]
        if module == "torch.distributed.run":  # torchrun around the checks that need a process group
            at = rest.index("-m")
            assert rest[:at] == ["--nproc-per-node", "1"], command
            module, rest = rest[at + 1], rest[at + 2:]
        if module == "pytest":
            files = [w for w in rest if w.startswith("tests/")]
            assert {"tests/test_cuda_path.py", "tests/test_cuda_schedule.py"} <= set(files)
            assert all((REPO / f).is_file() for f in files) and "cuda" in rest and "-rs" in rest
        elif module == "bench.device_checks":
            assert rest[:2] == ["--device", "cuda"], command
            assert set(rest[2:]) <= set(device_checks.CHECKS), command
            checked += rest[2:]
        elif module == "bench.membus.bandwidth":
            args = bandwidth.build_parser().parse_args(rest)
            assert args.device == "cuda" and str(args.out_dir) == out
        else:
            assert module == "bench.train", command
            args = train.build_parser().parse_args(rest)
            assert args.device == "cuda" and args.optim_cpu_offload and args.clip_grad_norm == 1.0
            assert str(args.summary_json).startswith(out)
    assert sorted(checked) == sorted(device_checks.CHECKS)  # every check runs, once
    overlap = train.build_parser().parse_args(shlex.split(dict((n, c) for n, _, c in steps)["train-overlap-clip"])[3:])
    assert overlap.overlap_backward


def test_a_step_past_its_limit_dumps_every_threads_stack(tmp_path: Path) -> None:
    """Issue 40: `timeout` killed a hung step without a trace. The script's timeout sends SIGABRT
    first and exports PYTHONFAULTHANDLER=1, so Python writes every thread's stack before it dies;
    run here with the script's own options around a hung python, 5 s limit (with 1 s, a loaded
    machine sometimes killed the child before its interpreter had started its second thread)."""
    text = SCRIPT.read_text()
    assert "export PYTHONFAULTHANDLER=1" in text
    (line,) = [line for line in text.splitlines() if line.strip().startswith("timeout ")]
    words = shlex.split(line)
    options = words[:words.index("$limit")]
    wrapper = words[words.index("$limit") + 1:words.index("$PYTHON")]  # the shell that takes timeout's first signal
    assert "ABRT" in options and wrapper, line
    hung = ("import threading, time\n"
            "threading.Thread(target=time.sleep, args=(60,), name='copies', daemon=True).start()\n"
            "time.sleep(60)\n")
    proc = subprocess.run([*options, "5", *wrapper, sys.executable, "-c", hung], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert proc.returncode == 124, (proc.returncode, proc.stderr)
    assert "Fatal Python error: Aborted" in proc.stderr and proc.stderr.count("hread 0x") >= 2, proc.stderr
