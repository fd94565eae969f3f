"""The single-pass mixed-precision AdamW CPU kernel ("fused-mp"): its checked entry points.

The torch path of a bf16 model's offloaded step makes three passes over memory: upcast the bf16
gradient into an fp32 buffer (read 2 + write 4 bytes per parameter), torch's fused AdamW on the
fp32 master and moments (28 bytes), downcast the master into the bf16 parameter (read 4 + write 2),
about 40 bytes per parameter. :func:`fused_mp_adamw_steps_` does it in one pass: it reads the bf16
gradient, updates the fp32 master and moments in place and writes the bf16 parameter, 28 bytes per
parameter (``csrc/mp_adamw.h`` of this package; ``csrc/module.cpp`` lists the extension's files).

One native entry point per kernel kind: ``fused_mp_adamw_steps_`` (bf16/fp16 parameters) and
``adamw_f32_steps_`` (fp32 parameters, :func:`call_f32_unchecked`), each called with its tensors
and one :class:`StepOptions` record (everything else: hyper-parameters, gradient transforms,
stochastic rounding), made in Python and read once by the C++ side (``csrc/step_options.h``).

Build and load: :mod:`offload.kernels._build` (a :class:`KernelLoader` per source and cache;
every function here takes ``loader=``, default the process's own, built once per process).

Numerics. Per step, the kernel computes what the torch path computes: the gradient upcast is exact,
the scalar coefficients are computed in double and cast to float as torch does, each tensor is
split into the same vectorised body and scalar tail as torch splits it, and every multiply-add is
fused or not as in torch's own binary (see the C++ header comment: torch's GCC contracted some
expressions on its own, and this file is compiled with ``-ffp-contract=off`` and spells those FMAs
out). On the builds in :data:`BITWISE_VERIFIED` (the tests check the one they run on),
``params_lowp``, masters and moments are bitwise identical to the torch path, for any thread count.
On other torch builds (another version, another compiler) an expression their compiler fused
differently rounds once differently: at most 1 ulp on a moment, a few ulps through sqrt and division
on the master update, so :data:`STEP_RTOL` bounds one step's relative difference (plus
``STEP_RTOL * 10 * lr`` absolute on a master that cancels to near zero), and the low-precision
parameter differs by at most one bf16/fp16 ulp (the fp32 masters can straddle a rounding boundary).
:func:`bitwise_matches_torch` says which case holds; a tuner must only treat the kernel as a pure
speed knob where it returns True ("tuning never changes the math").

Speed. One parallel region per call over all its tensors on torch's OpenMP pool, vectorised with
ATen's ``Vectorized``. Its threads take blocks of 16 Ki elements from a shared counter instead of a fixed share each, so a thread
slowed by another process costs the call its share of the delay, not the whole delay (which a
fixed split pays once per call, i.e. once per chunk). Calls of at least 2 Mi elements write the
low-precision parameter with non-temporal stores, which saves the read-for-ownership of a
write-only stream (2 of 30 bytes per parameter). Every stream the loops read is prefetched 1024
elements ahead and, on AVX-512, bf16 moments move in 64-byte loads and stores: without these the
bf16-moment step (20 bytes per parameter) took about as long per element as the fp32-moment one
(28), having fewer bytes in flight for the same work. A gradient scale and a clipping coefficient
(``grad_scale``, ``grad_coef``) are applied to each element as it is loaded, so clipping and
GradScaler's unscale cost no pass over the gradients of their own. :func:`fused_mp_adamw_steps_` takes torch's step
tensors and does the step bookkeeping in C++, so a caller makes one call per chunk with no Python
work per tensor beyond building the lists.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from offload.kernels._build import ExtensionLoader, FusedMPUnavailable, KernelLoader

__all__ = [
    "BITWISE_VERIFIED",
    "STEP_RTOL",
    "FusedMPUnavailable",
    "bitwise_matches_torch",
    "Rounding",
    "StepOptions",
    "call_f32_unchecked",
    "call_steps_unchecked",
    "check_hyper",
    "check_lists",
    "fused_mp_adamw_steps_",
    "fused_mp_available",
    "process_loader",
]

#: (torch major.minor, CPU capability) pairs on which the tests found the kernel bitwise identical
#: to the torch path, tails included (torch 2.13 x86-64 wheels; see the C++ header comment).
BITWISE_VERIFIED: frozenset[tuple[str, str]] = frozenset(
    {("2.13", "AVX512"), ("2.13", "AVX2"), ("2.13", "DEFAULT")}
)
#: Per-step relative difference to the torch path on a build outside BITWISE_VERIFIED: a few fp32
#: ulps (2**-23 each) from at most one differently fused multiply-add per moment, propagated
#: through sqrt and division into the master update (0 on a verified build).
STEP_RTOL = 8 * 2.0**-23


#: The process's loader (builds once per process); what ``loader=None`` means below.
_LOADER = KernelLoader()


def process_loader() -> ExtensionLoader:
    """The loader every function here uses when given ``loader=None``."""
    return _LOADER


def _module(loader: ExtensionLoader | None) -> Any:
    module, reason = (_LOADER if loader is None else loader).get()
    if module is None:
        raise FusedMPUnavailable(f"fused-mp AdamW kernel unavailable: {reason}")
    return module


def fused_mp_available(loader: ExtensionLoader | None = None) -> tuple[bool, str]:
    """Whether the fused-mp kernel can run here, and why (or why not).

    The first call builds the extension (seconds to a minute; later processes reuse the cached
    build) and logs a failure once at WARNING; later calls return the remembered outcome.
    ``loader``: whose extension (default: the process's, see :func:`process_loader`).
    """
    module, reason = (_LOADER if loader is None else loader).get()
    return module is not None, reason


def bitwise_matches_torch() -> bool:
    """True where this torch build and CPU capability are in :data:`BITWISE_VERIFIED`."""
    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return (major_minor, torch.backends.cpu.get_cpu_capability()) in BITWISE_VERIFIED


Rounding = tuple[int, list[int], list[int]]
"""Stochastic rounding of one call's bf16 moments: ``(seed, slots, starts)``, per tensor the slot
of its parameter and the index in it of its first element (``offload.kernels._rounding``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepOptions:
    """Everything of one native AdamW call that is not a tensor: the one record both entry points
    take (``options=``), read once by the C++ side (``csrc/step_options.h``: ``read_options``,
    whose TypeError names a missing or mistyped field). ``offload.kernels._adamw.native_options``
    makes it from a param group's ``Hyper`` once per call; :func:`fused_mp_adamw_steps_` from its
    checked arguments."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_scale: float | None = None
    """Each gradient element is used as ``g / grad_scale`` (None: not applied)."""
    grad_coef: float | None = None
    """Then ``* grad_coef`` rounded to the gradient's dtype (None: not applied)."""
    rounding: Rounding | None = None
    """The bf16 moments rounded stochastically (:data:`Rounding`; None: to nearest-even)."""


def check_lists(**lists: Sequence[Tensor]) -> None:
    for name, value in lists.items():
        if not isinstance(value, (list, tuple)):
            raise TypeError(
                f"fused_mp_adamw_steps_: {name} is a {type(value).__name__}: expected a list of tensors"
            )
        for i, item in enumerate(value):
            if not isinstance(item, Tensor):
                raise TypeError(
                    f"fused_mp_adamw_steps_: {name}[{i}] is a {type(item).__name__}: expected a Tensor"
                )


def check_hyper(lr: float, beta1: float, beta2: float, eps: float, wd: float) -> None:
    for name, value, low, high in (
        ("lr", lr, 0.0, math.inf),
        ("beta1", beta1, 0.0, 1.0),
        ("beta2", beta2, 0.0, 1.0),
        ("eps", eps, 0.0, math.inf),
        ("weight_decay", wd, 0.0, math.inf),
    ):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"fused_mp_adamw_steps_: {name}={value!r}: expected a float")
        if not (math.isfinite(value) and low <= value and (value < high or high == math.inf)):
            bound = f"in [{low}, {high})" if high != math.inf else f"finite and >= {low}"
            raise ValueError(f"fused_mp_adamw_steps_: {name}={value!r}: expected {bound}")


def fused_mp_adamw_steps_(
    params_lowp: Sequence[Tensor],
    grads_lowp: Sequence[Tensor],
    masters: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    state_steps: Sequence[Tensor],
    *,
    steps_to_increment: Sequence[Tensor] = (),
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float | None = None,
    grad_coef: float | None = None,
    loader: ExtensionLoader | None = None,
) -> None:
    """One AdamW step over lists of CPU tensors in a single pass, in place, with torch's step
    bookkeeping: each tensor's own step tensor.

    For each ``i``: reads ``grads_lowp[i]`` (bf16 or fp16), updates ``masters[i]``,
    ``exp_avgs[i]``, ``exp_avg_sqs[i]`` (fp32) like ``torch._fused_adamw_`` on the upcast
    gradient, and writes the master rounded to nearest-even into ``params_lowp[i]`` (bf16 or fp16).
    All tensors of an index hold the same number of elements and are contiguous CPU tensors
    (typically 1-D slab views); each list has one dtype.

    ``state_steps[i]`` is the fp32 one-element step tensor of the parameter ``masters[i]``
    belongs to (several entries may share one). First each of ``steps_to_increment`` is
    incremented by one (as ``torch._foreach_add_(steps, 1)`` before torch's fused AdamW), then
    every tensor is updated with the step its step tensor then holds, read as a float as torch
    reads it (the step number after this update: 1 on the first step, as in
    ``torch.optim.AdamW``). One call does the work of a ``_foreach_add_``, a ``.item()`` per
    tensor and one kernel call per distinct step: the offload pipeline's per-chunk Python time,
    which on a memory-bound step leaves the memory bus idle, no longer grows with the number of
    parameters.

    Every input is checked before any memory is written, the step increments included:
    TypeError for a wrong type or dtype, ValueError for lengths, sizes, devices, layouts,
    non-contiguous or aliased tensors, hyper-parameters, a step tensor that is not a one-element
    fp32 CPU tensor, or a step that is not finite and >= 1 after the increments, each naming the
    argument and index. Raises :class:`FusedMPUnavailable` when the kernel could not be built
    (check :func:`fused_mp_available` first). Runs on torch's intra-op thread pool
    (``torch.set_num_threads``) and releases the GIL while it runs.

    ``grad_scale``, ``grad_coef`` (the fp32 values of ``offload.kernels._adamw.Hyper``'s tensors; None:
    not applied): each gradient element is used as ``g / grad_scale`` (fp32 division, as
    ``torch._fused_adamw_(grad_scale=)`` on the upcast gradient), then ``* grad_coef`` rounded to
    the gradient's dtype (as ``torch._foreach_mul_(grads, coef)``), inside the kernel; the
    gradients are only read.
    """
    check_lists(
        params_lowp=params_lowp, grads_lowp=grads_lowp, masters=masters, exp_avgs=exp_avgs,
        exp_avg_sqs=exp_avg_sqs, state_steps=state_steps, steps_to_increment=steps_to_increment,
    )
    check_hyper(lr, beta1, beta2, eps, weight_decay)
    options = StepOptions(lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(eps),
                          weight_decay=float(weight_decay),
                          grad_scale=None if grad_scale is None else float(grad_scale),
                          grad_coef=None if grad_coef is None else float(grad_coef))
    call_steps_unchecked(
        list(params_lowp), list(grads_lowp), list(masters), list(exp_avgs), list(exp_avg_sqs),
        list(state_steps), steps_to_increment=list(steps_to_increment), options=options, loader=loader,
    )


def call_steps_unchecked(
    params_lowp: list[Tensor],
    grads_lowp: list[Tensor],
    masters: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    *,
    steps_to_increment: list[Tensor],
    options: StepOptions,
    into: list[Tensor] | None = None,
    checksums: Tensor | None = None,
    seen: list[Tensor] | None = None,
    loader: ExtensionLoader | None = None,
) -> None:
    """:func:`fused_mp_adamw_steps_` without its Python-side checks, for the offload pipeline.
    ``options``: everything but the tensors (:class:`StepOptions`, stochastic rounding of bf16
    moments included). ``into``/``checksums``: a speculation's next generation (the new master
    and moments, written out of place) and gradient checksums, made in the kernel's pass;
    ``seen``: the weights the masters must round to (see
    :func:`offload.kernels._adamw.mixed_precision_adamw_`).

    The C++ side still checks every tensor before writing; what is skipped is the per-element
    ``isinstance`` walk (pybind rejects a non-tensor with a less precise TypeError) and the
    hyper-parameter checks (the optimizer validated them when the param group was set). The
    pipeline calls this once per chunk while the memory bus waits, so it stays lean.
    """
    module = _module(loader)
    module.fused_mp_adamw_steps_(
        params_lowp, grads_lowp, masters, exp_avgs, exp_avg_sqs, state_steps,
        steps_to_increment=steps_to_increment, into=into or [], checksums=checksums,
        seen=seen or [], options=options,
    )


def call_f32_unchecked(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    *,
    outs: list[Tensor],
    steps_to_increment: list[Tensor],
    options: StepOptions,
    into: list[Tensor] | None = None,
    checksums: Tensor | None = None,
    loader: ExtensionLoader | None = None,
) -> None:
    """The fp32 entry point (each parameter its own master, fp32 gradients; ``outs`` empty or a
    copy target per parameter), with the step bookkeeping of :func:`fused_mp_adamw_steps_`.
    Bitwise equal to ``torch._fused_adamw_`` on the builds of :data:`BITWISE_VERIFIED` (the
    same lane arithmetic as the mixed-precision master update). Checks as :func:`call_steps_unchecked`."""
    module = _module(loader)
    module.adamw_f32_steps_(
        params, grads, exp_avgs, exp_avg_sqs, state_steps, outs=outs,
        steps_to_increment=steps_to_increment, into=into or [], checksums=checksums, options=options,
    )
