"""What one ``step()`` reports: its stage times (:class:`StepStats`, ``CPUOffloadAdamW.last_stats``)
and the pipeline stages of each chunk (:class:`StageSpan`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from offload._settings import Kernel

__all__ = ["StageSpan", "StepStats"]


@dataclass(frozen=True, slots=True)
class StageSpan:
    """One pipeline stage of one chunk, in seconds relative to the start of ``step()``.

    Spans that started during backward (overlap mode) have negative ``start_s``.
    """

    stage: str  # "d2h" | "adam_kernel" | "materialize"
    chunk: int
    start_s: float
    end_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class StepStats:
    """Stage times of one optimizer step, in seconds.

    Stage times are sums over chunks; with a pipeline they overlap, so they may add up to more
    than ``step_s``.
    """

    step_s: float
    """Wall time of ``step()``: from its call to its return."""
    d2h_s: float
    """Gradients to host and upcast to fp32."""
    adam_kernel_s: float
    """The AdamW kernel on the host slabs."""
    materialize_s: float
    """Updated weights back into the model parameters (downcast, host to device)."""
    drain_s: float
    """Time ``step()`` waited for chunks still in flight (the whole step without overlap)."""
    threads: int
    chunk_numel: int
    num_chunks: int
    numel: int
    """Elements updated this step."""
    kernel: Kernel = "torch"
    """The kernel that really ran: "fused-mp" if it updated any element this step, else "torch"."""
    speculated_chunks: int = 0
    """Chunks started during backward (``overlap_backward``) for this step."""
    committed_chunks: int = 0
    """Of those, the chunks whose speculative update was committed as it was (the rest were
    rolled back and recomputed in ``step()``: a gradient, hyper-parameter, clip coefficient or
    grad scale changed after they started)."""
    speculation_paused: bool = False
    """Speculation is paused after this step: several steps in a row redid every early chunk (e.g.
    clipping on every step); it resumes at the first step whose hyper-parameters, clip coefficient
    and grad scale would have let an early chunk commit."""
    pinned_bytes: int = 0
    """CUDA: page-locked host memory the optimizer holds after this step (its pinned ring slots
    and, with ``overlap_backward`` and fused-mp, the places of the weights chunks started during
    backward keep until ``step()``); a few blocks of exact size, rounded up to a page. 0 on the CPU."""
    pinned_registrations: int = 0
    """CUDA: pinned blocks registered during this step: a few in the first step of a chunk layout,
    then 0. 0 on the CPU."""
    spans: tuple[StageSpan, ...] = field(default=(), repr=False)
