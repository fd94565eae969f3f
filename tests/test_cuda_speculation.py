"""Speculation on the CUDA transport, for items of torch's kernel (``kernel="torch"``, the fallback
without a C++ toolchain): what an early chunk consumed is checksummed on the worker from its
staged host copy, after the copy landed, and the backward hook does no device work.

Checked without a GPU: the transport's device operations go to fake streams
(``tests/_fake_cuda.py``), whose copies the test holds back to choose when a chunk's gradients
come down, and the gradients are host tensors that report a CUDA device (:class:`OnCuda`), so the
speculation takes its CUDA branches (``CPUOffloadAdamW(device_ops=)`` runs the whole optimizer on
fake ops, ``tests/test_cuda_optimizer.py``, but its gradients are plain host tensors, so the
speculation's CUDA branches need this file), so the chunks are driven as its launcher drives them: ``Speculation.launch`` and
``Pipeline.submit`` from a hook thread, then ``read_now``, ``verdicts``, the weight writes of the
chunks that stand, the redo of the others, the swap of the generations. Checked: the hook thread
makes no checksum and no torch call on a gradient; the worker checksums the staged (pinned)
copies; a gradient changed after the launch and changed back after the copy ran (A -> B -> A) is
redone, not committed; a plain loop commits every early chunk and gives torch's AdamW's bits
(fp32 and bf16 parameters, with the native checksum pass and with torch ops alone).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from _fake_cuda import CallRecorder, FakeEvent, FakeOps, Log

from offload.kernels._adamw import KernelSet, Hyper, new_step_tensor
from offload.kernels._grad_stats import checksums_
from offload.overlap._speculation import Speculation, checksums_of
from offload.pipeline._cuda_transport import CudaTransport
from offload.pipeline._jobs import ChunkJob
from offload.pipeline._pipeline import Pipeline
from offload.pipeline._step import write_job
from offload.state._items import KIND_TORCH, Item
from offload.state._params import ParamRecord
from offload.state._slabs import Chunk, HostSlabs, plan_chunks

SIZES = [700, 1500, 64, 2100, 333, 900]  # chunks of 2048: some parameters split over two chunks
HYPER = Hyper(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8)
HOOK_THREAD = "backward-hook"


class OnCuda(torch.Tensor):
    """A host tensor that says it is on ``cuda:0`` (so the speculation takes its CUDA branches);
    torch's ops see a plain CPU tensor and return plain tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


class Missing:
    """A loader without the native extension: the checksums are torch ops."""

    def get(self) -> tuple[None, str]:
        return None, "no native extension (test)"


class GradientCalls(CallRecorder):
    """Every torch call on this thread that takes a gradient (device work on a GPU)."""

    def records(self, name: str, args: tuple, kwargs: dict) -> bool:
        flat = [*args, *kwargs.values()]
        flat += [t for a in flat if isinstance(a, (list, tuple)) for t in a]
        return name != "__get__" and any(isinstance(a, OnCuda) for a in flat)


