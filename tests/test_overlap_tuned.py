"""Overlap that never costs: the speculate knob (switched by hand or by the tuner) and the pause
after steps that redo every early chunk; bitwise equal to overlap off throughout."""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import assert_bitwise, batch, make_model, param_groups

from autotune import AutotuneConfig, OnlineTuner, SearchSpace, StepSample
from offload import CPUOffloadAdamW, OffloadSettings
from offload.overlap._launcher import PAUSE_AFTER_STALE_STEPS
from offload.tuning._glue import offload_search_space

pytestmark = pytest.mark.usefixtures("single_threaded_main")

SETTINGS = OffloadSettings(threads=1, chunk_numel=1024)


def _step(model: torch.nn.Module, opt: CPUOffloadAdamW, step: int, *, clip: bool) -> None:
    opt.zero_grad(set_to_none=True)
    model(batch(step, 0)).backward()
    if clip:
        opt.clip_grad_norm_(1e-3)  # below every norm: each step is clipped
    opt.step()


def _pair() -> tuple[torch.nn.Module, CPUOffloadAdamW, torch.nn.Module, CPUOffloadAdamW]:
    plain_model, over_model = make_model(torch.float32), make_model(torch.float32)
    plain = CPUOffloadAdamW(param_groups(plain_model), settings=SETTINGS)
    over = CPUOffloadAdamW(param_groups(over_model), settings=SETTINGS, overlap_backward=True)
    return plain_model, plain, over_model, over


def test_speculation_pauses_while_every_step_clips_and_resumes_after(caplog: pytest.LogCaptureFixture) -> None:
    plain_model, plain, over_model, over = _pair()
    clips = [False, False] + [True] * (PAUSE_AFTER_STALE_STEPS + 2) + [False, False]
    seen = []
    with caplog.at_level(logging.INFO, logger="offload.overlap._launcher"):
        for step, clip in enumerate(clips):
            _step(plain_model, plain, step, clip=clip)
            _step(over_model, over, step, clip=clip)
            stats = over.last_stats
            seen.append((stats.speculated_chunks, stats.committed_chunks, stats.speculation_paused))
    first_clip = 2
    assert seen[1][0] > 0 and seen[1][0] == seen[1][1]  # calibrated, nothing in the way: all commit
    for k in range(PAUSE_AFTER_STALE_STEPS):  # every early chunk of a clipped step is redone
        speculated, committed, paused = seen[first_clip + k]
        assert speculated > 0 and committed == 0
        assert paused == (k == PAUSE_AFTER_STALE_STEPS - 1)
    paused_steps = seen[first_clip + PAUSE_AFTER_STALE_STEPS:first_clip + PAUSE_AFTER_STALE_STEPS + 2]
    assert all(s == (0, 0, True) for s in paused_steps), seen  # nothing starts during backward
    assert seen[-2] == (0, 0, False)  # this unclipped step would have committed: resume
    assert seen[-1][0] > 0 and seen[-1][0] == seen[-1][1], seen  # and the next one speculates again
    assert "speculation paused" in caplog.text and "speculation resumes" in caplog.text
    assert_bitwise(list(over_model.parameters()), list(plain_model.parameters()), "params")
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert_bitwise([over.state[p][key] for p in over_model.parameters() if over.state.get(p)],
                       [plain.state[p][key] for p in plain_model.parameters() if plain.state.get(p)], key)


def test_speculate_off_runs_every_chunk_in_step_and_on_again_starts_them_early() -> None:
    plain_model, plain, over_model, over = _pair()
    speculated = []
    for step in range(6):
        if step == 2:
            over.apply_settings(replace(over.settings, speculate=False))
        if step == 4:
            over.apply_settings(replace(over.settings, speculate=True))
        _step(plain_model, plain, step, clip=False)
        _step(over_model, over, step, clip=False)
        speculated.append(over.last_stats.speculated_chunks)
    assert speculated[0] == 0 and speculated[1] > 0
    assert speculated[2] == speculated[3] == 0
    assert speculated[4] > 0 and speculated[5] > 0
    assert_bitwise(list(over_model.parameters()), list(plain_model.parameters()), "params")


def test_speculate_is_a_checked_setting() -> None:
    with pytest.raises(ValueError, match=r"OffloadSettings.speculate=1: expected a bool"):
        OffloadSettings(speculate=1)  # type: ignore[arg-type]


def _fingerprint(*, workload: Any, space: SearchSpace, local_world_size: int) -> Any:
    return SimpleNamespace(key=f"key-{space.digest()}", details={"space": space.to_dict()})


@pytest.mark.parametrize(("on_cost", "winner"), [(1.3, False), (0.7, True), (1.0, True)])
def test_the_tuner_locks_in_speculate_off_where_it_costs(on_cost: float, winner: bool) -> None:
    """Injected iteration times: on costs ``on_cost`` x off. Off wins only when it is clearly
    faster than the baseline (speculate on, as the user asked); a tie keeps on."""
    space = offload_search_space(max_threads=2, baseline_threads=2, largest_slab=1 << 20,
                                 baseline_chunk=1 << 20, fixed_threads=False, speculate=True)
    assert [k.name for k in space.knobs] == ["threads", "chunk_numel", "speculate"]
    current: dict[str, Any] = {}

    def cost(setting: dict[str, Any]) -> float:
        return (on_cost if setting["speculate"] else 1.0) * (1.0 + 0.05 * (setting["threads"] != 2))

    tuner = OnlineTuner(space, baseline={"threads": 2, "chunk_numel": 1 << 20, "speculate": True},
                        apply=current.update, config=AutotuneConfig(), workload={"params": 1},
                        clock=itertools.count().__next__, fingerprint=_fingerprint)
    tuner.start()
    for _ in range(200):
        tuner.observe(StepSample(time_s=cost(current), stages={}, spans=()))
        if tuner.state == "locked":
            break
    assert tuner.state == "locked"
    assert tuner.summary()["winner"]["speculate"] is winner
