"""Per-tensor gradient norm terms and content checksums, in one pass at memory speed.

``CPUOffloadAdamW.clip_grad_norm_`` needs each gradient's norm term (the total norm is the only
global quantity of a clipped step), and a speculative step validates what a chunk consumed by the
content of its gradients. Both are one read of every gradient, so :func:`grad_stats_` computes
both in that one read (``grad_stats_`` in this package's ``csrc/grad_stats.h``), per tensor:

* the norm term in float64: ``sum g**2`` (``norm_type`` 2), ``sum |g|`` (1), ``max |g|`` (inf);
  other ``norm_type`` values go to the torch reference (``sum |g|**p``). The sum runs over fixed
  blocks of 16 Ki elements (in memory order from the tensor's first element) with 32 fixed lanes
  each, added in a fixed order, so the term is bitwise the same for any thread count and any
  split of the tensor list, and within about 1e-13 (relative) of ``g.double().pow(2).sum()``
  (each square is exact in double);
* the checksum: per lane (element ``i`` of the tensor is in lane ``i % 32``) the sum of the
  lane's words (fp32: each 32-bit word as a signed int; bf16/fp16: each 16-bit word
  zero-extended), weighted by an odd 64-bit constant per lane (:data:`LANE_WEIGHTS`), summed
  with 64-bit wrap-around. Integer arithmetic, so exact and order-independent; it changes whenever
  one element changes (any bit). The lane weights are there because a plain sum of words misses
  a negated gradient with as many negative as positive elements (each sign bit moves a word by
  2**31: +-2**31 cancel; a review found it, one tensor in ~30 of 768 elements): now a change is
  missed only if it cancels within every lane and between the weighted lanes (elements 32 apart
  swapped, say).

Speed: :data:`MEASURED` (``python -m bench.membus.grad_stats``: 50M fp32 = 200 MB, 2 threads, the
pass, ``torch.linalg.vector_norm`` and a copy interleaved round by round). The pass is one read
with a few vector instructions per 16 elements (the fp32 words are summed as 16-bit halves in
32-bit lanes, so no cross-lane widening competes with the float-to-double conversions for the
shuffle port); threads take 4-block pieces from a shared counter, read the four blocks side by
side (more misses in flight), and only where each gets at least 128 Ki elements (a parallel region
costs microseconds; 10,000 tiny tensors take one thread). :func:`checksums_` is the same pass
without the norm work.

Where the native extension cannot be built, and for tensors not on the CPU (CUDA gradients),
:func:`grad_stats_reference` gives the same checksums (bitwise) and terms within 1e-12 (relative)
with torch ops; on the CPU its terms are deterministic too (fixed blocks, then ``math.fsum``), on
a device it is ``g.double().pow(2).sum()`` there (no host sync).

Tensors must be float32, bfloat16 or float16 and cover one dense block of memory (contiguous, or
a permutation of a contiguous tensor, as gradients are); anything else raises a ValueError or
TypeError naming the index.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from offload.kernels._fused_mp import process_loader
from offload.kernels._build import ExtensionLoader

__all__ = ["LANE_WEIGHTS", "MEASURED", "STATS_BLOCK", "checksums_", "checksums_reference", "grad_stats_",
           "grad_stats_reference"]

#: Elements per block of the fixed summation order (the native kernel's kStatsBlock).
STATS_BLOCK = 1 << 14
#: GB/s (bytes read; read + written for copy, clone and the step) on the 2-core VM, 50M fp32,
#: 2 threads, ``python -m bench.membus.grad_stats --rounds 21 --out-dir bench/results`` (21 interleaved
#: rounds, best round; the medians were within 4% of these, load average 1.1;
#: ``bench/results/grad_stats.md``). Per-round medians of the ratios: vector_norm / grad_stats
#: 2.41, step_coef / step 1.00 (the coefficient inside the kernel costs nothing measurable),
#: (grad_stats + step_coef) / step 1.24 (target 1.15: not met here). From cache the pass runs at
#: 40-58 GB/s per thread, so it is not compute-bound; from DRAM one read stream per thread is slow
#: on this VM: each thread reads the four blocks of its piece side by side (128 elements of each
#: in turn), 0.62x the bytes per second of the step kernel's seven streams (one stream with a
#: software prefetch 2 KB ahead: 0.45-0.48x).
MEASURED: dict[str, float] = {
    "grad_stats_fp32": 28.5,
    "grad_stats_bf16": 20.5,
    "torch.linalg.vector_norm_fp32": 12.0,
    "copy_fp32_read_write": 31.0,
    "clone_fp32_read_write": 9.4,
    "adamw_f32_step_28B": 46.0,
}

_NATIVE_KIND = {2.0: 0, 1.0: 1, math.inf: 2}
_CHECKSUMS_ONLY = 3  # the native kernel's kNormNone: no norm work
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _norm_type(norm_type: float) -> float:
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real):
        raise TypeError(f"grad_stats: norm_type={norm_type!r}: expected a float")
    p = float(norm_type)
    if not (p > 0):
        raise ValueError(f"grad_stats: norm_type={norm_type!r}: expected a positive float or inf")
    return p


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel()`` consecutive places from its first one."""
    if t.numel() <= 1:
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _memory_flat(t: Tensor, i: int) -> Tensor:
    """``t``'s elements in memory order as a 1-D view; refuses what is not one dense block."""
    if not isinstance(t, Tensor):
        raise TypeError(f"grad_stats: tensors[{i}] is a {type(t).__name__}: expected a Tensor")
    if t.dtype not in _DTYPES:
        raise TypeError(f"grad_stats: tensors[{i}] has dtype {t.dtype}: expected torch.float32, "
                        "torch.bfloat16 or torch.float16")
    if t.layout != torch.strided or not _dense(t):
        raise ValueError(
            f"grad_stats: tensors[{i}] (shape {tuple(t.shape)}, strides {t.stride()}) does not "
            "cover one dense block of memory: expected a contiguous tensor or a permutation of one")
    return t.as_strided((t.numel(),), (1,))


