"""``bench.device_checks``, the GPU checks, run on the CPU: what each asserts holds on the host
path (overlap bitwise overlap off after in-place gradient changes, commits counted, delayed
gradients bitwise an independent reference), the checks that need a device say so and pass, any
exception a check raises is reported with its traceback and the next check still runs, the exit
status says whether all passed, and a check that runs too long has every thread's stack dumped."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.device_checks import _main as device_checks
from bench.device_checks._fake_device import FakeDevice

REPO = Path(__file__).absolute().parents[1]


def test_races_commits_and_data_edits_hold_on_the_host(capsys) -> None:
    assert device_checks.main(["--device", "cpu", "races", "commits", "data_edits"]) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["check"] for r in results] == ["races", "commits", "data_edits"] and all(r["ok"] for r in results)
    commits = results[1]
    assert all(s == c > 0 for s, c in commits["torch.float32"]["speculated/committed"])


def test_prebuild_and_producer_delays_hold_on_the_host(capsys) -> None:
    """The prebuild says which kernel runs; the producer-delay loop (backward pre-hooks, no sync)
    equals torch's AdamW on fp32 masters bitwise, with each kernel, and commits every early chunk."""
    assert device_checks.main(["--device", "cpu", "prebuild", "producer"]) == 0
    prebuild, producer = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert prebuild["ok"] and prebuild["auto"] in ("torch", "fused-mp") and prebuild["build_s"] >= 0
    runs = {k: v for k, v in producer.items() if isinstance(v, dict)}
    assert {"torch.float32-torch", "torch.bfloat16-torch", "fake-cuda-torch.bfloat16-torch"} <= set(runs), producer
    for run in runs.values():
        assert run["differs"] == [] and run["delays"] == 4 * 6, run
        speculated, committed = run["speculated/committed"]
        assert speculated == committed > 0, run
    fake = runs["fake-cuda-torch.bfloat16-torch"]  # the CUDA transport, its device order kept
    assert fake["device_order_violations"] == 0 and fake["dropped_waits"] == 0 and fake["produced"] == 8 * 6, fake
    if prebuild["fused_mp"]:  # the native kernel forced, whatever "auto" picks
        assert runs["torch.bfloat16-fused-mp"]["kernel"] == "fused-mp"


