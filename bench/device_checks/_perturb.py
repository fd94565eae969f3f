"""How the GPU checks of ``bench.device_checks`` disturb the timing of a loop without changing its
math: GPU sleeps queued before in-place gradient edits, before each chunk's copies (a copy
engine that falls behind), in backward pre-hooks (gradients final long after their hooks
fired), and a competing CPU load (kernels that run late). On the CPU the sleeps do nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["CpuLoad", "SLEEP_CYCLES", "SlowCopies", "delay_gradients", "edit_after_backward", "sleep"]

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time: long enough for a side stream to run ahead


class SlowCopies:
    """The real CUDA device ops with a GPU sleep queued on the copy stream before each chunk's
    copies: a copy engine that falls behind, so a chunk's gradients come down long after its
    launch, while the loop goes on changing them."""

    def __init__(self, ops: Any) -> None:
        self._ops = ops

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)

    def copies(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: Any, **kwargs: Any) -> None:
        with torch.cuda.stream(stream):
            sleep("cuda", SLEEP_CYCLES // 4)
        self._ops.copies(dsts, srcs, stream, **kwargs)


class CpuLoad:
    """Two threads of CPU matrix products (GIL released) for the block: the optimizer's kernels
    run slowly and late, so copies and in-place changes land around them."""

    def __enter__(self) -> CpuLoad:
        import threading

        self._stop = threading.Event()

        def spin() -> None:
            a = torch.randn(512, 512)
            while not self._stop.is_set():
                a @ a

        self._threads = [threading.Thread(target=spin, daemon=True) for _ in range(2)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def sleep(device: str, cycles: int = SLEEP_CYCLES) -> None:
    """A GPU sleep of ``cycles`` clock cycles queued on the current CUDA stream (the one private
    torch API here: ``torch.cuda._sleep``); nothing on the CPU."""
    if device == "cuda":
        torch.cuda._sleep(cycles)


def edit_after_backward(device: str, how: str) -> Callable[[nn.Module], None]:
    """An in-place change of the gradients after backward, queued behind a GPU sleep so that a
    copy stream that does not wait for it runs first: ``half`` (A -> A/2), ``aba`` (A -> 2A -> A,
    the content step() sees is A again)."""

    def edit(model: nn.Module) -> None:
        with torch.no_grad():
            sleep(device)
            for p in model.parameters():
                p.grad.mul_(0.5 if how == "half" else 2.0)
            if how == "aba":
                sleep(device)
                for p in model.parameters():
                    p.grad.mul_(0.5)

    return edit


def delay_gradients(model: nn.Module, device: str) -> list[int]:
    """A GPU sleep queued on the current stream in every layer's backward pre-hook: the layer's
    weight and bias gradients are computed behind it, so they become final on the device long
    after the hooks that start their chunks fired on the host. A d2h copy that does not wait for
    the gradients (``ready_event``), or an h2d copy that does not wait for backward to have read
    the weights (``write_event``), then reads or writes too early. Returns the hook's call count."""
    calls = [0]

    def delay(module: nn.Module, grad_output: Any) -> None:
        calls[0] += 1
        sleep(device)

    for layer in model:
        layer.register_full_backward_pre_hook(delay)
    return calls
