"""overlap_backward=True: chunks start during backward; results bitwise equal to the plain step."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import assert_bitwise, batch, make_model, param_groups, uses_sometimes

from offload import CPUOffloadAdamW, OffloadSettings
from offload.testing import KernelSet
from offload.kernels._adamw import fused_adamw_

pytestmark = pytest.mark.usefixtures("single_threaded_main")

STEPS = 8
MICRO = 2


def _train(model, opt, steps: range, *, early: list[int] | None = None) -> None:
    """Gradient accumulation over MICRO micro-batches (all but the last under accumulating()),
    an lr scheduler changing lr every step, a layer used only on some steps."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.2 * s))
    for step in steps:
        opt.zero_grad(set_to_none=True)
        for micro in range(MICRO):
            loss = model(batch(step, micro), use_sometimes=uses_sometimes(step)) / MICRO
            if micro < MICRO - 1:
                with opt.accumulating():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        if early is not None:
            early.append(opt.last_stats.speculated_chunks)
        sched.step()


def _state(model, opt, key: str) -> list[torch.Tensor]:
    return [opt.state[p][key] for p in model.parameters() if opt.state.get(p)]


@pytest.mark.parametrize(("chunk_numel", "threads"), [(1024, 2), (1 << 20, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overlap_is_bitwise_equal_to_the_plain_step(dtype, chunk_numel: int, threads: int) -> None:
    settings = OffloadSettings(threads=threads, chunk_numel=chunk_numel)
    plain_model, over_model = make_model(dtype), make_model(dtype)
    plain = CPUOffloadAdamW(param_groups(plain_model), settings=settings)
    over = CPUOffloadAdamW(param_groups(over_model), settings=settings, overlap_backward=True)
    _train(plain_model, plain, range(STEPS))
    early: list[int] = []
    _train(over_model, over, range(STEPS), early=early)

    assert early[0] == 0  # the first backward only calibrates
    assert all(n > 0 for n in early[1:]), early  # later steps really start chunks in backward
    assert_bitwise(list(over_model.parameters()), list(plain_model.parameters()), "params")
    for key in ("step", "exp_avg", "exp_avg_sq", "master_param"):
        assert_bitwise(_state(over_model, over, key), _state(plain_model, plain, key), key)
    assert not over.state.get(over_model.unused.weight)  # no grad ever: no state
    # the block run twice per backward fires its hook twice; the count was learned
    slot = over._layout.registry.of(over_model.twice.weight).slot
    assert over._layout.registry[slot].hooks_expected == 2
    spans = over.last_stats.spans
    # (an early chunk's spans start before step() unless the worker was descheduled: not asserted)
    assert all(s.start_s >= 0 for s in spans if s.stage == "materialize")
    plain.close()
    over.close()


def _calibrated(threads: int = 1, kernel: str = "auto",
                kernels: KernelSet | None = None) -> tuple[torch.nn.Module, CPUOffloadAdamW]:
    model = make_model()
    opt = CPUOffloadAdamW(
        param_groups(model), settings=OffloadSettings(threads=threads, chunk_numel=1024, kernel=kernel),
        overlap_backward=True, kernels=kernels,
    )
    _train(model, opt, range(2))
    return model, opt


def _pair(kernel: str = "auto", kernels: KernelSet | None = None):
    """(model, plain optimizer), (model, overlap optimizer), both after 2 calibrating steps."""
    out = []
    for overlap in (False, True):
        model = make_model()
        opt = CPUOffloadAdamW(
            param_groups(model), settings=OffloadSettings(threads=1, chunk_numel=1024, kernel=kernel),
            overlap_backward=overlap, kernels=kernels if overlap else None,
        )
        _train(model, opt, range(2))
        out.append((model, opt))
    return out


def _same(pair) -> None:
    (m0, o0), (m1, o1) = pair
    assert_bitwise(list(m1.parameters()), list(m0.parameters()), "params")
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert_bitwise(_state(m1, o1, key), _state(m0, o0, key), key)


class _LaunchKernels:
    """Kernels (``KernelSet`` fields) that count the calls the worker makes: with nothing to redo,
    ``step()`` calls none, so those of a window are the early kernels (which also take the
    speculation's checksums and backups in their pass)."""

    def __init__(self) -> None:
        self.taken = 0
        self._cond = threading.Condition()

    def kernels(self) -> KernelSet:
        real = KernelSet()
        names = ("fused_adamw", "mixed_precision_adamw", "native_adamw_f32")
        return KernelSet(**{name: self._counting(getattr(real, name)) for name in names})

    def _counting(self, fn):
        def kernel(*args, **kwargs):
            out = fn(*args, **kwargs)
            if threading.current_thread() is not threading.main_thread():
                with self._cond:
                    self.taken += 1
                    self._cond.notify_all()
            return out
        return kernel

    def reset(self) -> None:
        with self._cond:
            self.taken = 0

    def wait_for(self, count: int) -> None:
        """Until ``count`` kernel calls since :meth:`reset`: the early kernels ran."""
        with self._cond:
            assert self._cond.wait_for(lambda: self.taken >= count, timeout=300), (self.taken, count)


def test_gradient_clipped_after_backward_is_redone_exactly() -> None:
    launches = _LaunchKernels()
    pair = _pair(kernels=launches.kernels())
    per_window = None
    for step in (4, 5, 6):
        for model, opt in pair:
            opt.zero_grad()
            launches.reset()
            model(batch(step)).backward()
            if opt._overlap is not None:
                assert opt._overlap.has_launched()
                if per_window is not None:
                    # The early kernels read the unclipped gradients before the clip writes them
                    # (a worker that only got to them after the clip would read clipped gradients
                    # and rightly commit them: the outcome must not depend on the machine's speed).
                    launches.wait_for(per_window)
            if step > 4:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            opt.step()
            if opt._overlap is not None and per_window is None:
                per_window = launches.taken  # an unclipped step: the early kernels of one window
                assert per_window > 0 and opt.last_stats.committed_chunks == opt.last_stats.num_chunks
    stats = pair[1][1].last_stats
    assert stats.speculated_chunks == stats.num_chunks and stats.committed_chunks == 0
    _same(pair)
    for _, opt in pair:
        opt.close()


def test_second_backward_outside_accumulating_is_exact() -> None:
    pair = _pair()
    for model, opt in pair:
        opt.zero_grad()
        model(batch(5)).backward()
        model(batch(6)).backward()
        opt.step()
    _same(pair)
    for _, opt in pair:
        opt.close()


def test_calls_between_an_early_launch_and_step_undo_it() -> None:
    pair = _pair()
    sd = None
    calls = (
        lambda opt: opt.zero_grad(),
        lambda opt: opt.apply_settings(OffloadSettings(threads=1, chunk_numel=1024)),
        lambda opt: opt.state_dict(),
        lambda opt: opt.load_state_dict(opt.state_dict()),
    )
    for i, call in enumerate(calls):
        for model, opt in pair:
            opt.zero_grad()
            model(batch(10 + i)).backward()
            if opt._overlap is not None:
                assert opt._overlap.has_launched()
            call(opt)
            model(batch(20 + i)).backward()
            opt.step()
        _same(pair)
    for _, opt in pair:
        sd = opt.state_dict()
        opt.load_state_dict(sd)
        opt.close()


def test_step_without_backward_and_no_grads_match_the_plain_step() -> None:
    """A step() with stale grads and no backward, then a step with every grad None."""
    models = [make_model(), make_model()]
    opts = [
        CPUOffloadAdamW(param_groups(models[0]), settings=OffloadSettings(chunk_numel=1024)),
        CPUOffloadAdamW(
            param_groups(models[1]), settings=OffloadSettings(chunk_numel=1024),
            overlap_backward=True,
        ),
    ]
    for model, opt in zip(models, opts):
        _train(model, opt, range(3))
        opt.step()  # no backward since the last step: same grads again
        opt.zero_grad()
        opt.step()  # no grads at all: nothing changes
        _train(model, opt, range(3, 5))
    assert_bitwise(list(models[1].parameters()), list(models[0].parameters()), "params")
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert_bitwise(_state(models[1], opts[1], key), _state(models[0], opts[0], key), key)
    for opt in opts:
        opt.close()


def test_failure_of_an_early_chunk_reaches_step_and_leaves_the_state_untouched() -> None:
    broken = [False]

    def kernel(*args, **kwargs):
        if broken[0]:
            raise OSError("injected")
        fused_adamw_(*args, **kwargs)

    pair = _pair(kernel="torch", kernels=KernelSet(fused_adamw=kernel))
    model, opt = pair[1]
    before = [t.clone() for t in list(model.parameters()) + _state(model, opt, "exp_avg") + _state(model, opt, "step")]
    broken[0] = True
    opt.zero_grad()
    model(batch(5)).backward()
    with pytest.raises(OSError, match="injected"):
        opt.step()
    after = list(model.parameters()) + _state(model, opt, "exp_avg") + _state(model, opt, "step")
    assert_bitwise(after, before, "state after the failed step")
    broken[0] = False
    for m, o in pair:
        o.zero_grad()
        m(batch(6)).backward()
        o.step()
    _same(pair)
    for _, o in pair:
        o.close()


def test_a_gradient_written_before_the_launch_checksum_is_what_the_kernel_reads() -> None:
    """The speculation's checksum must precede every read of the gradient by the early chunk
    (the torch kernel's bf16 upcast included): a write landing just before the checksum (here: a
    checksums spy halving the gradients on the worker, as a concurrent ``scaler.unscale_`` or clip
    would) is then both consumed and checksummed, so the commit is right. With the checksum after
    the upcast, the kernel consumed the old values and the step committed them (a race the
    GradScaler contract test hit about one run in two)."""
    import threading

    from offload.kernels._grad_stats import checksums_

    halved: list[int] = []  # storages of the gradients the spy wrote, first worker call of each step

    def spy(tensors, **kw):
        if threading.current_thread() is not threading.main_thread() and not halved:
            # the views one chunk reads: halve the whole gradients they are of, once each
            bases = {b.untyped_storage().data_ptr(): b for b in (t if t._base is None else t._base for t in tensors)}
            for ptr, base in bases.items():
                base.mul_(0.5)
                halved.append(ptr)
        return checksums_(tensors, **kw)

    settings = OffloadSettings(threads=1, chunk_numel=1024, kernel="torch")
    models = [make_model(torch.bfloat16), make_model(torch.bfloat16)]
    plain = CPUOffloadAdamW(param_groups(models[0]), settings=settings)
    over = CPUOffloadAdamW(param_groups(models[1]), settings=settings, overlap_backward=True,
                           kernels=KernelSet(checksums=spy))
    for step in range(4):
        halved.clear()
        for model, opt in ((models[1], over), (models[0], plain)):
            opt.zero_grad()
            model(batch(step)).backward()
            if opt is plain:  # the same write, on the same parameters, before step()
                idx = {i for i, p in enumerate(models[1].parameters()) if p.grad is not None and p.grad.untyped_storage().data_ptr() in halved}
                with torch.no_grad():
                    for i, p in enumerate(model.parameters()):
                        if i in idx:
                            p.grad.mul_(0.5)
            opt.step()
        if step > 0:
            assert halved and over.last_stats.committed_chunks > 0
    assert_bitwise(list(models[1].parameters()), list(models[0].parameters()), "params")
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert_bitwise(_state(models[1], over, key), _state(models[0], plain, key), key)
    plain.close()
    over.close()


@pytest.mark.parametrize("change", ["negate", "drop-a-grad", "new-step-tensor"])
def test_review_found_loops_are_exact(change: str) -> None:
    """Found by review: a negated gradient with as many negative as positive elements kept a plain
    word sum (gradient ascent by hand: ``p.grad.neg_()``); a gradient set to None after an early
    kernel counted its step; a step tensor replaced after backward."""
    pair = _pair(kernel="torch")
    for step in (5, 6, 7):
        for model, opt in pair:
            opt.zero_grad()
            model(batch(step)).backward()
            if opt._overlap is not None:
                assert opt._overlap.has_launched()
            params = list(model.parameters())
            with torch.no_grad():
                if change == "negate":
                    for p in params:
                        if p.grad is not None:
                            p.grad.neg_()
                elif change == "drop-a-grad":
                    params[step % len(params)].grad = None
                elif opt.state.get(params[0]):  # a new tensor, not read from the window's state
                    opt.state[params[0]]["step"] = torch.tensor(float(step))
            opt.step()
    _same(pair)
    for _, opt in pair:
        opt.close()


@pytest.mark.parametrize(("kernel", "dtype"), [("torch", torch.float32), ("auto", torch.float32),
                                               ("auto", torch.bfloat16)])
def test_a_gradient_changed_and_restored_around_an_early_kernel_is_not_committed_wrong(kernel, dtype) -> None:
    """A -> B -> A around the early kernel's read: on the worker, right before each early kernel
    call, every gradient is doubled, and halved back right after it (exact), so ``step()`` sees A
    again. What the kernel checksummed must be what it consumed: torch's kernel reads a copy taken
    with its checksum before the change (A, committed), the native one reads B inside its call
    and checksums that (redone); neither may commit what B gave as A. Found by
    ``bench.device_checks races`` under load (torch's kernel read the live gradient after its
    checksum: 15 of 20 runs wrong)."""
    settings = OffloadSettings(threads=1, chunk_numel=1024, kernel=kernel)
    backward_done = threading.Event()
    window = [False]
    live: list[torch.nn.Parameter] = []
    calls = [0]
    committed: list[int] = []

    def around(real):
        def kernel_call(*args, **kwargs):
            if not (window[0] and threading.current_thread() is not threading.main_thread()):
                return real(*args, **kwargs)
            assert backward_done.wait(timeout=60)  # every gradient is final now
            with torch.no_grad():
                for p in live:
                    if p.grad is not None:
                        p.grad.mul_(2.0)
                try:
                    return real(*args, **kwargs)
                finally:
                    for p in live:
                        if p.grad is not None:
                            p.grad.mul_(0.5)
                    calls[0] += 1
        return kernel_call

    real = KernelSet()
    kernels = KernelSet(**{name: around(getattr(real, name))
                           for name in ("fused_adamw", "mixed_precision_adamw", "native_adamw_f32")})
    models = [make_model(dtype), make_model(dtype)]  # fp32: torch's kernel reads the gradient itself
    live.extend(models[1].parameters())
    plain = CPUOffloadAdamW(param_groups(models[0]), settings=settings)
    over = CPUOffloadAdamW(param_groups(models[1]), settings=settings, overlap_backward=True, kernels=kernels)
    for step in range(5):
        for model, opt in ((models[0], plain), (models[1], over)):
            opt.zero_grad()
            window[0], calls[0] = opt is over and step > 0, 0
            backward_done.clear()
            model(batch(step)).backward()
            backward_done.set()
            if window[0]:  # every early chunk's kernel (one call each: one item kind) ran
                launched = len(over._overlap.speculation.take())
                for _ in range(1200):
                    if calls[0] >= launched:
                        break
                    threading.Event().wait(0.05)
                assert calls[0] >= launched, (step, launched, calls[0])
            window[0] = False
            opt.step()
            if opt is over and step > 0:
                committed.append(over.last_stats.committed_chunks)
    if kernel == "torch":  # its copy, taken before the change, is what it consumed: committed
        assert all(n > 0 for n in committed), committed
    else:  # the native kernel read B inside its call (checksummed as B): every chunk redone
        assert committed == [0] * len(committed), committed
    assert_bitwise(list(models[1].parameters()), list(models[0].parameters()), "params")
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert_bitwise(_state(models[1], over, key), _state(models[0], plain, key), key)
    plain.close()
    over.close()
