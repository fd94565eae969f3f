"""What the tuner tells a user: one unit (ms), the deciding statistic in the table, one ratio,
a warning when a run ends before tuning finished, and what probing cost."""

from __future__ import annotations

import logging
import re

import pytest

from test_tuner_logic import BASELINE, Client, FakeCache, make_space, make_tuner, table

from autotune import AutotuneConfig, Measurement
from autotune.measure._measurement import format_ms

_OTHER_UNITS = re.compile(r"\d(?: s\b| us\b|e[-+]\d)")


def _spiky(cost):
    """Two of every three steps of the static plan stall (x1.8): its slowness is its own, and the
    paired rounds that decide see it."""
    calls = {"n": 0}

    def f(setting):
        if setting != BASELINE:
            return cost(setting)
        calls["n"] += 1
        return cost(setting) * (1.8 if calls["n"] % 3 else 1.0)

    return f


def test_lock_in_message_is_in_ms_with_one_ratio_and_the_deciding_column(caplog) -> None:
    costs = {tuple(BASELINE.values()): 0.0125, (4, 1 << 21): 0.0091}
    client = Client(_spiky(table(costs, default=0.02)))
    with caplog.at_level(logging.INFO, logger="autotune"):
        tuner = make_tuner(client, config=AutotuneConfig(probe_steps=80))
        client.run(tuner, 80, until_locked=True)
    s = tuner.summary()
    assert s["winner"] == {"threads": 4, "chunk_numel": 1 << 21}
    locked = next(r for r in caplog.records if "locked in" in r.getMessage()).getMessage()
    head, header, *rows = locked.splitlines()
    assert not _OTHER_UNITS.search(locked), locked
    assert len(re.findall(r"\d\.\d+x", locked)) == 1, locked  # one ratio
    assert "ms" in head and "paired round" in head
    assert "paired ratio/rounds" in header and "median ms" in header
    # the one ratio is the one summary.json reports: the paired rounds' that decided
    assert f"{s['speedup']:.3f}x faster than the static plan (paired rounds)" in head
    winner = next(p for p in s["paired"] if p["candidate"] == s["winner"])
    assert s["speedup"] == pytest.approx(1.0 / winner["ratio"])
    # the statistic that decided is in the table, next to the raw median
    winner_row = next(r for r in rows if r.startswith("*"))
    assert f"{winner['ratio']:.3f}/{winner['rounds']}" in winner_row
    assert next(r for r in rows if r.endswith("(static plan)")).split()[-3] == "(ref)"


def test_format_ms_never_uses_another_unit_or_an_exponent() -> None:
    assert format_ms(0.000218) == "0.218 ms"
    assert format_ms(0.0037) == "3.70 ms"
    assert format_ms(2.5) == "2500.00 ms"
    assert "ms" in str(Measurement((0.0012, 0.0013))) and " us" not in str(Measurement((1e-6, 2e-6)))


def test_closing_while_probing_warns_how_many_steps_tuning_needs(caplog) -> None:
    client = Client(table({}, default=0.01))
    tuner = make_tuner(client, config=AutotuneConfig(probe_steps=40), cache=FakeCache())
    client.run(tuner, 3)
    assert tuner.state == "probing"
    with caplog.at_level(logging.WARNING, logger="autotune"):
        tuner.close()
        tuner.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "still probing" in warnings[0] and "nothing was locked in or cached" in warnings[0]
    planned = int(re.search(r"train for at least (\d+) steps", warnings[0]).group(1))
    assert 3 < planned <= 40


def test_closing_after_lock_in_is_silent(caplog) -> None:
    client = Client(table({}, default=0.01))
    tuner = make_tuner(client, config=AutotuneConfig(probe_steps=80))
    client.run(tuner, 80, until_locked=True)
    assert tuner.state == "locked"
    with caplog.at_level(logging.WARNING, logger="autotune"):
        tuner.close()
    assert not caplog.records


