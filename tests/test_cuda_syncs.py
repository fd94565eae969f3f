"""No host-device sync on the trainer's threads from the CUDA transport, counted through fake
device ops (no GPU): chunks started from a backward hook's thread and the jobs and drain of
``step()`` make no host wait on a device event and call nothing that syncs on a device tensor
(``.item()``, ``.cpu()``, ``.tolist()``, ``torch.tensor(..., device=...)``, ...). The worker waits
only for its own copies (a chunk's gradients before its kernel, a ring slot's previous copy
before reusing it), a bounded number per chunk, and queues each chunk's copies of one direction
in one call (one stream context, not one per tensor)."""

from __future__ import annotations

import threading

import torch
from _fake_cuda import HYPER, CallRecorder, FakeEvent, FakeOps, Log, stepped_case

from offload.kernels._adamw import DEFAULT_KERNELS, new_step_tensor
from offload.pipeline._cuda_transport import CudaTransport
from offload.pipeline._jobs import ChunkJob
from offload.pipeline._pipeline import Pipeline
from offload.state._items import KIND_TORCH, Item
from offload.state._slabs import plan_chunks

#: Tensor methods and functions that wait for the device when their tensor is on one.
SYNCING = {"item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "synchronize"}


class SyncCalls(CallRecorder):
    """Every torch call on this thread that would sync with a device."""

    def records(self, name: str, args: tuple, kwargs: dict) -> bool:
        return name in SYNCING or (name == "tensor" and "device" in kwargs) or (
            name == "to" and any(str(a) == "cpu" for a in (*args[1:], kwargs.get("device"))))


def test_hooks_and_step_make_no_host_device_sync_and_the_worker_waits_only_for_its_copies() -> None:
    params, masters, ref, slabs = stepped_case(11, fp32=lambda i: i % 2 == 0)
    gen = torch.Generator().manual_seed(12)
    chunks = plan_chunks(list(slabs.slots), 2048)
    ops = FakeOps(Log(10.0), 0, gate=False)
    pipe = Pipeline(slabs, CudaTransport(torch.device("cpu"), slots=2, ops=ops), name="sync-test",
                    kernels=DEFAULT_KERNELS)
    steps = [new_step_tensor() for _ in params]
    calls: dict[str, list[str]] = {}
    jobs = 0
    try:
        for step in range(4):
            grads = [torch.randn(p.numel(), generator=gen).to(p.dtype) for p in params]
            for m, g in zip(masters, grads):
                m.grad = g.float()
            ref.step()
            items = {c.index: [Item(v, params[v.slot], grads[v.slot], steps[v.slot], KIND_TORCH) for v in c.views]
                     for c in chunks}
            ready = FakeEvent(("ready", step, "end"))  # the launch event, recorded on the device
            ready.done.set()

            def backward() -> None:  # the hooks: each chunk starts as its gradients are complete
                with SyncCalls() as mode:
                    for c in chunks:
                        pipe.submit(ChunkJob(chunk=c.index, items=items[c.index], hyper=HYPER, threads=1,
                                             update=True, materialize=False, ready_event=ready))
                calls.setdefault("backward", []).extend(mode.calls)

            hooks = threading.Thread(target=backward, name="backward")
            hooks.start()
            hooks.join()
            with SyncCalls() as mode:  # step(): the committed chunks' weights go up; the drain
                for c in chunks:
                    pipe.submit(ChunkJob(chunk=c.index, items=items[c.index], hyper=HYPER, threads=1,
                                         update=False, materialize=True, write_event=ready))
                result = pipe.drain()
            calls.setdefault("step", []).extend(mode.calls)
            jobs += 2 * len(chunks)
            assert result.error is None, result.error
            result.last_h2d_event.synchronize()  # (the test's own check, as a later forward would wait)
            for i, (p, m) in enumerate(zip(params, masters)):
                assert torch.equal(p, m.detach().to(p.dtype)), f"step {step}: parameter {i} differs from torch's AdamW"
        # the fake streams' threads wait on events too: those are device-side waits
        waits = [(thread, label) for thread, label in ops.host_waits if thread in ("sync-test", "MainThread")]
    finally:  # (close waits for the last copies before giving the pinned memory back)
        pipe.close()
        ops.close()
    assert calls == {"backward": [], "step": []}, f"syncing calls on the trainer's threads: {calls}"
    # the trainer's thread: only the test's own wait for each step's last weight copy, above
    main = [label for thread, label in waits if thread == "MainThread"]
    assert len(main) == 4 and all(label[0] == "h2d" for label in main), main
    worker = [label for thread, label in waits if thread == "sync-test"]
    assert all(label[0] in ("d2h", "h2d") and label[2] == "end" for label in worker), worker
    # per job: its gradients' arrival and at most one ring slot's previous copy (plus the
    # step's end: stray gradient copies and the ring brought to size)
    assert len(worker) <= 2 * jobs + 4 * 2 * 2, (len(worker), jobs)
    # one call per chunk and direction, whatever its number of tensors
    per_chunk = [len(c.views) for c in chunks]
    assert ops.copy_calls == per_chunk * 8, ops.copy_calls
