"""The drift watch after lock-in, reached through the tuner's public injection points: fake step
times in ``StepSample``s and an injected clock (no private patch, no wall clock)."""

from __future__ import annotations

import logging

from test_tuner_logic import BASELINE, Client, fake_fingerprint, make_space, make_tuner, valley

from autotune import AutotuneConfig, OnlineTuner

ONE = make_space(threads=(BASELINE["threads"],), chunks=(BASELINE["chunk_numel"],))


def drift_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "runs slower than measured" in r.getMessage()]


def test_the_warning_names_the_window_the_reference_and_the_ratio(caplog) -> None:
    factor = {"now": 0.001}
    client = Client(lambda s: factor["now"])
    config = AutotuneConfig(drift_window=2, drift_patience=1)
    tuner = make_tuner(client, space=ONE, config=config)
    client.run(tuner, 2)  # one candidate: the first window (1 ms) is the reference
    factor["now"] = 0.0025
    with caplog.at_level(logging.WARNING, logger="autotune"):
        client.run(tuner, 2)
    assert drift_warnings(caplog) == [
        "OnlineTuner: step 3: locked setting threads=8 chunk_numel=1048576 runs slower than measured: window "
        "median 2.50 ms vs locked median 1.00 ms (x2.50) for 1 windows of 2 steps; keeping it"
    ]


def test_a_normal_window_between_slow_ones_resets_the_patience(caplog) -> None:
    factor = {"now": 1.0}
    client = Client(lambda s: factor["now"])
    tuner = make_tuner(client, space=ONE, config=AutotuneConfig(drift_window=2, drift_patience=2))
    client.run(tuner, 2)  # the reference window
    with caplog.at_level(logging.WARNING, logger="autotune"):
        for now in (2.0, 1.0, 2.0):  # slow, normal, slow: never two slow windows in a row
            factor["now"] = now
            client.run(tuner, 2)
        assert tuner.summary()["drift_events"] == 0 and drift_warnings(caplog) == []
        client.run(tuner, 2)  # the second slow window in a row
    assert tuner.summary()["drift_events"] == 1 and len(drift_warnings(caplog)) == 1


def test_a_window_at_exactly_the_factor_is_not_slow() -> None:
    factor = {"now": 1.0}
    client = Client(lambda s: factor["now"])
    config = AutotuneConfig(drift_window=2, drift_patience=1, drift_factor=1.5)
    tuner = make_tuner(client, space=ONE, config=config)
    client.run(tuner, 2)
    factor["now"] = 1.5
    client.run(tuner, 10)
    assert tuner.summary()["drift_events"] == 0


def test_re_probes_stop_at_max_reprobes_and_later_drifts_only_warn(caplog) -> None:
    best = {"threads": 4, "chunk_numel": 1 << 22}
    factor = {"now": 1.0}
    client = Client(lambda s: valley(best)(s) * factor["now"])
    config = AutotuneConfig(probe_steps=80, drift_window=4, drift_patience=1, drift_reprobe=True, max_reprobes=1)
    tuner = make_tuner(client, config=config)
    client.run(tuner, 80, until_locked=True)
    assert tuner.state == "locked"
    factor["now"] = 2.0  # every setting slows down: a re-probe, then a new lock-in at the new speed
    with caplog.at_level(logging.WARNING, logger="autotune"):
        client.run(tuner, 4)
        assert tuner.state == "probing" and tuner.summary()["reprobes"] == 1
        client.run(tuner, 80, until_locked=True)
        assert tuner.state == "locked" and tuner.summary()["winner"] == best
        factor["now"] = 4.0  # slower again: the re-probe budget is spent
        client.run(tuner, 4)
    s = tuner.summary()
    assert tuner.state == "locked" and s["drift_events"] == 2 and s["reprobes"] == 1
    assert [w.rsplit("; ", 1)[1] for w in drift_warnings(caplog)] == ["re-probing", "keeping it"]


def test_without_a_drift_window_a_locked_step_reads_no_clock() -> None:
    reads = {"n": 0}

    def clock() -> float:
        reads["n"] += 1
        return float(reads["n"])

    client = Client(lambda s: 1.0)
    tuner = OnlineTuner(ONE, baseline=BASELINE, apply=client.apply, clock=clock, fingerprint=fake_fingerprint)
    tuner.start()
    before = reads["n"]
    client.run(tuner, 5)
    assert tuner.state == "locked" and reads["n"] == before
