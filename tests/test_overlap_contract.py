"""The overlap contract (issue 16), single process: ``overlap_backward=True`` is a pure speed option.

For every loop below, whatever it does between backward and ``step()``, the parameters, moments,
steps and returned values are bitwise those of ``overlap_backward=False`` on the same loop and of
``torch.optim.AdamW(fused=True)`` (bf16: the mixed-precision reference) where that is the
reference, and no error escapes. The loops and the comparison live in tests/_overlap_loops.py.

Also here: ``CPUOffloadAdamW.clip_grad_norm_`` (the total norm as torch's function returns it, the
update bitwise torch's clip-then-step given the same coefficient, ``p.grad`` never written, the
norm deterministic across thread counts and chunk sizes), ``torch.amp.GradScaler`` with an
overflow step, and a kernel failure mid-step (the state stays that of the last committed step).
Multi-process loops (FSDP2, DDP): tests/test_overlap_contract_dist.py.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time

import pytest
import torch
from _overlap_loops import (
    SMALL,
    Ctx,
    Net,
    assert_tensors,
    batch,
    close,
    contract,
    grads_of,
    groups,
    our_clip,
    state_lists,
    train,
)

from offload import CPUOffloadAdamW, OffloadSettings
from offload.testing import KernelSet
from offload.kernels._adamw import fused_adamw_

pytestmark = pytest.mark.usefixtures("single_threaded_main")

DTYPES = [torch.float32, torch.bfloat16]


def _backward(ctx: Ctx, step: int, *, reps: int = 1, micro: int = 0, div: int = 1) -> torch.Tensor:
    loss = ctx.model(*batch(step, micro), reps=reps) / div
    loss.backward()
    return loss


def _plain(ctx: Ctx, step: int) -> torch.Tensor:
    ctx.opt.zero_grad(set_to_none=True)
    loss = _backward(ctx, step)
    ctx.opt.step()
    return loss


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs() / b.abs().clamp_min(1e-30))


def _norm64(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads]))


def _speculated(stats) -> list[tuple[int, int]]:
    return [(s.speculated_chunks, s.committed_chunks) for s in stats]


# --------------------------------------------------------------------------- torch's clip_grad_norm_
TORCH_CLIP = {
    "always": lambda step: 1e-2,
    "sometimes": lambda step: 1e-2 if step % 2 else 1e3,
    "inf": lambda step: float("inf"),  # HF Trainer logging the norm with max_grad_norm=0
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", list(TORCH_CLIP))
def test_torch_clip_grad_norm(mode: str, dtype: torch.dtype) -> None:
    def iteration(ctx: Ctx, step: int):
        ctx.opt.zero_grad(set_to_none=True)
        loss = _backward(ctx, step)
        total = torch.nn.utils.clip_grad_norm_(ctx.model.parameters(), TORCH_CLIP[mode](step))
        ctx.opt.step()
        return loss, total

    off, on, _ = contract(iteration, dtype=dtype)
    totals = [float(t) for _, t in off.returned]
    active = [t > TORCH_CLIP[mode](s) for s, t in enumerate(totals)]
    assert active == {"always": [True] * 6, "sometimes": [s % 2 == 1 for s in range(6)],
                      "inf": [False] * 6}[mode], totals  # the loop clips where it says
    spec = _speculated(on.stats[1:])  # the first backward only calibrates
    if mode == "inf":  # multiplied by 1.0: the gradients' content is unchanged, so all commit
        assert all(0 < c == s for s, c in spec), spec
    # mode "always": a chunk whose kernel read its gradients after the clip had scaled them
    # consumed what step() would, and commits; the others are redone. Which is a race with the
    # worker, so only the results (bitwise, above) are asserted.


# --------------------------------------------------------------------------- ours: opt.clip_grad_norm_
def _our_clip_iteration(max_norm: float, *, checks: list[str]):
    def iteration(ctx: Ctx, step: int):
        ctx.opt.zero_grad(set_to_none=True)
        loss = _backward(ctx, step)
        if ctx.kind == "torch":
            total = our_clip(ctx, step, max_norm)
            ctx.opt.step()
            return loss, total
        before = [g.clone() for g in grads_of(ctx.model)]
        total = our_clip(ctx, step, max_norm)
        # The coefficient is applied inside the kernel: p.grad is never written (not by the clip
        # call, not by step()), unlike torch.nn.utils.clip_grad_norm_.
        assert_tensors(grads_of(ctx.model), before, "p.grad after opt.clip_grad_norm_")
        assert total.dtype == torch.float32, total.dtype
        assert _rel(total, _norm64(before)) <= 1e-6, (float(total), float(_norm64(before)))
        if before[0].dtype == torch.float32:
            torch_total = torch.nn.utils.get_total_norm(before, 2.0)
            assert _rel(total, torch_total) <= 1e-6, (float(total), float(torch_total))
        ctx.opt.step()
        assert_tensors(grads_of(ctx.model), before, "p.grad after step()")
        checks.append(ctx.kind)
        return loss, total

    return iteration


@pytest.mark.parametrize("kernel", ["torch", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_norm", [1e-2, 1e6])
def test_our_clip_grad_norm_is_torch_clip_then_step(max_norm: float, dtype: torch.dtype,
                                                     kernel: str) -> None:
    """Bitwise ``clip_grads_with_norm_`` (with the coefficient our norm implies) then torch's
    AdamW (bf16: the mixed-precision reference), with overlap on and off."""
    checks: list[str] = []
    settings = OffloadSettings(threads=1, chunk_numel=1024, kernel=kernel)  # type: ignore[arg-type]
    off, on, _ = contract(_our_clip_iteration(max_norm, checks=checks), dtype=dtype, settings=settings)
    assert checks.count("on") == checks.count("off") == 6
    clipped = [float(t) > max_norm for _, t in off.returned]
    assert all(clipped) if max_norm < 1 else not any(clipped), clipped
    if max_norm > 1:  # coefficient 1: every chunk started during backward commits
        spec = _speculated(on.stats[1:])
        assert all(0 < c == s for s, c in spec), spec


@pytest.mark.parametrize("overlap", [False, True])
def test_our_clip_grad_norm_is_deterministic_across_threads_and_chunks(overlap: bool) -> None:
    """The same gradients give the same total norm, bit for bit, for any thread count and chunk
    size, and within 1e-6 (relative) of a float64 reference."""
    totals, reference = [], None
    for threads, chunk_numel in ((1, 1024), (2, 1024), (1, 1536), (2, 1 << 20)):
        model = Net()
        opt = CPUOffloadAdamW(groups(model), settings=OffloadSettings(
            threads=threads, chunk_numel=chunk_numel, kernel="torch"), overlap_backward=overlap)
        ctx = Ctx(model=model, opt=opt, kind="on" if overlap else "off")
        for step in range(2):  # calibrate the hooks, then a step with chunks started early
            ctx.opt.zero_grad(set_to_none=True)
            _backward(ctx, step)
            opt.clip_grad_norm_(1e6)
            opt.step()
        opt.zero_grad(set_to_none=True)
        _backward(ctx, 2)
        totals.append(opt.clip_grad_norm_(1e-2))
        reference = _norm64(grads_of(model))
        opt.step()
        opt.close()
    assert all(torch.equal(t, totals[0]) for t in totals), [float(t) for t in totals]
    assert _rel(totals[0], reference) <= 1e-6, (float(totals[0]), float(reference))


def test_our_clip_grad_norm_error_if_nonfinite() -> None:
    """A non-finite norm with ``error_if_nonfinite=True`` raises like torch's function; the state
    is untouched and the run continues bitwise like overlap off and torch's clip + AdamW."""

    def iteration(ctx: Ctx, step: int):
        ctx.opt.zero_grad(set_to_none=True)
        # Before backward: between backward and step() opt.state shows the speculation (README).
        before = state_lists(ctx.model, ctx.opt) if step == 3 else None
        loss = _backward(ctx, step)
        if step == 3:
            with torch.no_grad():
                ctx.model.mid.weight.grad.view(-1)[7] = float("inf")
            with pytest.raises(RuntimeError, match="non-finite"):
                if ctx.kind == "torch":
                    torch.nn.utils.clip_grad_norm_(ctx.model.parameters(), 1e-2, error_if_nonfinite=True)
                else:
                    ctx.opt.clip_grad_norm_(1e-2, error_if_nonfinite=True)
            ctx.opt.zero_grad(set_to_none=True)  # the step is skipped
            after = state_lists(ctx.model, ctx.opt)
            for key in before:
                assert_tensors(after[key], before[key], f"{ctx.kind}: {key} after the raise")
            return loss
        total = our_clip(ctx, step, 1e-2)
        ctx.opt.step()
        return loss, total

    contract(iteration)


