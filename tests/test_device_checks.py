"""``bench.device_checks``, the GPU checks, run on the CPU: what each asserts holds on the host
path (overlap bitwise overlap off after in-place gradient changes, commits counted), the checks
that need a device say so and pass, and a failed assertion makes the command exit 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import device_checks

REPO = Path(__file__).absolute().parents[1]


def test_races_commits_and_data_edits_hold_on_the_host(capsys) -> None:
    assert device_checks.main(["--device", "cpu", "races", "commits", "data_edits"]) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["check"] for r in results] == ["races", "commits", "data_edits"] and all(r["ok"] for r in results)
    commits = results[1]
    assert all(s == c > 0 for s, c in commits["torch.float32"]["speculated/committed"])


def test_device_only_checks_say_so_on_the_cpu(capsys) -> None:
    assert device_checks.main(["--device", "cpu", "syncs", "scaler", "memory", "timing", "dist"]) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all(r["ok"] and "skipped" in r for r in results), results


def test_a_failed_check_exits_1(monkeypatch, capsys) -> None:
    def broken(device: str) -> dict:
        raise AssertionError("overlap differs from overlap off in ['param 0']")

    monkeypatch.setitem(device_checks.CHECKS, "commits", broken)
    assert device_checks.main(["--device", "cpu", "commits"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result == {"check": "commits", "ok": False, "seconds": result["seconds"],
                      "error": "overlap differs from overlap off in ['param 0']"}


def test_unknown_checks_are_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        device_checks.main(["--device", "cpu", "nope"])
    assert exc.value.code == 2 and "unknown check(s) ['nope']" in capsys.readouterr().err


def test_list_names_every_check(capsys) -> None:
    assert device_checks.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == list(device_checks.CHECKS)


@pytest.mark.slow
def test_dist_under_torchrun_on_gloo() -> None:
    """FSDP2 with overlap and DDP with attach_ddp, one gloo process: bitwise overlap off."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m",
                           "bench.device_checks", "--device", "cpu", "dist"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["fsdp2"]["differs"] == [] and result["ddp"]["differs"] == []
    assert result["fsdp2"]["committed_last_step"] > 0 and result["ddp"]["committed_last_step"] > 0
