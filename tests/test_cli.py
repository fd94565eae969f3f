"""``python -m autotune``: real subprocesses against a temporary cache, plus in-process details."""

from __future__ import annotations

import csv
import io
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from autotune import TraceWriter, TuningCache, knobs
from autotune.report._cli import main

REPO = Path(__file__).resolve().parents[1]


def entry(threads: int, winner_s: float, cpu: str = "Test CPU 9000") -> dict:
    return {
        "winner": {"threads": threads, "chunk_numel": 1 << 20},
        "baseline": {"threads": 1, "chunk_numel": 1 << 22},
        "winner_median_s": winner_s,
        "baseline_median_s": 1.0,
        "measurements": [{"candidate": {"threads": threads, "chunk_numel": 1 << 20}, "samples": [winner_s] * 3}],
        "probe_steps": 10 + threads,
        "created_unix": 1_700_000_000.0 + threads,
        "fingerprint": {"hardware": {"cpu_model": cpu, "affinity_cpus": 16}, "local_world_size": 2},
    }


KEY_A = "a" * 64
KEY_B = "b" * 64


@pytest.fixture
def cache_path(tmp_path: Path) -> Path:
    path = tmp_path / "cache" / "cache.json"
    cache = TuningCache(path)
    assert cache.put(KEY_A, entry(4, 0.5))
    assert cache.put(KEY_B, entry(8, 0.25))
    return path