@pytest.mark.parametrize("norm_type", [1.0, float("inf")])
def test_our_clip_grad_norm_other_norm_types(norm_type: float) -> None:
    """Another ``norm_type``: torch's total norm (within 1e-6), or a clear refusal naming it."""
    model = Net()
    opt = CPUOffloadAdamW(groups(model), settings=SMALL, overlap_backward=True)
    ctx = Ctx(model=model, opt=opt, kind="on")
    try:
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            _backward(ctx, step)
            try:
                total = opt.clip_grad_norm_(1e-2, norm_type=norm_type)
            except ValueError as exc:
                assert "norm_type" in str(exc) and len(str(exc).splitlines()) == 1, str(exc)
                opt.step()  # a refused clip leaves the step usable
                continue
            want = torch.nn.utils.get_total_norm(grads_of(model), norm_type)
            assert _rel(total, want) <= 1e-6, (float(total), float(want))
            opt.step()
    finally:
        opt.close()


# --------------------------------------------------------------------------- GradScaler
def _scaled_iteration(unscale: str, overflow_step: int = 3):
    def iteration(ctx: Ctx, step: int):
        opt, scaler, model = ctx.opt, ctx.scaler, ctx.model
        opt.zero_grad(set_to_none=True)
        # Taken before backward: between backward and step() opt.state shows what the chunks
        # started during backward speculated (README); the skipped step must leave the state
        # as the last step left it.
        before = state_lists(model, opt) if step == overflow_step else None
        loss = model(*batch(step))
        scaler.scale(loss).backward()
        if step == overflow_step:
            with torch.no_grad():
                model.mid.weight.grad.view(-1)[5] = float("inf")
        total = torch.zeros(())
        if unscale != "implicit":
            scaler.unscale_(opt)
            if unscale == "explicit+torch-clip":
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)
            elif unscale == "explicit+our-clip":
                total = our_clip(ctx, step, 1e-2)
        scaler.step(opt)
        scale = torch.tensor(scaler.get_scale())
        scaler.update()
        if step == overflow_step:  # skipped: parameters, moments and step untouched
            after = state_lists(model, opt)
            for key in before:
                assert_tensors(after[key], before[key], f"{ctx.kind}: {key} after the overflow step")
            assert scaler.get_scale() == float(scale) / 2
        return loss, scale, total

    return iteration


