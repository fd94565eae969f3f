"""What the tuner tells a user: one unit (ms), the deciding statistic in the table, one ratio,
and a warning when a run ends before tuning finished."""

from __future__ import annotations

import logging
import re

from test_tuner_logic import BASELINE, Client, FakeCache, make_space, make_tuner, table

from autotune import AutotuneConfig, Measurement
from autotune._measurement import format_ms

_OTHER_UNITS = re.compile(r"\d(?: s\b| us\b|e[-+]\d)")


def _spiky(cost):
    """Two of every three steps of the static plan stall (x1.8): its raw median is a stall, its
    median without spikes (what the lock-in rule compares) is not."""
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
    assert "ms" in head and "without spikes" in head
    assert "w/o spikes" in header and "median ms" in header
    # the one ratio is the one summary.json, the cache and `python -m autotune show` report
    assert f"{s['speedup']:.3f}x faster than the static plan (medians)" in head
    # the statistic that decided (spikes dropped) is in the table, next to the raw median
    by_key = {(m["candidate"]["threads"], m["candidate"]["chunk_numel"]): m for m in s["measurements"]}
    base = by_key[tuple(BASELINE.values())]
    trimmed = Measurement(tuple(base["samples"])).without_outliers()
    assert trimmed.median < 0.8 * base["median_s"]  # the stalls really moved the raw median
    base_row = next(r for r in rows if r.endswith("(static plan)"))
    assert f"{base['median_s'] * 1e3:.3f}" in base_row and f"{trimmed.median * 1e3:.3f}" in base_row
    assert f"{trimmed.n}/{base['n']}" in base_row


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

    client = Client(lambda setting: 2.5)  # the cached static plan: recorded 1.0 s, now 2.5 s
    cache = cache_for(cached_entry(BASELINE, winner_median_s=1.0, baseline_median_s=1.0))
    tuner = make_tuner(client, cache=cache, config=AutotuneConfig(probe_steps=40))
    client.run(tuner, 10)
    s = tuner.summary()
    assert s["cache_status"] == "stale" and s["check_steps"] == 4 and tuner.state == "probing"
    with caplog.at_level(logging.WARNING, logger="autotune"):
        tuner.close()
    (warning,) = [r.getMessage() for r in caplog.records if "closed after" in r.getMessage()]
    needed = int(re.search(r"train for at least (\d+) steps", warning).group(1))
    planned = int(re.search(r"of the (\d+) probe steps it planned", warning).group(1))
    assert needed == s["check_steps"] + planned and "4 step(s) before this session" in warning, warning


def test_only_one_candidate_logs_no_empty_table_header(caplog) -> None:
    client = Client(table({}, default=0.01))
    space = make_space(threads=(BASELINE["threads"],), chunks=(BASELINE["chunk_numel"],))
    with caplog.at_level(logging.INFO, logger="autotune"):
        tuner = make_tuner(client, space=space, config=AutotuneConfig(probe_steps=40))
        client.run(tuner, 3)
    locked = [r.getMessage() for r in caplog.records if "locked in" in r.getMessage()]
    assert len(locked) == 1 and "only one candidate" in locked[0], locked
    assert "median ms" not in locked[0] and len(locked[0].splitlines()) == 1, locked[0]
