"""TuningCache against real files and real processes: corruption, concurrency, killed writers."""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import multiprocessing
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from autotune import AutotuneConfig, TuningCache, knobs
from autotune.cache._cache import SCHEMA_VERSION, CacheWriteError
from autotune.cache._cachefile import exclusive_lock
from autotune.cache._entry import CacheEntry, CacheEntryError

REPO = Path(__file__).resolve().parents[1]


def make_entry(threads: int = 2, median: float = 0.5) -> dict:
    return {
        "winner": {"threads": threads, "chunk_numel": 1 << 20},
        "baseline": {"threads": 1, "chunk_numel": 1 << 22},
        "winner_median_s": median,
        "baseline_median_s": 1.0,
        "measurements": [
            {"candidate": {"threads": 1, "chunk_numel": 1 << 22}, "samples": [1.0, 1.1, 0.9]},
            {"candidate": {"threads": threads, "chunk_numel": 1 << 20}, "samples": [median, median]},
        ],
        "probe_steps": 12,
        "created_unix": 1_700_000_000.0,
        "fingerprint": {"hardware": {"cpu_model": "test"}, "local_world_size": 1},
    }


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def null_device(tmp_path: Path) -> Path:
    """A character device like /dev/null, made in ``tmp_path`` when allowed (root), so that a
    regression renames a copy, never the machine's /dev/null; non-root users get /dev/null itself,
    which they cannot rename."""
    node = tmp_path / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        return node
    except (PermissionError, AttributeError):
        if os.geteuid() == 0:
            pytest.skip("root without CAP_MKNOD: a test on /dev/null itself could destroy it on a regression")
        return Path("/dev/null")


def cache_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "autotune.cache._cache" and r.levelno >= logging.WARNING]


# ---------------------------------------------------------------------------------------------
# Basics


def test_roundtrip_and_file_format(tmp_path: Path) -> None:
    cache = TuningCache(tmp_path / "sub" / "cache.json")
    assert cache.get("k1") is None  # missing file: a plain miss
    assert cache.put("k1", make_entry(2)) is True
    assert cache.put("k2", make_entry(3)) is True
    assert cache.get("k1") == make_entry(2)
    assert cache.get("k2")["winner"]["threads"] == 3
    doc = json.loads(cache.path.read_text())
    assert doc["schema"] == SCHEMA_VERSION == 1
    assert set(doc["entries"]) == {"k1", "k2"}
    # get returns a copy: mutating it does not change what the cache serves
    got = cache.get("k1")
    got["winner"]["threads"] = 99
    assert cache.get("k1")["winner"]["threads"] == 2
    assert cache.put("k1", make_entry(4))  # overwrite
    assert cache.get("k1")["winner"]["threads"] == 4


def test_cache_entry_json_form_round_trips_and_names_a_bad_field(tmp_path: Path) -> None:
    entry = CacheEntry.from_json(make_entry())
    assert entry.to_json() == make_entry() and entry.winner_median_s == 0.5
    cache = TuningCache(tmp_path / "cache.json")
    assert cache.put("k", entry) and cache.get("k") == make_entry()  # put takes the record too
    bad = make_entry()
    bad["winner_median_s"] = float("nan")
    with pytest.raises(CacheEntryError, match="winner_median_s"):
        CacheEntry.from_json(bad)
    with pytest.raises(CacheEntryError, match="entry=str: expected a dict"):
        CacheEntry.from_json("garbage")
    assert cache.records() == {"k": entry} and entry.speedup == 2.0
    decided = tuple({**m, "median_s": 0.5, "n": 2} for m in entry.measurements)  # a Decision's form
    assert dataclasses.replace(entry, measurements=decided).to_json() == make_entry()  # stores its own keys only
    old = make_entry()
    del old["fingerprint"]  # entries of older versions: still no such key once read and written back
    assert CacheEntry.from_json(old).fingerprint is None and CacheEntry.from_json(old).to_json() == old


def test_the_entry_speedup_is_the_paired_ratio_the_lock_in_reported() -> None:
    """``python -m autotune show`` printed the medians' ratio (1.02x) beside the lock-in's paired
    ratio (1.00x) for the same run: an entry records the paired ratio and its speedup is that."""
    entry = CacheEntry.from_json({**make_entry(), "paired_ratio": 0.8})
    assert entry.speedup == pytest.approx(1.25) and entry.to_json()["paired_ratio"] == 0.8
    assert CacheEntry.from_json(make_entry()).speedup == 2.0  # older entries: the medians' ratio
    for bad in (0.0, -1.0, float("inf"), True, "0.8"):
        with pytest.raises(CacheEntryError, match="paired_ratio"):
            CacheEntry.from_json({**make_entry(), "paired_ratio": bad})