def _splitmix64(x: int) -> int:
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


#: Per lane (element ``i`` of a tensor is in lane ``i % 32``): the odd weight of its word sum in
#: the checksum (the native kernel's ``lane_weight``).
LANE_WEIGHTS = tuple(_splitmix64(j) | 1 for j in range(32))
_SIGNED_WEIGHTS = [w - (1 << 64) if w >= 1 << 63 else w for w in LANE_WEIGHTS]


#: Elements per block of the torch-ops path: its temporaries (int64 words, float64 values: 8 B
#: an element each) stay O(block), never O(tensor) (a 525M-element embedding gradient would need
#: about 8 GB of device memory at once). A multiple of 32 (the lanes) and of STATS_BLOCK.
TORCH_BLOCK = 1 << 22


@functools.lru_cache(maxsize=None)
def _lane_weights(device: torch.device) -> Tensor:
    """The lane weights on ``device``, made once per device: a ``torch.tensor(..., device=cuda)``
    per call is a blocking copy from pageable memory, a device sync in every backward hook."""
    return torch.tensor(_SIGNED_WEIGHTS, dtype=torch.int64, device=device)


def _checksum(flat: Tensor) -> Tensor:
    weights = _lane_weights(flat.device)
    lanes = torch.zeros(32, dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), TORCH_BLOCK):  # block starts are multiples of 32: lanes align
        block = flat[start:start + TORCH_BLOCK]
        if block.dtype == torch.float32:
            words = block.view(torch.int32).to(torch.int64)
        else:
            words = block.view(torch.int16).to(torch.int64) & 0xFFFF
        pad = (-words.numel()) % 32
        if pad:
            words = torch.nn.functional.pad(words, (0, pad))
        lanes += words.view(-1, 32).sum(0, dtype=torch.int64)  # exact: far from 2**63 per lane
    # int64 products and sum wrap around as the kernel's uint64 ones do (on the device: no sync)
    return (lanes * weights).sum()


def _term(flat: Tensor, p: float) -> Tensor | float:
    if flat.device.type != "cpu":
        return _term_on_device(flat, p)
    if flat.numel() == 0:
        return 0.0
    if p == math.inf:
        return flat.abs().max().double()
    # CPU: the native kernel's blocks, each reduced by one thread (a row of a 2-D sum over dim 1
    # is never split between threads), then math.fsum (exactly rounded, order-independent).
    x = torch.nn.functional.pad(flat.double().abs(), (0, -flat.numel() % STATS_BLOCK))
    rows = x.view(-1, STATS_BLOCK)
    rows = rows.square() if p == 2.0 else rows if p == 1.0 else rows.pow(p)
    return math.fsum(rows.sum(dim=1).tolist())


def _term_on_device(flat: Tensor, p: float) -> Tensor:
    """The norm term of a non-empty device tensor, block by block: temporaries of O(block)
    elements (a whole-tensor ``abs()`` or ``double()`` is gradient-sized), no host sync (an
    empty one's 0 is made there: a host 0 copied up would be a blocking copy)."""
    if flat.numel() == 0:
        return flat.new_zeros((), dtype=torch.float64)
    parts = []
    for start in range(0, flat.numel(), TORCH_BLOCK):
        if p == math.inf:
            parts.append(flat[start:start + TORCH_BLOCK].abs().max())
            continue
        x = flat[start:start + TORCH_BLOCK].double().abs()
        parts.append((x.square() if p == 2.0 else x if p == 1.0 else x.pow(p)).sum())
    if len(parts) == 1:
        return parts[0].double()
    return (torch.stack(parts).max() if p == math.inf else torch.stack(parts).sum()).double()


