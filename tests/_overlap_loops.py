"""Training loops of the overlap contract (issue 16), shared by tests/test_overlap_contract*.py.

The contract: ``CPUOffloadAdamW(..., overlap_backward=True)`` is a pure speed option. Whatever a
loop does between backward and ``step()``, the parameters, ``exp_avg``, ``exp_avg_sq``, ``step``
and the loop's returned values (losses, clip norms) are bitwise those of ``overlap_backward=False``
on the same loop (and of ``torch.optim.AdamW(fused=True)`` where that is the reference), and no
error escapes.

A loop here is one function ``iteration(ctx, step)`` that runs a whole training iteration
(forward, backward, whatever happens before ``step()``, ``step()``) on ``ctx.model`` and
``ctx.opt`` and returns the values it wants compared (the loss, a clip norm). :func:`train` runs it
for a model and optimizer of a given kind; :func:`assert_same` compares two runs bitwise.

The model (:class:`Net`) has several parameters of distinct sizes in two param groups, so that at
``chunk_numel=1024`` the step has several chunks (5), and ``threads=1``: chunks start early in backward
(the first backward calibrates; chunks start early from the second on).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from offload import CPUOffloadAdamW, OffloadSettings, StepStats
from offload.testing import KernelSet
from offload.state._dtensor import local

from _fsdp_models import ShardMixedPrecisionReference

IN, HID, OUT = 24, 40, 7
SMALL = OffloadSettings(threads=1, chunk_numel=1024, kernel="torch")
"""Chunks small enough that the model has several (5), one worker thread, torch's kernel (no
native build needed; ``kernel="auto"`` is parametrized where the native kernel matters)."""
STEPS = 6


class Net(nn.Module):
    """Linear(24, 40) -> gelu -> ``reps`` x (h + Linear(40, 40)(h)) -> * gain -> Linear(40, 7).

    ``mid`` runs ``reps`` times, all but the first under a reentrant ``torch.utils.checkpoint``, so
    its gradient hooks fire ``reps`` times per backward; ``checkpointed``: the first ``mid`` runs
    under a non-reentrant checkpoint.
    """

    def __init__(self, dtype: torch.dtype = torch.float32, *, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(IN, HID)
        self.mid = nn.Linear(HID, HID)
        self.gain = nn.Parameter(torch.ones(HID))
        self.out = nn.Linear(HID, OUT)
        self.checkpointed = checkpointed
        self.to(dtype)

    def forward(self, x: torch.Tensor, y: torch.Tensor, reps: int = 1) -> torch.Tensor:
        h = F.gelu(self.inp(x.to(self.out.weight.dtype)))
        h = h + (checkpoint(self.mid, h, use_reentrant=False) if self.checkpointed else self.mid(h))
        for _ in range(reps - 1):  # a reentrant checkpoint runs its own backward: mid's hooks fire again
            h = h + checkpoint(self.mid, h, use_reentrant=True)
        logits = self.out(h * self.gain)
        return F.cross_entropy(logits.float(), y)


def batch(step: int, micro: int = 0, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(8, IN, generator=g), torch.randint(0, OUT, (8,), generator=g)


def groups(model: nn.Module) -> list[dict[str, Any]]:
    """Three param groups (chunks never cross a group): the matrices but ``mid``'s (lr 3e-3,
    weight decay 0.1), ``mid`` (lr 2e-3, weight decay 0.05) and the other vectors (lr 1e-3, no
    decay). At ``chunk_numel=1024``: 5 chunks, two of them ``mid``'s, so a step whose ``reps``
    differs from the last step's still starts the other chunks early."""
    named = list(model.named_parameters())
    mid = [p for n, p in named if "mid." in n]
    rest = [p for n, p in named if "mid." not in n]
    return [{"params": [p for p in rest if p.dim() >= 2], "lr": 3e-3, "weight_decay": 0.1},
            {"params": mid, "lr": 2e-3, "weight_decay": 0.05},
            {"params": [p for p in rest if p.dim() < 2], "lr": 1e-3, "weight_decay": 0.0}]