def run_cli(*args: str, cache: Path | None = None, prefix: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.pop(knobs.CACHE_VAR, None)
    if cache is not None:
        env[knobs.CACHE_VAR] = str(cache)
    return subprocess.run([*prefix, sys.executable, "-m", "autotune", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


# The capabilities that let root read and write through file permissions (capabilities(7)).
_ROOT_WRITE_CAPS = "-dac_override,-dac_read_search,-fowner"


def _as_permission_bound() -> list[str] | None:
    """A command prefix that makes the CLI subprocess obey file permissions, or None if none can.

    Not root: nothing to add. Root (CI runs as root): ``setpriv`` drops the capabilities that
    write through permissions from the child and everything it starts. None when root has no
    working ``setpriv`` (not installed, or no CAP_SETPCAP to shrink the bounding set).
    """
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    prefix = [setpriv, f"--inh-caps={_ROOT_WRITE_CAPS}", f"--bounding-set={_ROOT_WRITE_CAPS}", "--"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    return prefix if probe.returncode == 0 else None


def call(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main(list(args), stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------------------------------------
# Real subprocesses


def test_help() -> None:
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    for command in ("show", "export", "plot", "clear", "--cache"):
        assert command in result.stdout


def test_show_via_environment_variable(cache_path: Path) -> None:
    result = run_cli("show", cache=cache_path)
    assert result.returncode == 0, result.stderr
    assert str(cache_path) in result.stdout and "(2 entries)" in result.stdout
    assert KEY_A[:12] in result.stdout and KEY_B[:12] in result.stdout
    assert "threads=8" in result.stdout and "4.00x" in result.stdout and "Test CPU 9000" in result.stdout


def test_export_csv_via_flag(cache_path: Path) -> None:
    result = run_cli("export", "--format", "csv", "--cache", str(cache_path))
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [r["key"] for r in rows] == [KEY_A, KEY_B]
    assert [int(r["winner.threads"]) for r in rows] == [4, 8]
    assert [float(r["speedup"]) for r in rows] == [pytest.approx(2.0), pytest.approx(4.0)]
    assert rows[0]["fingerprint.hardware.cpu_model"] == "Test CPU 9000"


def test_clear(cache_path: Path) -> None:
    result = run_cli("clear", cache=cache_path)
    assert result.returncode == 0, result.stderr
    assert "removed 2 entries" in result.stdout
    assert TuningCache(cache_path).entries() == {}
    assert json.loads(cache_path.read_text()) == {"schema": 1, "entries": {}}


# ---------------------------------------------------------------------------------------------
# In process


def test_show_key_prefix_prints_the_entry(cache_path: Path) -> None:
    rc, out, _ = call("--cache", str(cache_path), "show", "bbb")
    assert rc == 0
    assert json.loads(out) == {KEY_B: entry(8, 0.25)}
    rc, out, _ = call("show", "--json", "--cache", str(cache_path))
    assert rc == 0 and set(json.loads(out)) == {KEY_A, KEY_B}


def test_unknown_or_ambiguous_key_is_an_error(cache_path: Path) -> None:
    TuningCache(cache_path).put("a" * 63 + "0", entry(2, 0.9))
    rc, _, err = call("show", "zzz", "--cache", str(cache_path))
    assert rc == 1 and "zzz" in err
    rc, _, err = call("clear", "aaa", "--cache", str(cache_path))
    assert rc == 1 and "ambiguous" in err
    assert len(TuningCache(cache_path).entries()) == 3


def test_export_json_to_file(cache_path: Path, tmp_path: Path) -> None:
    target = tmp_path / "export.json"
    rc, out, _ = call("export", "--cache", str(cache_path), "--output", str(target))
    assert rc == 0 and out == ""
    doc = json.loads(target.read_text())
    assert doc["schema"] == 1 and doc["entries"][KEY_A] == entry(4, 0.5)


def test_clear_one_key_and_bad_files(cache_path: Path) -> None:
    bad = cache_path.with_name("cache.json.bad-20240101T000000")
    bad.write_text("{broken")
    rc, out, _ = call("show", "--cache", str(cache_path))
    assert rc == 0 and bad.name in out
    rc, out, _ = call("clear", "aaaa", "--bad", "--cache", str(cache_path))
    assert rc == 0 and "removed 1 entry from" in out
    assert set(TuningCache(cache_path).entries()) == {KEY_B}
    assert not bad.exists()


def test_empty_and_corrupt_cache(tmp_path: Path) -> None:
    rc, out, err = call("show", "--cache", str(tmp_path / "none.json"))
    assert rc == 1 and out == "" and err.strip().endswith("none.json does not exist"), err
    rc, out, err = call("clear", "--cache", str(tmp_path / "none.json"))
    assert rc == 0 and "does not exist" in out and not (tmp_path / "none.json").exists()
    path = tmp_path / "c.json"
    path.write_bytes(b"\xff\xfe not json")
    rc, out, _ = call("export", "--format", "csv", "--cache", str(path))
    assert rc == 0 and out.strip() == ""  # a miss, never a crash
    assert TuningCache(path).bad_files()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    with TraceWriter(run, plot=False) as writer:
        for step in range(6):
            writer.add_step({"step": step, "phase": "probe", "candidate": {"threads": 1 + step % 2},
                             "node_time_s": 0.1 / (1 + step % 2), "decision": None})
        writer.write_summary({"baseline": {"threads": 1}, "winner": {"threads": 2}, "probe_steps": 6,
                              "cache_hit": False, "baseline_median_s": 0.1, "winner_median_s": 0.05})
    return run


def test_run_directory_show_export_plot(run_dir: Path, tmp_path: Path) -> None:
    rc, out, _ = call("show", "--run", str(run_dir), "--json")
    assert rc == 0 and json.loads(out)["speedup"] == pytest.approx(2.0)
    rc, out, _ = call("export", "--run", str(run_dir), "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert rc == 0 and [int(r["candidate.threads"]) for r in rows] == [1, 2, 1, 2, 1, 2]
    rc, out, _ = call("export", "--run", str(run_dir))
    assert rc == 0 and len(json.loads(out)) == 6
    rc, _, err = call("show", "--run", str(tmp_path / "missing"))
    assert rc == 1 and "missing does not exist" in err
    pytest.importorskip("matplotlib", reason="plot needs matplotlib (the [plot] extra)")
    png = tmp_path / "out.png"
    rc, out, _ = call("plot", str(run_dir), "-o", str(png))
    assert rc == 0 and png.read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------------------------
# Hostile paths and values: one line on stderr, exit status 1, nothing touched, nothing blocks


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr.strip()


def test_special_files_as_cache_are_refused_untouched(tmp_path: Path) -> None:
    from test_cache import null_device

    files = tmp_path / "files"
    files.mkdir()
    fifo = files / "cache.fifo"
    os.mkfifo(fifo)
    dev = null_device(files)
    before = os.stat(dev)
    for path, kind in ((dev, "a character device"), (fifo, "a FIFO"), (files, "a directory")):
        for command in ("show", "export", "clear"):
            line = _one_line_error(run_cli("--cache", str(path), command))  # a FIFO must not block the command
            assert f"{path} is {kind}, not a regular file" in line, line
    after = os.stat(dev)
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert not list(dev.parent.glob("null.*")) and not list(files.glob("cache.fifo.*"))
    assert not list(tmp_path.glob("files.*"))


def test_run_path_that_is_a_regular_file_is_one_line(tmp_path: Path) -> None:
    afile = tmp_path / "not_a_dir"
    afile.write_text("x")
    for args in (("show", "--run", str(afile)), ("export", "--run", str(afile)), ("plot", str(afile))):
        line = _one_line_error(run_cli(*args))
        assert f"{afile} is not a directory" in line, line
    line = _one_line_error(run_cli("plot", str(tmp_path / "missing")))
    assert "does not exist" in line


def test_bad_environment_value_is_one_line(tmp_path: Path) -> None:
    line = _one_line_error(run_cli("show", cache=Path("~no-such-user-here/cache.json")))
    assert f"{knobs.CACHE_VAR}='~no-such-user-here/cache.json'" in line, line


# ---------------------------------------------------------------------------------------------
# clear says when it cannot, show changes nothing and reads like the console


def test_clear_that_cannot_write_is_exit_1_with_one_line(cache_path: Path) -> None:
    lock = cache_path.with_name(cache_path.name + ".lock")
    lock.unlink(missing_ok=True)
    lock.mkdir()  # the lock cannot be opened, even by root
    before = cache_path.read_bytes()
    for args in (("clear",), ("clear", "aaaa")):
        line = _one_line_error(run_cli(*args, "--cache", str(cache_path)))
        assert f"cannot clear {cache_path}" in line and "unusable" in line, line
    assert cache_path.read_bytes() == before


def test_clear_of_a_read_only_cache_is_exit_1(cache_path: Path) -> None:
    prefix = _as_permission_bound()
    if prefix is None:
        pytest.skip("root without a working setpriv writes through read-only permissions")
    before = cache_path.read_bytes()
    cache_path.chmod(0o444)
    cache_path.parent.chmod(0o555)
    try:
        line = _one_line_error(run_cli("clear", "--cache", str(cache_path), prefix=prefix))
    finally:
        cache_path.parent.chmod(0o755)
    assert f"cannot clear {cache_path}" in line, line
    assert cache_path.read_bytes() == before and len(TuningCache(cache_path).entries()) == 2


def test_clear_below_a_regular_file_is_exit_1(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    rc, out, err = call("clear", "--cache", str(afile / "cache.json"))
    assert rc == 1 and out == "" and "cannot be examined" in err and len(err.splitlines()) == 1


def test_show_never_changes_a_corrupt_cache(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_bytes(b"{not json")
    for args in (("show",), ("show", "--json")):
        rc, out, _ = call(*args, "--cache", str(path))
        assert rc == 0
    assert path.read_bytes() == b"{not json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]


def test_counts_are_singular_for_one(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    one = entry(4, 0.5)
    one["fingerprint"]["local_world_size"] = 1
    assert TuningCache(path).put(KEY_A, one)
    rc, out, _ = call("show", "--cache", str(path))
    assert rc == 0 and "(1 entry)" in out and "1 local rank" in out and "1 local ranks" not in out
    rc, out, _ = call("clear", "--cache", str(path))
    assert rc == 0 and "removed 1 entry from" in out


def test_show_run_is_a_short_readable_summary(run_dir: Path) -> None:
    rc, out, _ = call("show", "--run", str(run_dir))
    lines = out.splitlines()
    assert rc == 0 and 3 <= len(lines) <= 8, out
    assert "static plan: threads=1 (100.00 ms)" in out
    assert "winner: threads=2 (50.00 ms, 2.00x vs the static plan)" in out
    assert "--json" in lines[-1] and "{" not in out


def test_show_run_prints_the_warnings_a_client_left_in_the_summary(tmp_path: Path) -> None:
    """E.g. the thread plan's CPU starvation, which a tuned CPUOffloadAdamW puts in summary.json."""
    run = tmp_path / "run"
    with TraceWriter(run, plot=False) as writer:
        writer.write_summary({"baseline": {"threads": 1}, "winner": {"threads": 1},
                              "warnings": ["CPU starvation: 8 local rank(s) have 2 CPU(s) ..."]})
    rc, out, _ = call("show", "--run", str(run))
    assert rc == 0 and "warning: CPU starvation: 8 local rank(s) have 2 CPU(s) ..." in out.splitlines()


def test_plot_without_matplotlib_suggests_pip_install_matplotlib(run_dir: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    rc, _, err = call("plot", str(run_dir))
    assert rc == 1 and err.strip().endswith("plotting needs matplotlib: pip install matplotlib"), err


def test_output_into_a_pipe_closed_early_is_quiet_exit_0(tmp_path: Path) -> None:
    # `python -m autotune show | head -1`: a reader that stops early is no error (no "[Errno 32] Broken
    # pipe", exit 0), as for any Unix filter.
    # Each output here is several pipe buffers (64 KiB on Linux), so head exits mid-write.
    path = tmp_path / "many.json"
    path.write_text(json.dumps({"schema": 1, "entries": {f"{i:064x}": entry(4, 0.5) for i in range(3000)}}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    for args in ("show", "show --json", "export --format csv", "export"):
        script = (f"{shlex.quote(sys.executable)} -m autotune {args} --cache {shlex.quote(str(path))} "
                  "| head -1 >/dev/null; "
                  'echo "python_rc=${PIPESTATUS[0]}"')
        result = subprocess.run(["bash", "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                                timeout=120)
        assert result.stdout.strip() == "python_rc=0" and result.stderr == "", (args, result)


# ---------------------------------------------------------------------------------------------
# The probing cost


def test_show_states_the_probing_cost_of_a_run_and_of_a_cache_hit(tmp_path: Path) -> None:
    """A tuner with fixed step times writes summary.json through a real TraceWriter; ``show --run``
    states its probing cost; a second run that hits the cache says it probed nothing."""
    from test_tuner_logic import BASELINE, Client, make_space, make_tuner

    from autotune import AutotuneConfig

    space = make_space(threads=(4, 8), chunks=(BASELINE["chunk_numel"],))
    cache = TuningCache(tmp_path / "cache.json")
    for name in ("first", "second"):
        client = Client(lambda s: 0.012 if s == BASELINE else 0.010, switch_penalty=0.004)
        with TraceWriter(tmp_path / name, plot=False) as writer:
            tuner = make_tuner(client, space=space, cache=cache, trace=writer, config=AutotuneConfig(probe_steps=40))
            client.run(tuner, 40, until_locked=True)
    summary = json.loads((tmp_path / "first" / "summary.json").read_text())
    # 9 static-plan steps 2 ms slower than the winner's 10 ms, 5 switches of 4 ms (the explore and
    # three paired rounds of test_tuner_messages' cost test): 38 ms = 0.38% of 10 s
    assert summary["probe_cost_s"] == pytest.approx(0.038)
    assert summary["probe_cost_pct_of_1000_steps"] == pytest.approx(0.38)
    rc, out, _ = call("show", "--run", str(tmp_path / "first"))
    assert rc == 0 and "probing cost: 38.00 ms beyond the winner's median (0.38% of 1000 steps at it)\n" in out, out
    rc, out, _ = call("show", "--run", str(tmp_path / "second"))
    assert rc == 0 and "cache: hit" in out and "probing cost: none (cache hit: nothing probed)\n" in out, out
    assert json.loads((tmp_path / "second" / "summary.json").read_text())["probe_cost_s"] == 0.0
    rc, out, _ = call("show", "--cache", str(cache.path))
    assert rc == 0 and "PROBE COST" in out.splitlines()[1] and "38.00 ms (0.38%)" in out, out


def test_show_of_entries_and_runs_without_a_probe_cost(cache_path: Path, run_dir: Path) -> None:
    """Entries and summaries of older versions have no probe cost: "-", or no line at all."""
    rc, out, _ = call("show", "--cache", str(cache_path))
    header, *rows = out.splitlines()[1:]
    column = header.index("PROBE COST")
    assert rc == 0 and rows and all(r[column:].startswith("-") for r in rows), out
    rc, out, _ = call("show", "--run", str(run_dir))
    assert rc == 0 and "probing cost" not in out, out