def _stack(values: list[Tensor | float], dtype: torch.dtype, device: torch.device) -> Tensor:
    if not values:
        return torch.zeros(0, dtype=dtype, device=device)
    return torch.stack([torch.as_tensor(v, dtype=dtype).to(device) for v in values])


@torch.no_grad()
def grad_stats_reference(tensors: Sequence[Tensor], *, norm_type: float = 2.0
                         ) -> tuple[Tensor, Tensor]:
    """:func:`grad_stats_` with torch ops (any device; slow on the CPU, where it is deterministic).

    Returns ``(terms, checksums)``, 1-D float64 and int64 tensors of ``len(tensors)``, on the
    tensors' device when they share one (a CUDA list stays on the device: no sync), else the CPU.
    """
    p = _norm_type(norm_type)
    flats = [_memory_flat(t, i) for i, t in enumerate(tensors)]
    devices = {t.device for t in flats}
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    terms = _stack([_term(f, p) for f in flats], torch.float64, device)
    sums = _stack([_checksum(f) for f in flats], torch.int64, device)
    return terms, sums


def grad_stats_(tensors: Sequence[Tensor], *, norm_type: float = 2.0,
                loader: ExtensionLoader | None = None) -> tuple[Tensor, Tensor]:
    """Per tensor: its norm term (float64) and its word checksum (int64); see the module doc.

    Returns two 1-D tensors of ``len(tensors)``. CPU tensors go through the native kernel (one
    multi-threaded pass over all of them, on torch's intra-op threads, the GIL released) when
    ``loader`` (None: the process's) has it and ``norm_type`` is 2, 1 or inf; everything else
    through :func:`grad_stats_reference`, tensor by tensor, so a tensor's result never depends on
    the other tensors of the call. Results are on the CPU unless every tensor is on one device.
    """
    p = norm_type if norm_type in _NATIVE_KIND and type(norm_type) is float else _norm_type(norm_type)
    tensors = list(tensors)
    try:
        cpu = [t.is_cpu for t in tensors]  # the C++ side checks everything else
    except AttributeError:
        i, t = next((i, t) for i, t in enumerate(tensors) if not isinstance(t, Tensor))
        raise TypeError(
            f"grad_stats: tensors[{i}] is a {type(t).__name__}: expected a Tensor") from None
    kind = _NATIVE_KIND.get(p)
    module = None
    if kind is not None and any(cpu):  # device tensors never wait for a build (it may take a minute)
        module, _ = (process_loader() if loader is None else loader).get()
    if module is None:
        return grad_stats_reference(tensors, norm_type=p)
    all_cpu = all(cpu)
    if all_cpu:
        return module.grad_stats_(tensors, norm=kind)
    on_cpu = [i for i, t in enumerate(tensors) if t.is_cpu]
    others = [i for i, t in enumerate(tensors) if not t.is_cpu]
    terms = torch.zeros(len(tensors), dtype=torch.float64)
    sums = torch.zeros(len(tensors), dtype=torch.int64)
    if on_cpu:
        t_cpu, s_cpu = module.grad_stats_([tensors[i] for i in on_cpu], norm=kind)
        terms[on_cpu], sums[on_cpu] = t_cpu, s_cpu
    t_dev, s_dev = grad_stats_reference([tensors[i] for i in others], norm_type=p)
    if not on_cpu:
        return t_dev, s_dev
    terms[others], sums[others] = t_dev.cpu(), s_dev.cpu()
    return terms, sums


@torch.no_grad()
def checksums_reference(tensors: Sequence[Tensor]) -> Tensor:
    """:func:`checksums_` with torch ops (any device: a CUDA list stays there, no sync)."""
    flats = [_memory_flat(t, i) for i, t in enumerate(tensors)]
    devices = {t.device for t in flats}
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    return _stack([_checksum(f) for f in flats], torch.int64, device)


def checksums_(tensors: Sequence[Tensor], *, loader: ExtensionLoader | None = None) -> Tensor:
    """Per tensor its word checksum (int64), :func:`grad_stats_`'s second result without the norm
    work: the native pass for a list of CPU tensors where the extension is built (on this VM a
    third faster than with the norm for bf16), else :func:`checksums_reference`."""
    tensors = list(tensors)
    try:
        all_cpu = all(t.is_cpu for t in tensors)
    except AttributeError:
        i, t = next((i, t) for i, t in enumerate(tensors) if not isinstance(t, Tensor))
        raise TypeError(
            f"grad_stats: tensors[{i}] is a {type(t).__name__}: expected a Tensor") from None
    module = None
    if tensors and all_cpu:
        module, _ = (process_loader() if loader is None else loader).get()
    if module is None:
        return checksums_reference(tensors)
    return module.grad_stats_(tensors, norm=_CHECKSUMS_ONLY)[1]