def test_closing_a_retune_after_a_stale_recheck_counts_the_check_steps(caplog) -> None:
    """The advice must count the re-check's steps: a re-tune after a cache hit starts late."""
    from test_tuner_logic import cache_for, cached_entry

    stale = {"threads": 1, "chunk_numel": 1 << 20}  # cached, but now twice as slow as the static plan
    client = Client(table({(1, 1 << 20): 2.0}, default=1.0))
    cache = cache_for(cached_entry(stale, winner_median_s=1.0, baseline_median_s=1.5))
    tuner = make_tuner(client, cache=cache, config=AutotuneConfig(probe_steps=40))
    client.run(tuner, 16)
    s = tuner.summary()
    assert s["cache_status"] == "stale" and s["check_steps"] == 13 and tuner.state == "probing"
    with caplog.at_level(logging.WARNING, logger="autotune"):
        tuner.close()
    (warning,) = [r.getMessage() for r in caplog.records if "closed after" in r.getMessage()]
    needed = int(re.search(r"train for at least (\d+) steps", warning).group(1))
    planned = int(re.search(r"of the (\d+) probe steps it planned", warning).group(1))
    assert needed == s["check_steps"] + planned and "13 step(s) before this session" in warning, warning


def test_only_one_candidate_logs_no_empty_table_header(caplog) -> None:
    client = Client(table({}, default=0.01))
    space = make_space(threads=(BASELINE["threads"],), chunks=(BASELINE["chunk_numel"],))
    with caplog.at_level(logging.INFO, logger="autotune"):
        tuner = make_tuner(client, space=space, config=AutotuneConfig(probe_steps=40))
        client.run(tuner, 3)
    locked = [r.getMessage() for r in caplog.records if "locked in" in r.getMessage()]
    assert len(locked) == 1 and "only one candidate" in locked[0], locked
    assert "median ms" not in locked[0] and len(locked[0].splitlines()) == 1, locked[0]


# --- the probing cost ----------------------------------------------------------------------------


def test_probe_cost_is_the_unclipped_excess_over_the_winners_median_floored_at_zero() -> None:
    from autotune.measure._measurement import probe_cost_pct, probe_cost_s

    times = [0.030, 0.010, 0.020, 0.010, 0.005]  # at a winner's median of 10 ms
    assert probe_cost_s(times, 0.010) == pytest.approx(0.025)  # 20 + 0 + 10 + 0 - 5 ms: not clipped per step
    assert probe_cost_s([0.009, 0.010], 0.010) == 0.0  # faster than the median overall: the total floors at 0
    assert probe_cost_s([], None) == 0.0 and probe_cost_s([0.01], None) is None  # nothing probed / no median
    assert probe_cost_pct(0.025, 0.010) == pytest.approx(0.25)  # 25 ms of 1000 x 10 ms
    assert probe_cost_pct(None, 0.010) is None and probe_cost_pct(0.025, 0.0) is None


def test_probe_cost_sums_every_probe_step_against_the_winner(caplog) -> None:
    """Two candidates on a grid, fixed step times and a 4 ms penalty on the first step after each
    switch: the warm-ups it lands on count towards the cost, the measured medians are exact."""
    from test_tuner_logic import FakeTrace

    base, fast, penalty = 0.012, 0.010, 0.004
    space = make_space(threads=(4, 8), chunks=(BASELINE["chunk_numel"],))
    client = Client(lambda s: base if s == BASELINE else fast, switch_penalty=penalty)
    trace = FakeTrace()
    with caplog.at_level(logging.INFO, logger="autotune"):
        tuner = make_tuner(client, space=space, trace=trace, config=AutotuneConfig(probe_steps=40))
        client.run(tuner, 40, until_locked=True)
    s = tuner.summary()
    assert s["winner"] == {"threads": 4, "chunk_numel": BASELINE["chunk_numel"]} and s["winner_median_s"] == fast
    # explore (paired round 0): 1 warm-up + 3 measured each (P' P P P F' F F F); then three paired
    # rounds (two of finals, one of duel: a switch needs 4), the order alternating, a warm-up step
    # only after a switch: F P' P | P F' F | F P' P. 9 steps of the static plan, each 2 ms slower;
    # 5 switches (start, explore, 3 in the rounds).
    assert s["probe_steps"] == 8 + 3 + 3 + 3
    expected = 9 * (base - fast) + 5 * penalty
    assert s["probe_cost_s"] == pytest.approx(expected)
    assert s["probe_cost_pct_of_1000_steps"] == pytest.approx(100 * expected / (1000 * fast))
    # the same as summing the trace's probe rows by hand
    rows = [r["node_time_s"] for r in trace.rows if r["state"] == "probing"]
    assert s["probe_cost_s"] == pytest.approx(sum(rows) - len(rows) * fast)
    assert trace.summaries[-1]["probe_cost_s"] == s["probe_cost_s"]
    locked = next(r.getMessage() for r in caplog.records if "locked in" in r.getMessage())
    head = locked.splitlines()[0]
    pct = s["probe_cost_pct_of_1000_steps"]
    assert (f"probing cost {format_ms(expected)} beyond the winner's median = {pct:.2f}% of 1000 steps at it"
            in head), head
    assert not _OTHER_UNITS.search(locked) and len(re.findall(r"\d\.\d+x", locked)) == 1, locked


