"""``TuningSession``: the tuner for anyone's knobs (docs/autotune.md, "Tune your own knobs").

The doc's example runs as written, twice, in a fresh folder: the first run probes, locks in and
writes the cache and its trace folder; the second hits the cache with no probe steps and writes
a second folder beside the first. The session's wiring (cache and trace from the config, the
step timed only while the tuner measures, close writing the summary) is checked with an
injected clock.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _forked import run_python

from autotune import AutotuneConfig, Knob, SearchSpace, TuningCache, TuningSession

ROOT = Path(__file__).resolve().parents[1]


def _example() -> str:
    text = (ROOT / "docs" / "autotune.md").read_text()
    section = text[text.index("## Tune your own knobs"):text.index("## Protocol")]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the section has one example"
    return blocks[0]


def test_the_docs_example_runs_twice_and_the_second_run_hits_the_cache(tmp_path: Path) -> None:
    example = _example()
    outs = []
    for _ in range(2):
        done = run_python(["-c", example], cwd=tmp_path, timeout=600, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
        assert done.returncode == 0, done.stderr[-3000:]
        outs.append(done.stdout.split())
    assert outs[0][0] == "locked" and outs[0][-2] == "False" and int(outs[0][-1]) > 0, outs[0]
    assert (tmp_path / "runs" / "knobs-cache.json").is_file()
    runs = tmp_path / "runs" / "knobs"
    assert sorted(p.name for p in runs.iterdir() if p.name.startswith("run-")) == ["run-1", "run-2"]
    first = json.loads((runs / "run-1" / "summary.json").read_text())
    second = json.loads((runs / "run-2" / "summary.json").read_text())
    assert first["cache_hit"] is False and first["probe_steps"] > 0
    assert outs[1][-2] == "True" and second["cache_hit"] is True, outs[1]
    # Real step times: a cached choice other than the static plan is re-checked against it in
    # paired rounds, and re-tuned where the plan is clearly faster today ("stale"), as documented.
    if second["cache_status"] != "stale":
        assert outs[1][0] == "locked" and outs[1][-1] == "0" and second["probe_steps"] == 0, outs[1]
    assert (runs / "run-1" / "trace.jsonl").read_text().count("\n") >= first["probe_steps"] // 2


class Clock:
    """Each call advances by the current setting's cost (the step's time) plus nothing else."""

    def __init__(self, cost: dict[int, float], setting: dict) -> None:
        self.t = 0.0
        self.cost = cost
        self.setting = setting
        self.started = False

    def __call__(self) -> float:
        if self.started:  # the end of a step
            self.t += self.cost[self.setting["threads"]]
        self.started = not self.started
        return self.t


def test_a_session_times_steps_locks_in_the_fastest_and_writes_its_trace(tmp_path: Path) -> None:
    setting: dict = {}
    clock = Clock({1: 0.010, 2: 0.004, 4: 0.007}, setting)
    config = AutotuneConfig(cache_path=tmp_path / "c.json", trace_dir=tmp_path / "t")
    session = TuningSession(SearchSpace((Knob("threads", (1, 2, 4)),)), baseline={"threads": 1},
                            apply=setting.update, config=config, workload={"what": "test"}, clock=clock)
    assert setting == session.setting
    assert session.trace_dir == tmp_path / "t" / "run-1"
    calls = []
    for i in range(60):
        assert session.step(calls.append, i) is None
    assert calls == list(range(60))
    assert session.state == "locked" and session.summary()["winner"] == {"threads": 2}
    session.close()
    session.close()  # idempotent
    assert json.loads((tmp_path / "t" / "run-1" / "summary.json").read_text())["winner"] == {"threads": 2}
    (entry,) = TuningCache(tmp_path / "c.json").records().values()
    assert entry.speedup == pytest.approx(session.summary()["speedup"])  # what `autotune show` prints
    again = TuningSession(SearchSpace((Knob("threads", (1, 2, 4)),)), baseline={"threads": 1},
                          apply=setting.update, config=config, workload={"what": "test"}, clock=clock)
    assert again.summary()["cache_hit"] and setting == {"threads": 2}
    again.close()


def test_trace_runs_false_writes_into_the_folder_given(tmp_path: Path) -> None:
    config = AutotuneConfig(use_cache=False, trace_dir=tmp_path, trace_runs=False)
    with TuningSession(SearchSpace((Knob("k", (1, 2)),)), baseline={"k": 1}, apply=lambda s: None,
                       config=config) as session:
        assert session.trace_dir == tmp_path
    assert (tmp_path / "summary.json").is_file()


def test_bad_arguments_are_refused_with_the_value() -> None:
    space = SearchSpace((Knob("k", (1, 2)),))
    with pytest.raises(ValueError, match="config=3: expected an AutotuneConfig"):
        TuningSession(space, baseline={"k": 1}, apply=lambda s: None, config=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="baseline"):
        TuningSession(space, baseline={"k": 5}, apply=lambda s: None, config=AutotuneConfig(use_cache=False))
    with pytest.raises(ValueError, match="AutotuneConfig.trace_runs='yes': expected a bool"):
        AutotuneConfig(trace_runs="yes")  # type: ignore[arg-type]