def test_the_probe_cost_is_an_optional_field_of_the_entry(tmp_path: Path) -> None:
    """Entries of older versions have no ``probe_cost_s``: they still load (None), and are
    written back without it; a new entry's cost round-trips and its share of 1000 steps at
    the winner's median is derived, not stored."""
    old = CacheEntry.from_json(make_entry())
    assert old.probe_cost_s is None and old.probe_cost_pct is None and "probe_cost_s" not in old.to_json()
    new = CacheEntry.from_json({**make_entry(median=0.5), "probe_cost_s": 2.5})
    assert new.probe_cost_s == 2.5 and new.probe_cost_pct == pytest.approx(0.5)  # 2.5 s of 1000 x 0.5 s
    assert new.to_json() == {**make_entry(median=0.5), "probe_cost_s": 2.5}
    assert new.export_row()["probe_cost_s"] == 2.5 and "probe_cost_s" not in old.export_row()
    cache = TuningCache(tmp_path / "cache.json")
    assert cache.put("old", make_entry()) and cache.put("new", new)
    assert cache.records() == {"old": old, "new": new}


#: Functions outside _entry.py that read the tuner's summary (summary.json), whose keys share
#: names with the entry's (``winner``, ``probe_steps``, ...): the same facts in another record.
_SUMMARY_READERS = {("autotune/report/_cli.py", "_run_summary")}


def _str_constants(node: ast.AST, function: str | None = None) -> Iterator[tuple[str, str | None, int]]:
    """(value, enclosing function, line) of each str constant below ``node``, except the names
    of an ``__all__`` (``autotune.fingerprint`` is a function, not the entry's key)."""
    if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
        return
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value, function, node.lineno
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        function = node.name
    for child in ast.iter_child_nodes(node):
        yield from _str_constants(child, function)