class MixedPrecisionReference(ShardMixedPrecisionReference):
    """bf16 parameters, fp32 masters updated by ``torch.optim.AdamW(fused=True)`` from the upcast
    gradient, cast back into the parameters: the mixed-precision reference (as in
    tests/test_optimizer_numerics.py), on this module's groups by default. ``param_groups`` are the
    inner optimizer's (hyper-parameter edits reach it); ``state`` reads its masters' state."""

    def __init__(self, model: nn.Module,
                 param_groups: Callable[[nn.Module], list] | None = None) -> None:
        super().__init__(model, param_groups or groups)
        self.state = _MasterState(self)


class _MasterState:
    def __init__(self, ref: MixedPrecisionReference) -> None:
        self._ref = ref

    def get(self, p: torch.Tensor) -> Any:
        return self._ref.opt.state.get(self._ref.master[p])


@dataclass
class Ctx:
    """What an iteration works on."""

    model: nn.Module
    opt: Any
    kind: str
    """"torch" (AdamW(fused=True) or the bf16 mixed-precision reference), "off", "on" (ours,
    overlap_backward False/True)."""
    scaler: Any = None
    shared: dict[str, Any] = field(default_factory=dict)
    """Values a reference run takes from another run (e.g. our clip norms, by step)."""


@dataclass
class Run:
    model: nn.Module
    opt: Any
    returned: list[Any]
    """What each iteration returned (losses, norms), as tensors, by step."""
    stats: list[StepStats | None]
    """``opt.last_stats`` after each iteration (ours only)."""


def make_optimizer(kind: str, model: nn.Module, *, settings: OffloadSettings = SMALL,
                   kernels: KernelSet | None = None, param_groups: Callable[[nn.Module], list] = groups) -> Any:
    if kind == "torch":
        dtype = next(model.parameters()).dtype
        if dtype == torch.float32:
            return torch.optim.AdamW(param_groups(model), fused=True)
        return MixedPrecisionReference(model, param_groups)
    assert kind in ("off", "on"), kind
    return CPUOffloadAdamW(param_groups(model), settings=settings, overlap_backward=kind == "on",
                           kernels=kernels)


Iteration = Callable[[Ctx, int], Any]


def train(kind: str, iteration: Iteration, *, steps: int = STEPS, dtype: torch.dtype = torch.float32,
          settings: OffloadSettings = SMALL, kernels: KernelSet | None = None,
          model_fn: Callable[[torch.dtype], nn.Module] = Net, scaler: Callable[[], Any] | None = None,
          shared: dict[str, Any] | None = None,
          param_groups: Callable[[nn.Module], list] = groups) -> Run:
    """``steps`` iterations of ``iteration`` on a fresh model and optimizer of ``kind``."""
    model = model_fn(dtype)
    opt = make_optimizer(kind, model, settings=settings, kernels=kernels, param_groups=param_groups)
    ctx = Ctx(model=model, opt=opt, kind=kind, scaler=None if scaler is None else scaler(),
              shared={} if shared is None else shared)
    returned, stats = [], []
    for step in range(steps):
        out = iteration(ctx, step)
        returned.append(_detached(out))
        stats.append(getattr(opt, "last_stats", None))
    return Run(model=model, opt=opt, returned=returned, stats=stats)


def _detached(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return local(out).detach().clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_detached(o) for o in out)
    return out


def state_lists(model: nn.Module, opt: Any) -> dict[str, list[torch.Tensor]]:
    """Parameters (this rank's shards) and, for those with state, exp_avg, exp_avg_sq, step."""
    params = list(model.parameters())
    with_state = [p for p in params if opt.state.get(p)]
    out: dict[str, list[torch.Tensor]] = {"params": [local(p).detach().clone() for p in params]}
    for key in ("exp_avg", "exp_avg_sq", "step"):
        out[key] = [local(opt.state.get(p)[key]).detach().clone() for p in with_state]
        if key == "step":  # a 0-d tensor in both optimizers; compared by value and dtype
            out[key] = [t.reshape(()) for t in out[key]]
    out["has_state"] = [torch.tensor(bool(opt.state.get(p))) for p in params]
    return out