@pytest.mark.parametrize("unscale", ["implicit", "explicit", "explicit+torch-clip", "explicit+our-clip"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_scaler_with_an_overflow_step(dtype: torch.dtype, unscale: str) -> None:
    """``scaler.scale(loss).backward(); [scaler.unscale_(opt); clip]; scaler.step(opt);
    scaler.update()``, an inf injected into one gradient at step 3. fp32: also bitwise torch's
    AdamW(fused=True), which takes ``grad_scale``/``found_inf`` from the scaler."""
    off, on, _ = contract(_scaled_iteration(unscale), dtype=dtype,
                          scaler=lambda: torch.amp.GradScaler("cpu", init_scale=2.0**12),
                          torch_reference=dtype == torch.float32)
    assert [float(s) for _, s, _ in off.returned] == [2.0**12] * 4 + [2.0**11] * 2


# --------------------------------------------------------------------------- hyper-parameters
@pytest.mark.parametrize("dtype", DTYPES)
def test_lr_weight_decay_and_betas_set_between_backward_and_step(dtype: torch.dtype) -> None:
    """nanoGPT sets ``param_group["lr"]`` after backward, just before ``step()``."""

    def iteration(ctx: Ctx, step: int):
        ctx.opt.zero_grad(set_to_none=True)
        loss = _backward(ctx, step)
        for i, g in enumerate(ctx.opt.param_groups):
            g["lr"] = 1e-3 * (1 + step) / (1 + i)
            if step >= 2:
                g["weight_decay"] = 0.02 * step
            if step >= 4:
                g["betas"] = (0.8, 0.99)
        ctx.opt.step()
        return loss

    contract(iteration, dtype=dtype)


def test_tensor_lr_changed_in_place_between_backward_and_step() -> None:
    """``lr`` given as a tensor and rewritten in place after backward: the value the step reads,
    not the tensor object, is what a chunk started during backward must have used."""

    def tensor_lr(model: torch.nn.Module) -> list[dict]:
        return [{**g, "lr": torch.tensor(g["lr"])} for g in groups(model)]

    def iteration(ctx: Ctx, step: int):
        ctx.opt.zero_grad(set_to_none=True)
        loss = _backward(ctx, step)
        for i, g in enumerate(ctx.opt.param_groups):
            g["lr"].fill_(2e-3 / (1 + step + i))
        ctx.opt.step()
        return loss

    contract(iteration, param_groups=tensor_lr)


def test_weights_edited_between_backward_and_step() -> None:
    """A weight rescaled in place after backward, before ``step()`` (the step updates the edited
    weight, as torch's AdamW does). Beyond the issue's list, under its "whatever the loop does"."""

    def iteration(ctx: Ctx, step: int):
        ctx.opt.zero_grad(set_to_none=True)
        loss = _backward(ctx, step)
        if step % 2:
            with torch.no_grad():
                ctx.model.inp.weight.mul_(0.5)
        ctx.opt.step()
        return loss

    contract(iteration)


# --------------------------------------------------------------------------- skipped steps
@pytest.mark.parametrize("how", ["zero_grad", "zero_grad-in-place", "accumulate"])
def test_skipped_step(how: str) -> None:
    """Step 2 is skipped: ``zero_grad()`` without ``step()`` (a loss-spike guard; set to None or
    zeroed in place), or no ``zero_grad()`` either, so step 3's backward accumulates onto it."""

    def iteration(ctx: Ctx, step: int):
        if not (how == "accumulate" and step == 3):
            ctx.opt.zero_grad(set_to_none=True)
        loss = _backward(ctx, step)
        if step == 2:
            if how != "accumulate":
                ctx.opt.zero_grad(set_to_none=how == "zero_grad")
            return loss
        ctx.opt.step()
        return loss

    contract(iteration)


def test_frozen_parameter_passed_to_the_optimizer() -> None:
    """A parameter with ``requires_grad=False`` in a param group: never updated, no state."""

    def frozen(dtype: torch.dtype) -> Net:
        model = Net(dtype)
        model.gain.requires_grad_(False)
        return model

    off, on, _ = contract(_plain, model_fn=frozen)
    assert torch.equal(on.model.gain, torch.ones(40)) and not on.opt.state.get(on.model.gain)


# --------------------------------------------------------------------------- accumulation
MICROS = {"fixed": [2] * 6, "varying": [1, 3, 2, 1, 3, 2]}


@pytest.mark.parametrize("inside", [False, True], ids=["plain", "accumulating"])
@pytest.mark.parametrize("micros", list(MICROS))
def test_gradient_accumulation(micros: str, inside: bool) -> None:
    """Several backward() per step: without ``opt.accumulating()`` or with it around all but the
    last; a fixed or varying micro-batch count."""

    def iteration(ctx: Ctx, step: int):
        ctx.opt.zero_grad(set_to_none=True)
        n, losses = MICROS[micros][step], []
        for micro in range(n):
            quiet = inside and micro < n - 1 and ctx.kind != "torch"
            with ctx.opt.accumulating() if quiet else contextlib.nullcontext():
                losses.append(_backward(ctx, step, micro=micro, div=n))
        ctx.opt.step()
        return losses

    contract(iteration)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hook_count_changes_between_steps(dtype: torch.dtype) -> None:
    """``mid`` runs 1, 2 or 3 times per step (its gradient hooks fire as often): more often than in
    the last backward, its chunks start at the first firing and the gradient arrives again."""
    reps = [1, 2, 1, 3, 3, 1, 2]

    def iteration(ctx: Ctx, step: int):
        ctx.opt.zero_grad(set_to_none=True)
        loss = _backward(ctx, step, reps=reps[step])
        ctx.opt.step()
        return loss

    contract(iteration, dtype=dtype, steps=len(reps))


def test_step_with_a_closure() -> None:
    """``opt.step(closure)``: the backward runs inside ``step()``; the returned loss is compared."""

    def iteration(ctx: Ctx, step: int):
        def closure() -> torch.Tensor:
            ctx.opt.zero_grad(set_to_none=True)
            return _backward(ctx, step)

        return ctx.opt.step(closure)

    contract(iteration)


# --------------------------------------------------------------------------- torch.compile
def test_torch_compile_with_activation_checkpointing() -> None:
    """``torch.compile(model)`` (backend "aot_eager": dynamo + AOTAutograd's compiled backward,
    where the gradient hooks fire; inductor would only change the kernels, both sides alike, and
    costs ~40 s of compilation here) with ``mid`` under ``torch.utils.checkpoint``, and torch's
    clip sometimes active."""

    def compiled(dtype: torch.dtype) -> torch.nn.Module:
        return torch.compile(Net(dtype, checkpointed=True), backend="aot_eager")

    def iteration(ctx: Ctx, step: int):
        ctx.opt.zero_grad(set_to_none=True)
        loss = _backward(ctx, step)
        torch.nn.utils.clip_grad_norm_(ctx.model.parameters(), TORCH_CLIP["sometimes"](step))
        ctx.opt.step()
        return loss

    contract(iteration, model_fn=compiled)


# --------------------------------------------------------------------------- kernel failure
class _FailingKernel:
    """torch's fused AdamW kernel that raises at its ``fail_at``-th call (counted from ``calls``,
    reset by the test); None: never."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail_at: int | None = None
        self.failed = threading.Event()

    def __call__(self, *args, **kwargs) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            self.failed.set()
            raise OSError("injected kernel failure")
        fused_adamw_(*args, **kwargs)

    def wait_for(self, calls: int, timeout_s: float = 20.0) -> bool:
        """Wait (from the test's thread, before ``step()``) until chunks started during backward
        made ``calls`` calls (or one failed); False if they did not in ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.calls < calls and not self.failed.is_set():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True


REPS = [3, 3, 2, 1, 1, 1]
"""How often ``mid`` runs per step: at steps 2 (the control step) and 3 (the failing one) its hooks
fire fewer times than in the last backward, so its two chunks' gradients are not known final
before ``step()`` (they run there); the other three start early. (More often than in the last
backward would start mid's chunks at the first firing and restart them: the restart case of
test_hook_count_changes_between_steps.)"""


def _sd_tensors(opt: CPUOffloadAdamW) -> tuple[list[torch.Tensor], list]:
    sd = opt.state_dict()
    tensors = [t.detach().clone() for i in sorted(sd["state"]) for _, t in sorted(sd["state"][i].items())]
    return tensors, [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]


@pytest.mark.parametrize("where", ["early", "step"])
def test_kernel_failure_mid_step_leaves_the_last_committed_state(where: str) -> None:
    """The kernel raises in the first chunk started during backward, while backward's chunks run
    ("early"), or in the last chunk of the step, one that runs in ``step()`` after the three early
    chunks ran ("step"): ``step()`` raises, the parameters and the whole optimizer state are those
    before that step, and training continues bitwise like a run without the failed step."""
    kernel = _FailingKernel()
    model = Net()
    opt = CPUOffloadAdamW(groups(model), settings=SMALL, overlap_backward=True,
                          kernels=KernelSet(fused_adamw=kernel))
    ctx = Ctx(model=model, opt=opt, kind="on")

    def one(step: int) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = _backward(ctx, step, reps=REPS[step])
        opt.step()
        return loss

    losses = [one(0), one(1)]
    # The control step, shaped like the failing one: here 3 of the 5 chunks start during backward.
    kernel.calls = 0
    opt.zero_grad(set_to_none=True)
    losses.append(_backward(ctx, 2, reps=REPS[2]))
    assert kernel.wait_for(1), "no kernel call before step(): no chunk started during backward"
    time.sleep(0.05)
    early_calls = kernel.calls
    opt.step()
    calls_per_step = kernel.calls
    params_before = [p.detach().clone() for p in model.parameters()]
    state_before = _sd_tensors(opt)
    checkpoint = copy.deepcopy(opt.state_dict())

    kernel.calls, kernel.fail_at = 0, 1 if where == "early" else calls_per_step
    opt.zero_grad(set_to_none=True)
    _backward(ctx, 3, reps=REPS[3])
    # "early": the failure happened in backward; "step": the early chunks advanced (speculatively)
    assert kernel.wait_for(1 if where == "early" else early_calls)
    with pytest.raises(OSError, match="injected kernel failure"):
        opt.step()
    kernel.fail_at = None
    if where == "step":
        # The chunks that ran before it advanced (the committed early chunks, whose weights are
        # written as soon as they are judged, and the step's chunks before the failing one), and
        # parameters span chunks: part-stepped, so the optimizer refuses until a checkpoint is
        # loaded; the loop here loads the one from before the step and goes on.
        after = [p.detach() for p in model.parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(after, params_before))
        with pytest.raises(RuntimeError, match="part-stepped"):
            opt.step()
        opt.load_state_dict(checkpoint)
        with torch.no_grad():
            for p, b in zip(model.parameters(), params_before):
                p.copy_(b)
    assert_tensors([p.detach() for p in model.parameters()], params_before, "params after the failure")
    state_after = _sd_tensors(opt)
    assert_tensors(state_after[0], state_before[0], "state_dict tensors after the failure")
    assert state_after[1] == state_before[1]

    losses += [one(4), one(5)]  # training continues

    def without_step_3(c: Ctx, step: int) -> torch.Tensor:
        s = step if step < 3 else step + 1
        c.opt.zero_grad(set_to_none=True)
        loss = _backward(c, s, reps=REPS[s])
        c.opt.step()
        return loss

    ref_off = train("off", without_step_3, steps=5)
    ref_torch = train("torch", without_step_3, steps=5)
    try:
        assert_tensors(losses, ref_off.returned, "losses")
        got = state_lists(model, opt)
        for ref in (ref_off, ref_torch):
            want = state_lists(ref.model, ref.opt)
            for key in want:
                assert_tensors(got[key], want[key], f"{key} vs {ref.opt.__class__.__name__}")
    finally:
        close(ref_off)
        opt.close()
