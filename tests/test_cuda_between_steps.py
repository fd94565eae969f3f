"""Issue 40: what the CUDA path stages through and what speculation writes into is made between
steps, never inside one, least of all during an overlapped backward.

* Pinned blocks (the staging rings, the early weights' places): page-locking synchronises the
  device, a known hang beside NCCL launches on several ranks. They are made on the idle worker
  when a pipeline, a chunk size, a ring depth or a kernel is set (``Pipeline.reserve``); the
  worker's take of a ring slot made them lazily, during the next step's backward.
* The second generation of the state (12 bytes per element): made at the end of a ``step()`` (or at
  a relayout), never by the backward hook of the first early chunk of a segment.

Without a GPU: the whole optimizer runs its CUDA path on fake device ops (``tests/_fake_cuda.py``)
over bf16 CPU parameters; the fake records, per page-locked block, whether it was made between
steps or during one (from the forward to the return of ``step()``); the loop checks the second
generation's bytes around each backward. Every result bitwise the host path's.

And the copy streams: torch 2.13 makes none outside its shared pool, so the transport logs their
handles (INFO), once per transport.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

import pytest
import torch
from _fake_cuda import FakeOps, FakeStream, Log
from conftest import assert_bitwise

from offload import CPUOffloadAdamW, OffloadSettings
from offload.kernels._fused_mp import fused_mp_available
from offload.pipeline._cuda_transport import CudaTransport

pytestmark = pytest.mark.usefixtures("single_threaded_main")

STEPS = 8


class _PinPhases(FakeOps):
    """Fake device ops that record, for every block pinned, the loop's phase and the thread."""

    def __init__(self) -> None:
        super().__init__(Log(10.0), 0, gate=False)
        self.phase = "construction"
        self.pins: list[tuple[str, str, int]] = []

    def pin(self, nbytes: int) -> torch.Tensor:
        self.pins.append((self.phase, threading.current_thread().name, nbytes))
        return super().pin(nbytes)


def _changes(kernel: str) -> dict[int, str]:
    """Step -> what changes right before it: ring depth, chunk size, a new param group, kernel."""
    out = {2: "ring_slots=3", 3: "chunk_numel=1024", 4: "add_param_group", 5: "ring_slots=2"}
    if kernel == "torch" and fused_mp_available()[0]:
        out[6] = "kernel=fused-mp"
    return out


def _run(kernel: str, ops: _PinPhases | None) -> tuple[torch.nn.Module, CPUOffloadAdamW, list[str]]:
    """``STEPS`` overlapped steps of a bf16 model (the last layer joins at step 4) with the
    changes of :func:`_changes`; where ``ops``: the problems seen (bytes of the second generation
    made by a backward)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)]).to(torch.bfloat16)
    opt = CPUOffloadAdamW([{"params": list(model[0].parameters()) + list(model[1].parameters())}], lr=1e-2,
                          weight_decay=0.1, overlap_backward=True, device_ops=ops,
                          settings=OffloadSettings(threads=1, chunk_numel=2048, kernel=kernel))
    problems = []
    for step in range(STEPS):
        change = _changes(kernel).get(step)
        if ops is not None:
            ops.phase = "between steps"
        if change == "add_param_group":
            opt.add_param_group({"params": list(model[2].parameters())})
        elif change is not None:
            key, value = change.split("=")
            opt.apply_settings(replace(opt.settings, **{key: value if key == "kernel" else int(value)}))
        if ops is not None:
            ops.phase = f"step {step}"
        _forward_may_read(ops)
        second = opt._layout.slabs.next_nbytes
        gen = torch.Generator().manual_seed(step)
        model(torch.randn(4, 64, generator=gen).to(torch.bfloat16)).float().square().mean().backward()
        if opt._layout.slabs.next_nbytes != second:
            problems.append(f"step {step}: backward made {opt._layout.slabs.next_nbytes - second} bytes of the "
                            "second generation")
        opt.step()
        opt.zero_grad()
    _forward_may_read(ops)
    if ops is not None:
        ops.phase = "after"
    return model, opt, problems


def _forward_may_read(ops: _PinPhases | None) -> None:
    """Where a forward's kernels would start: after what the caller's stream waits for (the last
    step's weight copies, still in flight on the fake device when ``step()`` returns)."""
    if ops is not None:
        landed = ops.event(("forward", 0, "start"))
        ops.record(landed, ops.caller)
        landed.synchronize()


@pytest.mark.parametrize("kernel", ["torch", "fused-mp"])
def test_pinned_blocks_and_the_second_generation_are_made_between_steps(kernel: str) -> None:
    if kernel == "fused-mp" and not fused_mp_available()[0]:
        pytest.skip(f"the native kernel does not build here: {fused_mp_available()[1]}")
    ops = _PinPhases()
    model, opt, problems = _run(kernel, ops)
    ref_model, ref, _ = _run(kernel, None)  # the host path, the same changes
    try:
        in_a_step = [(phase, thread, nbytes) for phase, thread, nbytes in ops.pins if phase.startswith("step")]
        assert ops.pins and not in_a_step, f"blocks pinned during a step (the worker's take in backward): {in_a_step}"
        assert not problems, problems
        assert opt.last_stats.pinned_registrations == 0 and opt.last_stats.committed_chunks > 0
        assert opt.settings.kernel == ("fused-mp" if fused_mp_available()[0] else "torch")
        assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "params")
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert_bitwise([opt.state[p][key] for p in model.parameters()],
                           [ref.state[p][key] for p in ref_model.parameters()], key)
    finally:
        opt.close()
        ref.close()
        assert not ops.pinned  # every block given back
        ops.close()


class _HandleOps(FakeOps):
    """Fake ops whose streams carry a CUDA handle and torch's id, as ``torch.cuda.Stream`` does."""

    def stream(self) -> FakeStream:
        s = super().stream()
        s.cuda_stream, s.stream_id = 0x7F00 + len(self.streams), 32 + len(self.streams)  # type: ignore[attr-defined]
        return s


def test_the_copy_streams_handles_are_logged_once_per_transport(caplog: pytest.LogCaptureFixture) -> None:
    ops = _HandleOps(Log(1.0), 0)
    try:
        with caplog.at_level(logging.INFO, logger="offload.pipeline._cuda_transport"):
            transport = CudaTransport(torch.device("cpu"), ops=ops)
        lines = [r.getMessage() for r in caplog.records if "copy streams" in r.getMessage()]
        assert lines == ["CUDA transport on cpu: copy streams d2h 0x7f01 (stream_id 33), h2d 0x7f02 (stream_id 34) "
                         "(from torch's stream pool, which NCCL and DDP also draw from)"], lines
        transport.close()
    finally:
        ops.close()