def test_gradient_layouts_hold_on_the_host(capsys) -> None:
    """Issue 40's coverage gaps: channels_last gradients, non-contiguous ones (a hook's transposed
    view), accumulation under ``opt.accumulating()``; each bitwise overlap off and torch's AdamW on
    fp32 masters, fp32 and bf16 (bf16 through the CUDA transport over the fake device)."""
    assert device_checks.main(["--device", "cpu", "layouts"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] and list(result["layouts"]) == ["channels_last", "noncontiguous", "accumulation"]
    for layout in result["layouts"]:
        runs = {k: v for k, v in result.items() if k.endswith(("-" + layout + "-torch.float32",
                                                                "-" + layout + "-torch.bfloat16"))
                or k.startswith(layout + "-")}
        assert set(runs) == {f"{layout}-torch.float32", f"fake-cuda-{layout}-torch.bfloat16"}, result
        for run in runs.values():
            assert run["vs_overlap_off"] == [] and run["vs_reference"] == [], run
            speculated, committed = run["speculated/committed"]
            assert speculated == committed > 0, run
    assert result["channels_last-torch.float32"]["grad_strides"][1] == [576, 1, 192, 64]  # NHWC
    assert result["noncontiguous-torch.float32"]["grad_strides"][0] == [1, 256]  # transposed
    assert result["fake-cuda-noncontiguous-torch.bfloat16"]["device_order_violations"] == 0


@pytest.mark.parametrize("layout", ["channels_last", "noncontiguous", "accumulation"])
def test_the_layouts_check_fails_when_one_layouts_result_is_perturbed(layout: str, monkeypatch, capsys) -> None:
    """The seam: one layout's overlapped gradients changed before ``step()`` (a transport that read
    the wrong bits of that layout would do the same); the check reports exactly that layout as
    failed, against overlap off and the reference, and the command exits 1."""
    def fault(name: str, model) -> None:
        if name == layout:
            next(p for p in model.parameters() if p.dim() > 1).grad.mul_(1.5)

    monkeypatch.setitem(device_checks.CHECKS, "layouts", functools.partial(device_checks.check_layouts, fault=fault))
    assert device_checks.main(["--device", "cpu", "--watchdog-s", "0", "layouts"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert not result["ok"] and result["error"].startswith(
        f"AssertionError: gradient layouts failed: ['{layout}-torch.float32', 'fake-cuda-{layout}-torch.bfloat16']: "
        f"{layout}-torch.float32: overlap off differs in ['param 0'"), result["error"]
    assert "the reference in ['param 0'" in result["error"]


def test_the_layouts_check_fails_when_the_transport_drops_the_ready_wait() -> None:
    """The bf16 layouts run the CUDA transport over the fake device: one that drops the d2h
    stream's wait on the ready event reads unfinished (non-contiguous, channels_last) gradients."""
    with pytest.raises(AssertionError, match=r"gradient layouts failed: \['fake-cuda-channels_last-torch.bfloat16'"):
        device_checks.check_layouts("cpu", fake=functools.partial(FakeDevice, drop="ready"))


@pytest.mark.parametrize("drop, says", [
    ("ready", "differs from the reference"),  # the gradient copies read unfinished gradients
    ("write", "copies not in device order"),  # the weight copies may overwrite what backward still reads
])
def test_the_dry_run_fails_when_the_transport_drops_a_wait(drop: str, says: str) -> None:
    """Issue 40, done when: the producer check's dry run runs the CUDA transport over a fake device
    that keeps a GPU's order (``bench.device_checks._fake_device``) and fails when the d2h stream's wait on a
    job's ready event, or the h2d stream's wait on its write event, is dropped. (It ran only the
    host transport before, where neither wait exists, and the transport made its ready event
    with ``torch.cuda`` directly, so a fake device never saw it.)"""
    with pytest.raises(AssertionError, match=f"fake device torch.bfloat16 .*: .*{says}"):
        device_checks.check_producer("cpu", fake=functools.partial(FakeDevice, drop=drop))


def test_the_fake_device_refuses_an_unknown_drop() -> None:
    with pytest.raises(ValueError, match=r"drop='d2h': expected None or one of \('ready', 'write'\)"):
        FakeDevice(drop="d2h")


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
    assert result == {"check": "commits", "ok": False, "seconds": result["seconds"], "traceback": result["traceback"],
                      "error": "AssertionError: overlap differs from overlap off in ['param 0']"}
    assert "in broken" in "\n".join(result["traceback"])


def test_any_exception_is_reported_and_the_next_check_runs(monkeypatch, capsys) -> None:
    """Issue 40: only AssertionError was caught, so a RuntimeError (a CUDA error, a missing
    attribute) skipped every later check. Now each check reports its own failure (type, message,
    traceback tail, and the whole traceback on stderr), the others run, and the status is 1."""
    def raises(device: str) -> dict:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setitem(device_checks.CHECKS, "races", raises)
    monkeypatch.setitem(device_checks.CHECKS, "commits", lambda device: {"fine": True})
    assert device_checks.main(["--device", "cpu", "--watchdog-s", "0", "races", "commits"]) == 1
    captured = capsys.readouterr()
    first, second = [json.loads(line) for line in captured.out.splitlines()]
    assert not first["ok"] and first["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert first["traceback"][-1].startswith("RuntimeError") and len(first["traceback"]) <= 12
    assert second == {"check": "commits", "ok": True, "fine": True, "seconds": second["seconds"]}
    assert "device_checks: races failed" in captured.err and "in raises" in captured.err


def test_a_check_that_runs_too_long_has_every_threads_stack_dumped(monkeypatch, capfd) -> None:
    """The watchdog: a check still running after --watchdog-s has every thread's stack written to
    stderr (faulthandler), before the script's outer timeout would kill it without a trace; the
    check goes on and its result counts."""
    import threading

    def slow(device: str) -> dict:
        helper = threading.Thread(target=time.sleep, args=(1.5,), name="helper")
        helper.start()
        time.sleep(1.0)
        helper.join()
        return {}

    monkeypatch.setitem(device_checks.CHECKS, "commits", slow)
    assert device_checks.main(["--device", "cpu", "--watchdog-s", "0.3", "commits"]) == 0
    captured = capfd.readouterr()
    assert "device_checks: commits started (every thread's stack" in captured.err
    assert captured.err.count("Thread 0x") >= 2 and "in slow" in captured.err, captured.err
    assert json.loads(captured.out)["ok"]


def test_a_negative_watchdog_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        device_checks.main(["--device", "cpu", "--watchdog-s", "-1", "commits"])
    assert exc.value.code == 2 and "--watchdog-s -1: expected seconds >= 0" in capsys.readouterr().err


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
    """FSDP2 with overlap and DDP with attach_ddp, one gloo process: bitwise overlap off; DDP with
    gradient_as_bucket_view=True and DDP accumulating under no_sync: also bitwise the reference."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m",
                           "bench.device_checks", "--device", "cpu", "dist"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["fsdp2"]["differs"] == [] and result["ddp"]["differs"] == []
    assert result["fsdp2"]["committed_last_step"] > 0 and result["ddp"]["committed_last_step"] > 0
    for kind in ("ddp-bucket-view", "ddp-accumulate"):  # gradient_as_bucket_view=True; no_sync + accumulating()
        assert result[kind]["differs"] == [] and result[kind]["vs_reference"] == [], result
        assert result[kind]["committed_last_step"] > 0, result
