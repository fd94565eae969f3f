"""The emulated accelerator of :mod:`bench.overlap`: a model whose forward and backward also wait.

On a GPU node the CPU is idle while the GPU runs backward; on a CPU-only machine backward's math
takes the cores the early optimizer chunks need, so ``overlap_backward`` can only lose there. This
module puts the GPU back as a wait: every layer is a real ``Linear`` (small batch, so its math is
short) followed by :class:`_Wait`, an autograd function that sleeps ``Waits.forward_s`` in forward
and ``Waits.backward_s`` in backward. ``time.sleep`` releases the GIL and the core, as a
``cudaStreamSynchronize`` would: the optimizer's worker thread has the trainer's core to itself
while the trainer "waits for the GPU". The gradients are real (the optimizer checksums, steps and
validates them as it would a GPU's); PCIe copies and GPU kernels are not emulated.

:func:`iteration` times one training iteration of a :class:`Trainee` (one mode's model and
optimizer); :func:`visit` runs a few in a row, the unit :mod:`bench.overlap` interleaves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["Clock", "EmulatedModel", "Trainee", "Waits", "build_model", "host_bytes_per_param", "iteration",
           "redo_kernel_s", "visit"]

Clock = Callable[[], float]


@dataclass(slots=True)
class Waits:
    """The modelled GPU time of one layer, shared by every layer of the models of one dtype (set
    between cases)."""

    forward_s: float = 0.0
    backward_s: float = 0.0


class _Wait(torch.autograd.Function):
    """Identity that sleeps (GIL and core released) in forward and in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, waits: Waits) -> torch.Tensor:  # type: ignore[override]
        ctx.waits = waits
        if waits.forward_s > 0:
            time.sleep(waits.forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        if ctx.waits.backward_s > 0:
            time.sleep(ctx.waits.backward_s)
        return grad, None


class EmulatedModel(torch.nn.Module):
    """``layers`` x (``Linear(width, width)`` then a wait of ``waits``)."""

    def __init__(self, layers: int, width: int, waits: Waits) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.waits = waits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = _Wait.apply(layer(x), self.waits)
        return x


def build_model(*, layers: int, width: int, dtype: torch.dtype, waits: Waits, seed: int) -> EmulatedModel:
    """The same initial weights for every ``seed`` (the global RNG is left as it was)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return EmulatedModel(layers, width, waits).to(dtype)


@dataclass(slots=True)
class Trainee:
    """One mode's model, optimizer and fixed batch (every iteration does the same work)."""

    mode: str
    model: EmulatedModel
    opt: Any
    x: torch.Tensor
    target: torch.Tensor

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def iteration(t: Trainee, *, clip: float | None, clock: Clock = time.perf_counter) -> dict[str, Any]:
    """One iteration: forward + backward (with their waits), then ``opt.clip_grad_norm_(clip)``
    (when ``clip``), ``step()`` and ``zero_grad()``. ``fb_s`` + ``exposed_s`` = ``iter_s``."""
    t0 = clock()
    out = t.model(t.x)
    loss = (out.float() - t.target).square().sum()
    loss.backward()
    t1 = clock()
    norm = t.opt.clip_grad_norm_(clip) if clip is not None else None
    t2 = clock()
    t.opt.step()
    t3 = clock()
    t.opt.zero_grad(set_to_none=True)
    t4 = clock()
    stats = t.opt.last_stats
    return {
        "iter_s": t4 - t0, "fb_s": t1 - t0, "exposed_s": t4 - t1, "clip_s": t2 - t1, "step_s": t3 - t2,
        "speculated": stats.speculated_chunks, "committed": stats.committed_chunks,
        "num_chunks": stats.num_chunks, "redo_kernel_s": redo_kernel_s(stats.spans),
        "materialize_s": stats.materialize_s,
        "paused": getattr(stats, "speculation_paused", None),
        "grad_norm": None if norm is None else float(norm),
    }


def redo_kernel_s(spans: Any) -> float:
    """Seconds of the gradient and kernel stages run a second time for a chunk in one step (a
    speculation that did not commit, recomputed in ``step()``): every run of a chunk's
    ``adam_kernel`` after its first, with the ``d2h`` stage that fed it."""
    seen: dict[tuple[str, int], int] = {}
    total = 0.0
    for s in sorted(spans, key=lambda s: s.start_s):
        if s.stage not in ("d2h", "adam_kernel"):
            continue
        key = (s.stage, s.chunk)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:
            total += s.end_s - s.start_s
    return total


def host_bytes_per_param(opt: Any, numel: int) -> float:
    """Host bytes the optimizer holds per parameter: its slabs (master where it has one, moments)
    plus their second generation (speculation). Reads a private attribute; changes nothing."""
    slabs = opt._layout.slabs
    return (slabs.nbytes + slabs.next_nbytes) / numel


def visit(t: Trainee, *, iters: int, clip: float | None, clock: Clock = time.perf_counter,
          before: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """``iters`` iterations of one trainee in a row: their records. ``before``: called (untimed)
    before each iteration (several ranks: a barrier, so their iterations run side by side)."""
    out = []
    for _ in range(iters):
        if before is not None:
            before()
        out.append(iteration(t, clip=clip, clock=clock))
    return out