def test_probe_cost_keys_before_lock_in_and_on_a_cache_hit(caplog) -> None:
    from test_tuner_logic import cache_for, cached_entry, valley

    client = Client(table({}, default=0.01))
    fresh = make_tuner(client, config=AutotuneConfig(probe_steps=40))
    assert fresh.summary()["probe_cost_s"] is None and fresh.summary()["probe_cost_pct_of_1000_steps"] is None
    winner = {"threads": 4, "chunk_numel": 1 << 22}
    client = Client(valley(winner))
    with caplog.at_level(logging.INFO, logger="autotune"):
        tuner = make_tuner(client, cache=cache_for(cached_entry(winner, winner_median_s=1.0)))
        client.run(tuner, 14)
    s = tuner.summary()
    assert s["cache_status"] == "hit" and s["probe_steps"] == 0
    assert s["probe_cost_s"] == 0.0 and s["probe_cost_pct_of_1000_steps"] == 0.0  # re-check steps are not probing
    locked = next(r.getMessage() for r in caplog.records if "locked in" in r.getMessage())
    assert "no probing cost (cache hit: nothing probed)" in locked, locked


def test_the_cache_entry_records_the_probe_cost() -> None:
    from test_tuner_logic import FakeCache

    client = Client(table({(4, 1 << 21): 0.0091}, default=0.0125))
    cache = FakeCache()
    tuner = make_tuner(client, cache=cache, config=AutotuneConfig(probe_steps=80))
    client.run(tuner, 80, until_locked=True)
    ((_, entry),) = cache.puts
    assert entry["probe_cost_s"] == tuner.summary()["probe_cost_s"] > 0


def test_a_script_that_ends_while_probing_warns_without_close(tmp_path) -> None:
    """Most training scripts never call close(): the warning comes at interpreter exit, through
    logging's last-resort handler when the script configured no logging."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "short_run.py"
    script.write_text(
        "import itertools\n"
        "from autotune import AutotuneConfig, Knob, OnlineTuner, SearchSpace, StepSample\n"
        "space = SearchSpace((Knob('threads', (1, 2, 4)),))\n"
        "tuner = OnlineTuner(space, baseline={'threads': 4}, apply=lambda s: None,\n"
        "                    config=AutotuneConfig(use_cache=False))\n"
        "tuner.start()\n"
        "for _ in range(5):\n"
        "    tuner.observe(StepSample(time_s=0.01))\n"
        "print('trained', tuner.state)\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr
    assert "trained probing" in done.stdout
    assert "still probing" in done.stderr and "train for at least" in done.stderr and "without close()" in done.stderr

    closed = script.read_text().replace("print('trained', tuner.state)", "tuner.close()\nprint('closed')")
    script.write_text(closed)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0 and done.stderr.count("still probing") == 1  # close() warned; exit did not again