class Rig:
    """One speculating optimizer's pieces on the fake CUDA transport (see the module doc)."""

    def __init__(self, dtypes: Sequence[torch.dtype], loader: Any) -> None:
        gen = torch.Generator().manual_seed(5)
        self.gen = gen
        self.params = [torch.randn(n, generator=gen).to(d).requires_grad_(True) for n, d in zip(SIZES, dtypes)]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.ref = torch.optim.AdamW(self.masters, lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                                     weight_decay=HYPER.weight_decay, fused=True)
        self.slabs = HostSlabs([[p.shape for p in self.params]], speculable=None)
        for i, p in enumerate(self.params):
            self.slabs.flat("master", i).copy_(p.detach().float())
        self.chunks = plan_chunks(list(self.slabs.slots), 2048)
        self.segments = sorted({c.segment for c in self.chunks})
        self.slabs.ensure_next(self.segments)
        self.records = [ParamRecord(p, None, i) for i, p in enumerate(self.params)]
        self.state: dict[torch.Tensor, dict[str, Any]] = {p: {"step": new_step_tensor()} for p in self.params}
        self.summed: list[tuple[str, list[torch.Tensor]]] = []  # (thread, tensors) of every checksum call

        def counted(tensors: list[torch.Tensor]) -> torch.Tensor:
            self.summed.append((threading.current_thread().name, list(tensors)))
            return checksums_(tensors, loader=loader)

        kernels = KernelSet(checksums=counted, loader=loader)
        self.ops = FakeOps(Log(10.0), 0, gate=False)
        self.release = threading.Event()
        self.release.set()
        real = self.ops.copies

        def held(dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: Any, **kw: Any) -> None:
            stream.q.put(lambda: self.release.wait(30))  # the stream runs the copy once released
            real(dsts, srcs, stream, **kw)

        self.ops.copies = held  # type: ignore[method-assign]
        self.pipe = Pipeline(self.slabs, CudaTransport(torch.device("cpu"), slots=2, ops=self.ops),
                             name="speculation-worker", kernels=kernels)
        self.spec = Speculation(checksums_of(kernels))
        self.hook_calls: list[str] = []
        self.steps = 0

    def close(self) -> None:
        self.pipe.close()
        self.ops.close()

    def grads(self) -> list[torch.Tensor]:
        """New gradients, set as ``p.grad`` (what ``step()`` reads)."""
        grads = [torch.randn(p.numel(), generator=self.gen).to(p.dtype).as_subclass(OnCuda) for p in self.params]
        for p, g in zip(self.params, grads):
            p.grad = g
        return grads

    def backward(self, grads: list[torch.Tensor]) -> dict[int, ChunkJob]:
        """Every chunk started from a hook thread, as its gradients are complete."""
        ready = FakeEvent(("ready", self.steps, "end"))
        ready.done.set()
        jobs: dict[int, ChunkJob] = {}
        errors: list[BaseException] = []

        def hooks() -> None:
            try:
                with GradientCalls() as mode:
                    for c in self.chunks:
                        jobs[c.index] = self._launch(c, grads, ready)
                self.hook_calls.extend(mode.calls)
            except BaseException as exc:  # noqa: BLE001 - raised on the test's thread
                errors.append(exc)

        thread = threading.Thread(target=hooks, name=HOOK_THREAD)
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
        return jobs

    def _launch(self, c: Chunk, grads: list[torch.Tensor], ready: Any) -> ChunkJob:
        items = [Item(v, self.params[v.slot], grads[v.slot], self.state[self.params[v.slot]]["step"], KIND_TORCH)
                 for v in c.views]
        job = self.spec.launch(c, items, {v.slot: grads[v.slot] for v in c.views}, self.records, self.state,
                               host_weights=False, job=lambda before_kernel: ChunkJob(
                                   chunk=c.index, items=items, hyper=HYPER, threads=1, update=True, materialize=False,
                                   into_next=True, done=threading.Event(), ready_event=ready, before_kernel=before_kernel))
        self.pipe.submit(job)
        return job

    def step(self, on_judged: Callable[[], None] = lambda: None) -> list[int]:
        """``step()``: judge the early chunks, write those that stand, redo the others from the
        committed state with the gradients as they are now, swap; the reference steps on them
        too. Returns the redone chunks."""
        event = FakeEvent(("write", self.steps, "end"))
        event.done.set()
        launched = self.spec.take()
        reading = self.spec.read_now(launched, self.records)
        verdicts = dict(self.spec.verdicts(launched, self.records, lambda group: HYPER, lambda c: 0, (), reading,
                                           wait=self.pipe.wait_for))
        self.spec.publish_steps()
        for c, stale in verdicts.items():
            if not stale:
                self.pipe.submit(write_job(launched[c].job, threads=1, event=event))
                continue
            items = [Item(v, p, p.grad, self.state[p]["step"], KIND_TORCH)
                     for v in self.chunks[c].views for p in [self.params[v.slot]]]
            self.pipe.submit(ChunkJob(chunk=c, items=items, hyper=HYPER, threads=1, update=True, materialize=True,
                                      into_next=True, ready_event=event, write_event=event))
        result = self.pipe.drain()
        assert result.error is None, result.error
        result.last_h2d_event.synchronize()
        self.slabs.swap(self.segments, None)
        self.spec.close()
        for m, p in zip(self.masters, self.params):
            m.grad = torch.as_tensor(p.grad).float()
        self.ref.step()
        self.steps += 1
        return sorted(c for c, stale in verdicts.items() if stale)

    def assert_reference(self, what: str) -> None:
        for i, (p, m) in enumerate(zip(self.params, self.masters)):
            assert torch.equal(p.detach(), m.detach().to(p.dtype)), f"{what}: parameter {i} differs from torch's AdamW"
            assert torch.equal(self.slabs.flat("master", i), m.detach()), f"{what}: master {i} differs"

    def staged(self, t: torch.Tensor) -> bool:
        """``t`` is memory of a pinned block of the transport (a staged copy)."""
        return t.untyped_storage().data_ptr() in self.ops.pinned