def _uses_the_cache(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("autotune.cache._cache", "autotune.cache._entry"):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = ("autotune.cache._cache", "autotune.cache._entry", "TuningCache", "CacheEntry")
            if any(a.name in names for a in node.names):
                return True
    return False


def test_only_the_cache_module_spells_the_entry_json_keys() -> None:
    """The entry's JSON form is owned by autotune.cache._entry, so it changes in one place; every other
    reader goes through :class:`CacheEntry` fields. The keys come from a real ``to_json()``, so
    they cannot go stale. Keys the tuner's summary also has are allowed in modules that never touch
    the cache (there they are the summary's: bench/, the trace's plots, the tuner itself) and in
    :data:`_SUMMARY_READERS`; the entry's own keys (``created_unix``, ...) are allowed nowhere."""
    from autotune import Knob, OnlineTuner, SearchSpace

    keys = set(CacheEntry(
        winner={"t": 1}, baseline={"t": 1}, winner_median_s=1.0, baseline_median_s=1.0, measurements=(),
        probe_steps=0, created_unix=0.0, fingerprint={"f": 1}, probe_cost_s=0.0,
    ).to_json())
    summary = OnlineTuner(SearchSpace((Knob("t", (1, 2)),)), baseline={"t": 1}, apply=lambda s: None).summary()
    shared = keys & set(summary)
    assert "created_unix" in keys - shared and "winner" in shared  # the split below is not empty
    offenders: list[str] = []  # one per spelling (a line may hold two: a key and its lookup)
    for package in ("autotune", "offload", "bench"):
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel == "autotune/cache/_entry.py":
                continue
            tree = ast.parse(path.read_text(), filename=rel)
            strict = _uses_the_cache(tree)
            for value, function, line in _str_constants(tree):
                if value in keys and (value not in shared or strict and (rel, function) not in _SUMMARY_READERS):
                    offenders.append(f"{rel}:{line}: {value!r} (in {function or 'the module'})")
    assert not offenders, ("the cache entry's JSON keys spelled outside autotune/cache/_entry.py:\n"
                           + "\n".join(offenders))


def test_default_path_follows_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(knobs.CACHE_VAR, str(tmp_path / "env" / "c.json"))
    cache = TuningCache()
    assert cache.path == tmp_path / "env" / "c.json"
    assert cache.put("k", make_entry())
    assert (tmp_path / "env" / "c.json").exists()


def test_delete_clear_entries(tmp_path: Path) -> None:
    cache = TuningCache(tmp_path / "cache.json")
    for i in range(3):
        cache.put(f"k{i}", make_entry(i + 1))
    assert set(cache.entries()) == {"k0", "k1", "k2"}
    assert cache.delete("k1") is True
    assert cache.delete("k1") is False
    assert set(cache.entries()) == {"k0", "k2"}
    assert cache.clear() == 2
    assert cache.entries() == {}
    assert json.loads(cache.path.read_text()) == {"schema": 1, "entries": {}}


@pytest.mark.parametrize(
    "mutate",
    [
        lambda e: e["winner"].update(threads=None),
        lambda e: e["winner"].update(threads=[2]),
        lambda e: e["winner"].update(threads=2**64),
        lambda e: e.update(probe_steps=True),
        lambda e: e.update(winner={}),
        lambda e: e.update(winner_median_s=float("nan")),
        lambda e: e.update(baseline_median_s=float("inf")),
        lambda e: e.update(probe_steps=-1),
        lambda e: e.update(measurements={"a": 1}),
        lambda e: e["measurements"][0].update(samples=[1.0, "x"]),
        lambda e: e.pop("created_unix"),
        lambda e: e["fingerprint"].update(blob=object()),
        lambda e: e.update(probe_cost_s=-0.5),
        lambda e: e.update(probe_cost_s="1 s"),
    ],
)
def test_put_rejects_malformed_entries(tmp_path: Path, mutate) -> None:
    cache = TuningCache(tmp_path / "cache.json")
    cache.put("good", make_entry())
    before = cache.path.read_bytes()
    entry = make_entry()
    mutate(entry)
    with pytest.raises(CacheEntryError):
        cache.put("bad", entry)
    assert cache.path.read_bytes() == before
    with pytest.raises(TypeError):
        cache.put("", make_entry())


# ---------------------------------------------------------------------------------------------
# Bad input: a warning and a miss, never a crash; the bad file is kept aside


def _valid_doc_bytes() -> bytes:
    return json.dumps({"schema": 1, "entries": {"k": make_entry(), "k2": make_entry(3)}}).encode()


CORRUPT_FILES = {
    "truncated": _valid_doc_bytes()[: len(_valid_doc_bytes()) // 2],
    "empty": b"",
    "non_json": b"threads = 4\nchunk = big\n",
    "binary_garbage": bytes(range(256)) * 8,
    "json_list": b'[{"schema": 1, "entries": {}}]',
    "json_string": b'"hello"',
    "schema_as_string": b'{"schema": "1", "entries": {}}',
    "schema_missing": b'{"entries": {"k": {}}}',
    "schema_zero": b'{"schema": 0, "entries": {}}',
    "entries_as_list": b'{"schema": 1, "entries": []}',
    "huge_integer_literal": b'{"schema": 1, "entries": {"k": {"probe_steps": ' + b"9" * 5000 + b"}}}",
    "deep_nesting": b"[" * 100_000 + b"]" * 100_000,
    "nan_schema": b'{"schema": NaN, "entries": {}}',
}


@pytest.mark.parametrize("name", sorted(CORRUPT_FILES))
def test_corrupt_file_is_a_miss_and_is_kept_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str) -> None:
    path = tmp_path / "cache.json"
    path.write_bytes(CORRUPT_FILES[name])
    cache = TuningCache(path)
    with caplog.at_level(logging.WARNING):
        assert cache.get("k") is None
    assert any("corrupt" in m for m in cache_warnings(caplog)), cache_warnings(caplog)
    bad = cache.bad_files()
    assert len(bad) == 1 and bad[0].name.startswith("cache.json.bad-")
    assert bad[0].read_bytes() == CORRUPT_FILES[name]  # kept exactly as found
    assert not path.exists()
    # the cache keeps working
    assert cache.put("k", make_entry()) is True
    assert cache.get("k") == make_entry()


def test_corrupt_file_found_by_a_writer_is_kept_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "cache.json"
    path.write_bytes(b"\x00\xff garbage")
    cache = TuningCache(path)
    with caplog.at_level(logging.WARNING):
        assert cache.put("k", make_entry()) is True
    assert [p.read_bytes() for p in cache.bad_files()] == [b"\x00\xff garbage"]
    assert set(cache.entries()) == {"k"}


def _partly_bad_file() -> tuple[bytes, set[str]]:
    """A parseable cache file with one valid entry ("good") and many bad ones."""
    bad_entries = {
        "null_threads": {**make_entry(), "winner": {"threads": None}},
        "dict_threads": {**make_entry(), "winner": {"threads": {"n": 2}}},
        "bool_probe_steps": {**make_entry(), "probe_steps": True},
        "huge_threads": {**make_entry(), "winner": {"threads": 2**70}},
        "huge_probe_steps": {**make_entry(), "probe_steps": 10**400},
        "list_knob": {**make_entry(), "winner": {"threads": [2]}},
        "negative_probe_steps": {**make_entry(), "probe_steps": -3},
        "string_median": {**make_entry(), "winner_median_s": "fast"},
        "nan_median": {**make_entry(), "winner_median_s": "__NAN__"},
        "inf_sample": {**make_entry(), "measurements": [{"candidate": {"threads": 1}, "samples": ["__INF__"]}]},
        "not_a_dict": [1, 2, 3],
        "missing_winner": {k: v for k, v in make_entry().items() if k != "winner"},
    }
    text = json.dumps({"schema": 1, "entries": {"good": make_entry(4), **bad_entries}})
    # non-finite numbers: Python's json parses them, JSON forbids them
    text = text.replace('"__NAN__"', "NaN").replace('"__INF__"', "1e999")
    return text.encode(), set(bad_entries)


def test_bad_entries_are_dropped_and_the_valid_ones_served(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    raw, bad_keys = _partly_bad_file()
    path = tmp_path / "cache.json"
    path.write_bytes(raw)
    cache = TuningCache(path)
    with caplog.at_level(logging.WARNING):
        assert cache.get("good") == make_entry(4)
    assert any(f"{len(bad_keys)} bad entries" in m for m in cache_warnings(caplog)), cache_warnings(caplog)
    for key in bad_keys:
        assert cache.get(key) is None
    # the original file is kept aside byte for byte; the live file holds the valid entry only
    assert [p.read_bytes() for p in cache.bad_files()] == [raw]
    assert json.loads(path.read_text()) == {"schema": 1, "entries": {"good": make_entry(4)}}


def test_writer_merging_into_a_partly_bad_file_keeps_valid_entries(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    raw, _ = _partly_bad_file()
    path = tmp_path / "cache.json"
    path.write_bytes(raw)
    cache = TuningCache(path)
    with caplog.at_level(logging.WARNING):
        assert cache.put("new", make_entry(2)) is True
    assert cache_warnings(caplog)
    assert set(json.loads(path.read_text())["entries"]) == {"good", "new"}
    assert [p.read_bytes() for p in cache.bad_files()] == [raw]


def test_newer_schema_is_ignored_and_never_overwritten(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "cache.json"
    raw = json.dumps({"schema": 2, "entries": {"k": {"winner": {"threads": 2}}}, "future": True}).encode()
    path.write_bytes(raw)
    cache = TuningCache(path)
    with caplog.at_level(logging.WARNING):
        assert cache.get("k") is None
        assert cache.put("k2", make_entry()) is False
        assert cache.clear() == 0
    assert path.read_bytes() == raw
    assert cache.bad_files() == []
    assert any("newer" in m for m in cache_warnings(caplog))


def test_unwritable_location_warns_and_continues(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cache = TuningCache(blocker / "cache.json")  # fails for root too
    with caplog.at_level(logging.WARNING):
        assert cache.get("k") is None
        assert cache.put("k", make_entry()) is False
        assert cache.entries() == {}
    assert any("unusable" in m for m in cache_warnings(caplog))


def test_a_lock_that_cannot_be_opened_names_the_cache_as_given(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    home = tmp_path / "shared"
    home.mkdir()
    (home / "cache.json.lock").mkdir()  # the lock cannot be opened, even by root
    given = tmp_path / "my-cache.json"
    given.symlink_to(home / "cache.json")  # the lock lives by the target, the user named the link
    cache = TuningCache(given)
    with caplog.at_level(logging.WARNING):
        assert cache.put("k", make_entry()) is False
    [warning] = cache_warnings(caplog)
    assert warning.startswith(f"Cannot store entry 'k': tuning cache {given} is unusable: "), warning
    assert f"its lock file {home / 'cache.json.lock'} cannot be opened" in warning, warning
    with pytest.raises(CacheWriteError, match=f"tuning cache {re.escape(str(given))} is unusable"):
        cache.clear(strict=True)


def test_a_directory_that_cannot_be_created_names_the_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    path = blocker / "sub" / "cache.json"
    with caplog.at_level(logging.WARNING):
        assert TuningCache(path).put("k", make_entry()) is False
    [warning] = cache_warnings(caplog)
    assert warning.startswith(f"Cannot store entry 'k': tuning cache {path} is unusable: its directory "), warning


def test_a_lock_held_elsewhere_names_the_cache_as_busy(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "cache.json"
    cache = TuningCache(path, lock_timeout_s=0)
    with exclusive_lock(cache.lock_path, timeout_s=0) as problem, caplog.at_level(logging.WARNING):
        assert problem is None  # held here: another open file, so the cache's own flock fails
        assert cache.put("k", make_entry()) is False
    [warning] = cache_warnings(caplog)
    assert warning.startswith(f"Cannot store entry 'k': tuning cache {path} is busy: its lock file "), warning
    assert cache.put("k", make_entry()) is True


def test_cache_path_that_is_a_directory_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "cache.json"
    path.mkdir()
    cache = TuningCache(path)
    with caplog.at_level(logging.WARNING):
        assert cache.get("k") is None
        assert cache.put("k", make_entry()) is False
    assert path.is_dir()
    assert len(cache_warnings(caplog)) == 1  # said once, though both the read and the write met it


# ---------------------------------------------------------------------------------------------
# Paths the cache does not own: special files, symlinks


def _call_with_deadline(fn, timeout_s: float = 30.0):
    """``fn()`` on a thread; fails the test (instead of hanging it) if it blocks."""
    import threading

    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(value=fn()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{fn} blocked for {timeout_s} s"
    return box.get("value")


def test_dev_null_is_never_renamed_replaced_or_locked_beside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # As root (containers) /dev/null was renamed to /dev/null.bad-<ts> and a regular file took its place.
    dev = null_device(tmp_path)
    before = os.stat(dev)
    cache = TuningCache(dev)
    with caplog.at_level(logging.WARNING):
        assert cache.get("k") is None
        assert cache.put("k", make_entry()) is False
        assert cache.entries() == {} and cache.clear() == 0
    after = os.stat(dev)
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    assert not list(dev.parent.glob("null.*")), list(dev.parent.glob("null.*"))
    assert cache.file_problem() == "is a character device, not a regular file"
    assert any("is a character device, not a regular file" in m for m in cache_warnings(caplog))


def test_a_directory_as_cache_is_said_once_naming_where_the_path_came_from(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A run that reads and writes its cache at a directory gets one warning, which names the
    setting the path came from (the optimizer's AutotuneConfig, not an environment variable)."""
    import torch

    from offload import CPUOffloadAdamW, OffloadSettings

    model = torch.nn.Linear(16, 16)
    opt = CPUOffloadAdamW(model.parameters(), autotune=AutotuneConfig(cache_path=tmp_path, min_gain=0.5),
                          settings=OffloadSettings(chunk_numel=1024))
    with caplog.at_level(logging.WARNING):
        for _ in range(44):
            model(torch.ones(2, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert opt.tuner is not None and opt.tuner.state == "locked"
    said = [m for m in cache_warnings(caplog) if "is a directory" in m]
    assert len(said) == 1, said
    assert "point AutotuneConfig(cache_path=...) at a regular file" in said[0]
    assert TuningCache(tmp_path).source == "the TuningCache path"
    opt.close()


def test_fifo_as_cache_neither_blocks_nor_is_replaced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fifo = tmp_path / "cache.json"
    os.mkfifo(fifo)
    cache = TuningCache(fifo)
    with caplog.at_level(logging.WARNING):
        assert _call_with_deadline(lambda: cache.get("k")) is None  # a FIFO without a writer must not block a reader
        assert _call_with_deadline(lambda: cache.put("k", make_entry())) is False
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.json"]  # no lock, temp or .bad-* file
    assert any("is a FIFO" in m for m in cache_warnings(caplog))


def test_symlinked_cache_is_written_through_to_the_shared_target(tmp_path: Path) -> None:
    shared = tmp_path / "shared" / "cache.json"
    shared.parent.mkdir()
    TuningCache(shared).put("a", make_entry(threads=2))
    home = tmp_path / "home"
    home.mkdir()
    link = home / "cache.json"
    link.symlink_to(os.path.relpath(shared, home))  # relative, as users write them
    cache = TuningCache(link)
    assert cache.get("a") == make_entry(threads=2)
    assert cache.put("b", make_entry(threads=4)) is True
    assert link.is_symlink() and link.resolve() == shared.resolve()
    assert set(TuningCache(shared).entries()) == {"a", "b"}
    assert sorted(p.name for p in home.iterdir()) == ["cache.json"]  # lock and temp files live by the target
    assert cache.delete("a") and set(TuningCache(shared).entries()) == {"b"} and link.is_symlink()


def test_corrupt_symlink_target_is_set_aside_and_the_link_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shared = tmp_path / "shared.json"
    shared.write_bytes(b"{ not json")
    link = tmp_path / "link.json"
    link.symlink_to(shared)
    cache = TuningCache(link)
    with caplog.at_level(logging.WARNING):
        assert cache.get("k") is None
    assert link.is_symlink() and [p.name for p in cache.bad_files()][0].startswith("shared.json.bad-")
    assert cache.put("k", make_entry()) is True
    assert link.is_symlink() and set(TuningCache(shared).entries()) == {"k"}


def test_symlink_to_a_device_is_not_followed_into_a_write(tmp_path: Path) -> None:
    dev = null_device(tmp_path)
    link = tmp_path / "cache.json"
    link.symlink_to(dev)
    cache = TuningCache(link)
    assert cache.put("k", make_entry()) is False and cache.get("k") is None
    assert link.is_symlink() and stat.S_ISCHR(os.stat(dev).st_mode)
    assert not list(dev.parent.glob("null.*"))


# ---------------------------------------------------------------------------------------------
# Real processes


def _writer(path: str, key: str, times: int) -> None:
    cache = TuningCache(path, lock_timeout_s=60)
    for i in range(times):
        if not cache.put(key, make_entry(threads=1 + i)):
            raise SystemExit(f"put {key} #{i} was not persisted")
        if cache.get(key) is None:
            raise SystemExit(f"own key {key} missing after put")


def test_concurrent_writer_processes_merge(tmp_path: Path) -> None:
    path = tmp_path / "cache.json"
    TuningCache(path).put("preexisting", make_entry())
    # fork: the children only touch files, and they skip re-importing the package (torch)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    procs = [ctx.Process(target=_writer, args=(str(path), f"writer-{i}", 5)) for i in range(8)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
    finally:  # a hung writer would otherwise outlive the test (and block pytest's exit)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0] * 8
    doc = json.loads(path.read_text())
    assert doc["schema"] == 1
    assert set(doc["entries"]) == {"preexisting", *(f"writer-{i}" for i in range(8))}
    assert all(e["winner"]["threads"] == 5 for k, e in doc["entries"].items() if k.startswith("writer-"))
    assert not list(tmp_path.glob(".cache.json.tmp-*"))


_SLOW_WRITER = """
import json, os, sys, time, pathlib
from autotune import TuningCache
ready = pathlib.Path(sys.argv[2])
real_write = os.write
def half_then_hang(fd, data):  # the cache writes its temp file with os.write (nothing else does)
    data = bytes(data)
    real_write(fd, data[: len(data) // 2])
    ready.write_text("holding the lock with a half-written temp file")
    time.sleep(600)
cache = TuningCache(sys.argv[1])
os.write = half_then_hang
cache.put("from-killed-writer", json.loads(sys.argv[3]))
"""


def test_writer_killed_mid_write_leaves_old_file_and_frees_the_lock(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "cache.json"
    cache = TuningCache(path)
    assert cache.put("old", make_entry(3))
    old_bytes = path.read_bytes()
    ready = tmp_path / "ready"
    child = subprocess.Popen(
        [sys.executable, "-c", _SLOW_WRITER, str(path), str(ready), json.dumps(make_entry(7))],
        env=child_env(), cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert child.poll() is None, f"slow writer exited early with {child.returncode}"
            assert time.monotonic() < deadline, "slow writer never reached the write"
            time.sleep(0.05)
        # while the child holds the lock, another writer times out, warns and skips
        with caplog.at_level(logging.WARNING):
            assert TuningCache(path, lock_timeout_s=0.2).put("blocked", make_entry()) is False
        assert any("stayed locked" in m for m in cache_warnings(caplog))
        # readers take no lock and still see the old file
        assert cache.get("old") == make_entry(3)
        assert list(tmp_path.glob(".cache.json.tmp-*")), "the child should have a half-written temp file"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert path.read_bytes() == old_bytes
    # the kernel released the dead writer's lock: the next writer proceeds and cleans up
    assert TuningCache(path, lock_timeout_s=5).put("after", make_entry(2)) is True
    assert set(cache.entries()) == {"old", "after"}
    assert not list(tmp_path.glob(".cache.json.tmp-*"))
    assert cache.bad_files() == []