def assert_tensors(actual: list[Any], expected: list[Any], what: str) -> None:
    """Bitwise equality (NaN equal to NaN), with the first differing element named."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} vs {len(expected)} entries"
    for i, (a, e) in enumerate(zip(actual, expected)):
        if isinstance(a, (tuple, list)):
            assert_tensors(list(a), list(e), f"{what}[{i}]")
            continue
        if not isinstance(a, torch.Tensor):
            assert a == e, f"{what}[{i}]: {a!r} vs {e!r}"
            continue
        a, e = local(a).detach().cpu(), local(e).detach().cpu()
        assert a.dtype == e.dtype and a.shape == e.shape, \
            f"{what}[{i}]: {a.dtype}{tuple(a.shape)} vs {e.dtype}{tuple(e.shape)}"
        if not torch.equal(a, e) and not (a.is_floating_point() and torch.equal(a.isnan(), e.isnan())
                                          and torch.equal(a.nan_to_num(0.0), e.nan_to_num(0.0))):
            diff = (a.float() - e.float()).abs()
            raise AssertionError(f"{what}[{i}] differs in {int((a != e).sum())}/{a.numel()} elements "
                                 f"(max abs diff {diff.nan_to_num(float('inf')).max().item():.3e})")


def assert_same(actual: Run, expected: Run, what: str) -> None:
    """Parameters, moments, steps and returned values bitwise equal."""
    assert_tensors(actual.returned, expected.returned, f"{what}: returned")
    got, want = state_lists(actual.model, actual.opt), state_lists(expected.model, expected.opt)
    for key in ("has_state", "params", "exp_avg", "exp_avg_sq", "step"):
        assert_tensors(got[key], want[key], f"{what}: {key}")


def close(*runs: Run) -> None:
    for r in runs:
        if isinstance(r.opt, CPUOffloadAdamW):
            r.opt.close()


def contract(iteration: Iteration, *, torch_reference: bool = True, **kw: Any) -> tuple[Run, Run, Run | None]:
    """The loop with overlap off, on, and (``torch_reference``) torch's AdamW; each compared
    bitwise with overlap off. Returns (off, on, torch)."""
    shared: dict[str, Any] = {}
    off = train("off", iteration, shared=shared, **kw)
    try:
        on = train("on", iteration, shared=shared, **kw)
    finally:
        close(off)
    try:
        ref = train("torch", iteration, shared=shared, **kw) if torch_reference else None
        assert_same(on, off, "overlap on vs off")
        if ref is not None:
            assert_same(off, ref, "overlap off vs torch AdamW(fused=True)")
    finally:
        close(on)
    return off, on, ref


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [local(p.grad) for p in model.parameters() if p.grad is not None]


def clip_coef(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The coefficient ``torch.nn.utils.clip_grads_with_norm_`` applies for ``total``."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def apply_coef(model: nn.Module, coef: torch.Tensor) -> None:
    """``torch.nn.utils.clip_grads_with_norm_``'s update of the gradients, given its coefficient."""
    grads = grads_of(model)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))


def our_clip(ctx: Ctx, step: int, max_norm: float) -> torch.Tensor:
    """Ours: ``opt.clip_grad_norm_``; the reference (torch): the coefficient our call implied (the
    total norm our run of kind "off" returned at this step, in ``ctx.shared["totals"]``)."""
    if ctx.kind == "torch":
        total = ctx.shared["totals"][step]
        apply_coef(ctx.model, clip_coef(total, max_norm))
        return total
    total = ctx.opt.clip_grad_norm_(max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None)
    assert type(total) is torch.Tensor and total.dim() == 0, f"clip_grad_norm_ returned {total!r}"
    if ctx.kind == "off":
        ctx.shared.setdefault("totals", {})[step] = total.detach().clone()
    return total