LOADERS = {"native-or-torch": None, "torch-ops-only": Missing()}


@pytest.mark.parametrize("loader", list(LOADERS), ids=list(LOADERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_plain_loop_commits_every_early_chunk_with_torchs_bits_and_no_checksum_in_the_hooks(dtype, loader) -> None:
    rig = Rig([dtype if i % 2 else torch.float32 for i in range(len(SIZES))], LOADERS[loader])
    try:
        for step in range(3):
            grads = rig.grads()
            rig.summed.clear()
            rig.backward(grads)
            assert rig.step() == [], f"step {step}: early chunks redone in a loop that changed nothing"
            rig.assert_reference(f"step {step}")
            on_worker = [ts for thread, ts in rig.summed if thread == "speculation-worker"]
            assert len(on_worker) == len(rig.chunks), "one checksum call per early chunk, on the worker"
            assert all(rig.staged(t) for ts in on_worker for t in ts), "the worker summed something not staged"
    finally:
        rig.close()
    assert rig.hook_calls == [], f"torch calls on gradients in the hooks: {rig.hook_calls}"
    assert not [thread for thread, _ in rig.summed if thread == HOOK_THREAD], "checksums made in a hook"


@pytest.mark.parametrize("loader", list(LOADERS), ids=list(LOADERS))
def test_a_gradient_changed_after_the_launch_and_back_after_its_copy_is_redone(loader) -> None:
    """A -> B -> A: the copy takes B (what the early kernel consumes), the step sees A again."""
    rig = Rig([torch.bfloat16 if i % 2 else torch.float32 for i in range(len(SIZES))], LOADERS[loader])
    try:
        rig.backward(rig.grads())  # a first step, committed: the state is not the initial one
        assert rig.step() == []
        grads = rig.grads()
        was = grads[1].clone()  # slot 1 (bf16) lies in chunks 0 and 1
        holding = [c.index for c in rig.chunks if any(v.slot == 1 for v in c.views)]
        rig.release.clear()  # the gradient copies wait
        jobs = rig.backward(grads)
        grads[1].add_(1.0)  # B, after the launch, before the copy
        rig.release.set()  # the copies run: chunk 0's stages B
        for c in holding:
            rig.pipe.wait_for(jobs[c])  # its kernel consumed B
        grads[1].copy_(was)  # A again, before step()
        redone = rig.step()
        assert redone == holding, f"redone {redone}: expected the chunks that read slot 1, {holding}"
        rig.assert_reference("after A -> B -> A")  # the redo consumed A, as torch's AdamW did
    finally:
        rig.close()
    assert rig.hook_calls == [], f"torch calls on gradients in the hooks: {rig.hook_calls}"
