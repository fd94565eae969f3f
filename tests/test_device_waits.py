"""Host waits on device events (the CUDA transport, ``offload/pipeline/_waits.py``): polled with
sleeps that double from 50 us up to 1 ms instead of a spinning ``synchronize()``, and bounded: a
copy that never ends (a dead peer) fails ``step()`` with one line naming the chunk, the event and
the timeout (``CPUOffloadAdamW(device_timeout_s=)``), and the optimizer's rule for failed steps
holds (whole, or refused while a parameter is part-stepped). The clock and sleep of the unit tests
are fakes; the end-to-end ones use a timeout of 50 ms that only has to elapse."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _fake_cuda import FakeEvent, FakeOps, FakeStream, Log

from offload import CPUOffloadAdamW, OffloadSettings
from offload.pipeline._waits import FIRST_SLEEP_S, LONGEST_SLEEP_S, DeviceWaitTimeout, EventWait

pytestmark = pytest.mark.usefixtures("single_threaded_main")

TIMEOUT_S = 0.05
HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}


class _Event:
    """Done at its ``done_after``-th query (never: None); counts the queries."""

    def __init__(self, done_after: int | None) -> None:
        self.done_after, self.queries = done_after, 0

    def query(self) -> bool:
        self.queries += 1
        return self.done_after is not None and self.queries >= self.done_after


class _Clock:
    """A clock that only the fake sleep moves; the sleeps are recorded."""

    def __init__(self) -> None:
        self.now, self.sleeps = 1000.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_a_completed_event_costs_one_query_and_no_sleep() -> None:
    clock = _Clock()
    event = _Event(done_after=1)
    EventWait(1.0, clock=clock, sleep=clock.sleep)(event, ("d2h", 0, "end"), "chunk 0's gradients")
    assert event.queries == 1 and clock.sleeps == []


def test_a_wait_sleeps_between_polls_doubling_from_50_us_up_to_1_ms() -> None:
    clock = _Clock()
    event = _Event(done_after=10)
    EventWait(1.0, clock=clock, sleep=clock.sleep)(event, ("d2h", 0, "end"), "chunk 0's gradients")
    assert event.queries == 10
    assert clock.sleeps == pytest.approx([50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1e-3, 1e-3, 1e-3, 1e-3])
    assert (FIRST_SLEEP_S, LONGEST_SLEEP_S) == (50e-6, 1e-3)


def test_a_wait_past_its_timeout_raises_one_line_naming_what_the_event_and_the_timeout() -> None:
    clock = _Clock()
    event = _Event(done_after=None)
    wait = EventWait(0.01, clock=clock, sleep=clock.sleep)
    with pytest.raises(DeviceWaitTimeout) as info:
        wait(event, ("h2d", 7, "end"), "the weight ring's slot 1 (its last copy)")
    message = str(info.value)
    assert isinstance(info.value, RuntimeError) and "\n" not in message
    assert message.startswith("the weight ring's slot 1 (its last copy): device event ('h2d', 7, 'end') not "
                              "complete after 0.01 s (device_timeout_s)"), message
    waited = sum(clock.sleeps)
    assert 0.01 <= waited < 0.01 + LONGEST_SLEEP_S  # it gave up at the first poll past the deadline
    assert max(clock.sleeps) == LONGEST_SLEEP_S  # (no spinning: every poll after a sleep)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "300"])
def test_a_bad_device_timeout_is_refused_at_construction_naming_it(bad: Any) -> None:
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with pytest.raises(ValueError, match=re.escape(f"device_timeout_s={bad!r}: expected a finite number of seconds > 0")):
        CPUOffloadAdamW(model.parameters(), device_timeout_s=bad)


class _DeadOps(FakeOps):
    """Fake device ops where, once :attr:`dead` is set, the copies whose end event has one of its
    labels never end (the copy stream waits behind a collective of a peer that died)."""

    def __init__(self) -> None:
        super().__init__(Log(10.0), 0, gate=False)
        self.dead: set[tuple[str, int, str]] = set()

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        if event.label in self.dead:
            return  # never reached
        super().record(event, stream)


@pytest.fixture
def ops() -> Iterator[_DeadOps]:
    ops = _DeadOps()
    yield ops
    ops.close()


def _step(opt: CPUOffloadAdamW, params: list[torch.Tensor], step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    opt.step()


def _snapshot(opt: CPUOffloadAdamW, params: list[torch.Tensor], ops: FakeOps) -> list[torch.Tensor]:
    """Weights and state as the next forward would see them: on a GPU it is queued behind what the
    caller's stream waits for (the weight copies); here this thread waits until the caller's fake
    stream ran to that point (reading the weights right after ``step()`` may see copies still in
    flight: on a loaded machine it did)."""
    landed = ops.event(("forward", 0, "start"))
    ops.record(landed, ops.caller)
    landed.synchronize()
    return [t.clone() for p in params for t in (p.detach(), *opt.state[p].values())]


def test_a_gradient_copy_that_never_ends_fails_step_naming_the_chunk_and_a_part_stepped_optimizer_refuses(
        ops: _DeadOps) -> None:
    """One parameter over chunks 0-2: chunk 0 stepped, chunk 1's gradients never arrive. ``step()``
    raises after the timeout instead of hanging, and, the parameter being part-stepped, the
    optimizer refuses to go on (before: ``synchronize()`` waited forever). The caller's stream is
    still ordered after the weight copy that went up."""
    params = [torch.nn.Parameter(torch.randn(3 * 1024).to(torch.bfloat16))]
    opt = CPUOffloadAdamW(params, settings=OffloadSettings(threads=1, chunk_numel=1024), device_ops=ops,
                          device_timeout_s=TIMEOUT_S, **HYPER)
    try:
        _step(opt, params, 0)
        ops.dead = {("d2h", 1, "end")}
        with pytest.raises(RuntimeError, match=re.escape(
                "chunk 1's gradients (their copy to the host): device event ('d2h', 1, 'end') not complete after "
                f"{TIMEOUT_S:g} s (device_timeout_s)")):
            _step(opt, params, 1)
        # chunk 0's weights went up: the caller's stream waits for them, though the step's end
        # (stray gradient copies waited for) timed out again on chunk 1's
        assert ops.caller_waits[-1] == ("h2d", 0, "end"), ops.caller_waits
        with pytest.raises(RuntimeError, match=r"CPUOffloadAdamW.step\(\) refused: step\(\) failed part-way "
                                               r"\(DeviceWaitTimeout: chunk 1's gradients .*part-stepped"):
            _step(opt, params, 2)
        with pytest.raises(RuntimeError, match=r"state_dict\(\) refused"):
            opt.state_dict()
    finally:
        opt.close()


def test_a_gradient_copy_that_never_ends_before_any_update_leaves_the_state_whole(ops: _DeadOps) -> None:
    """Chunk 0's gradients never arrive: no chunk was updated, ``step()`` raises naming chunk 0 and
    leaves every weight and state tensor as the last step left them; nothing is refused."""
    params = [torch.nn.Parameter(torch.randn(1024).to(torch.bfloat16)) for _ in range(2)]
    opt = CPUOffloadAdamW(params, settings=OffloadSettings(threads=1, chunk_numel=1024), device_ops=ops,
                          device_timeout_s=TIMEOUT_S, **HYPER)
    try:
        _step(opt, params, 0)
        before = _snapshot(opt, params, ops)
        ops.dead = {("d2h", 0, "end")}
        with pytest.raises(RuntimeError, match=re.escape("chunk 0's gradients (their copy to the host): device "
                                                         "event ('d2h', 0, 'end') not complete")):
            _step(opt, params, 1)
        after = _snapshot(opt, params, ops)
        assert all(torch.equal(a, b) for a, b in zip(before, after))
        opt.state_dict()  # not refused: every parameter is as the last step left it
    finally:
        opt.close()
