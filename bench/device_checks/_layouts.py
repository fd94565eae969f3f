"""The gradient layouts of ``bench.device_checks`` (issue 40's coverage gaps): channels_last and
non-contiguous gradients, gradient accumulation under overlap, and, for ``check_dist``, DDP with
``gradient_as_bucket_view=True`` and DDP accumulating under ``no_sync``; with the model, batch,
optimizer and independent reference every check shares (``device_checks`` imports them from here).

Each layout runs one loop three times: overlap off, overlap on (no sync anywhere in the loop), and
an independent reference (torch's ``AdamW(fused=True)`` on fp32 masters on the host, stepped from
the gradients' values in the masters' own layout, the weights the masters rounded to the model's
dtype: :class:`HostReference`, the producer check's reference made a drop-in optimizer). Overlap
on must equal overlap off bitwise (weights, moments, ``step``) and the reference bitwise (within
``allclose`` for fused-mp on a torch build where it is not verified bitwise), and its last step
must commit every chunk it started. The layouts reuse the models and loops of the CPU tests that
cover them (``tests/test_channels_last.py``'s convolutions, ``tests/test_optimizer_numerics.py``'s
gradient set by a hook in a transposed layout, ``tests/test_overlap_backward.py``'s micro-batches
under ``opt.accumulating()``), sized so a weight spans several of the checks' chunks: on CUDA the
transport's per-chunk ``reshape`` of a non-contiguous gradient (``offload.pipeline._cuda_transport``)
runs; on the CPU the bf16 runs also go through the CUDA transport over the fake device
(``bench.device_checks._fake_device``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["HostReference", "LAYOUTS", "check_layouts", "dist_layouts"]  # (and the checks' _model, _batch, ...)

#: The layouts :func:`check_layouts` runs, each with what its gradients look like.
LAYOUTS = {
    "channels_last": "conv weights in channels_last: their gradients channels_last (NHWC strides)",
    "noncontiguous": "each weight's .grad replaced by a hook with the same values in a transposed layout",
    "accumulation": "3 backward passes per step(), all but the last under opt.accumulating()",
}
MICRO = 3
STEPS = 6
_ALL = ("exp_avg", "exp_avg_sq", "step")  # overlap off: every state tensor, bitwise


def _model(device: str, dtype: torch.dtype, *, width: int = 256, layers: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device=device, dtype=dtype)


def _optimizer(model: nn.Module, *, overlap: bool, kernel: str = "auto", device_ops: Any = None) -> Any:
    """The checks' optimizer: small chunks (several per model, so some start during backward)."""
    from offload import CPUOffloadAdamW, OffloadSettings

    return CPUOffloadAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, overlap_backward=overlap,
                           settings=OffloadSettings(threads=2, chunk_numel=1 << 15, kernel=kernel),  # type: ignore[arg-type]
                           device_ops=device_ops)


def _batch(device: str, dtype: torch.dtype, step: int, width: int = 256) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, width, generator=gen).to(device=device, dtype=dtype)


def _counts(opt: Any) -> tuple[int, int]:
    stats = opt.last_stats
    return stats.speculated_chunks, stats.committed_chunks


class HostReference:
    """torch's ``AdamW(fused=True)`` on fp32 host masters of ``model``'s parameters, as an
    optimizer: ``step()`` copies each gradient's values into a dense tensor of its master's layout
    (torch's fused CPU kernel reads a non-contiguous gradient as if contiguous), steps, and writes
    the masters back rounded to the model's dtype. ``state(i)``: parameter ``i``'s moments."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        self.masters = [p.detach().float().cpu().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=1e-3, weight_decay=0.1, fused=True)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        yield

    def step(self) -> None:
        for m, p in zip(self.masters, self.params):
            m.grad = torch.empty_like(m).copy_(p.grad)
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.masters, self.params):
                p.copy_(m)

    def state(self, i: int) -> dict[str, Any]:
        return self.opt.state[self.masters[i]]

    def close(self) -> None:
        pass


class _Convs(nn.Module):
    """``tests/test_channels_last.py``'s net, wider: conv2's weight (64 x 64 x 3 x 3) spans two chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3)
        self.conv2 = nn.Conv2d(64, 64, 3)
        self.head = nn.Linear(64 * 4 * 4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv2(torch.relu(self.conv1(x))).flatten(1))


def _transposed_grads(model: nn.Module) -> None:
    """Each matrix's ``.grad`` replaced by the same values in a transposed layout (strides
    ``(1, rows)``), by a post-accumulate-grad hook registered before the optimizer's."""
    for p in model.parameters():
        if p.dim() == 2:
            p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", q.grad.t().contiguous().t()))


def _build(layout: str, device: str, dtype: torch.dtype) -> tuple[nn.Module, Callable[[int], torch.Tensor]]:
    """The layout's model (the same weights every call) and its batch of a step (or micro-batch)."""
    if layout != "channels_last":
        model = _model(device, dtype)
        if layout == "noncontiguous":
            _transposed_grads(model)
        return model, lambda step: _batch(device, dtype, step)
    torch.manual_seed(0)
    model = _Convs().to(device=device, dtype=dtype, memory_format=torch.channels_last)
    w = model.conv2.weight
    assert w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()

    def batch(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(4, 3, 8, 8, generator=g).to(device=device, dtype=dtype)
        return x.contiguous(memory_format=torch.channels_last)

    return model, batch


def _loop(model: nn.Module, opt: Any, batch: Callable[[int], torch.Tensor], *, micro: int,
          fault: Callable[[nn.Module], None] | None = None, fake: Any = None,
          wrapped: nn.Module | None = None) -> None:
    """STEPS steps of ``micro`` backward passes each (all but the last under ``opt.accumulating()``
    and, given a DDP ``wrapped``, its ``no_sync()``), no sync anywhere; ``fault`` runs after each
    step's last backward (the tests' seam: a gradient changed before ``step()``)."""
    net = model if wrapped is None else wrapped
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(micro):
            if fake is not None:
                fake.sync()  # the forward's kernels: after what the caller's stream waits for
            last = m == micro - 1
            quiet = contextlib.nullcontext() if last else opt.accumulating()
            no_sync = contextlib.nullcontext() if last or wrapped is None else wrapped.no_sync()
            with quiet, no_sync:
                (net(batch(10 * step + m)).float().square().mean() / micro).backward()
        if fault is not None:
            fault(model)
        opt.step()
    if fake is not None:
        fake.sync()


def _against(model: nn.Module, opt: Any, other: nn.Module, state: Callable[[Any, int], dict[str, Any]],
             exact: bool, *, keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")) -> list[str]:
    """What differs between ``model``/``opt`` and ``other`` with its per-parameter ``state``."""
    bad = []
    for i, (p, r) in enumerate(zip(model.parameters(), other.parameters())):
        pairs = [("param", p.detach(), r.detach())] + [(k, opt.state[p][k], state(r, i)[k]) for k in keys]
        for what, a, b in pairs:
            a, b = a.cpu(), b.cpu().to(a.dtype)
            if not (torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1.6e-2, atol=1e-5)):
                bad.append(f"{what} {i}")
    return bad


def _run_layout(layout: str, device: str, dtype: torch.dtype, fake: Any,
                fault: Callable[[nn.Module], None] | None) -> dict[str, Any]:
    """One layout, one dtype: reference, overlap off, overlap on (its faults and fake device)."""
    from offload.kernels._fused_mp import bitwise_matches_torch

    micro = MICRO if layout == "accumulation" else 1
    ref_model, batch = _build(layout, device, dtype)
    ref = HostReference(ref_model)
    _loop(ref_model, ref, batch, micro=micro)
    runs = []
    for overlap in (False, True):
        model, batch = _build(layout, device, dtype)
        ops = fake if overlap else None
        if ops is not None:
            ops.producing(model)  # (before the optimizer's hooks)
        opt = _optimizer(model, overlap=overlap, device_ops=ops)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*non-contiguous.*", category=UserWarning)
                _loop(model, opt, batch, micro=micro, fault=fault if overlap else None, fake=ops)
            runs.append((model, opt, _counts(opt) if overlap else None))  # (counts after the loop)
        finally:
            opt.close()
    (off_model, off_opt, _), (model, opt, (speculated, committed)) = runs
    grads = [p.grad for p in model.parameters() if p.dim() > 1]  # the last step's: the layout really ran
    laid_out = {"channels_last": all(g.is_contiguous(memory_format=torch.channels_last) and not g.is_contiguous()
                                     for g in grads if g.dim() == 4),
                "noncontiguous": not any(g.is_contiguous() for g in grads)}.get(layout, True)
    exact = opt.settings.kernel == "torch" or bitwise_matches_torch()
    vs_off = _against(model, opt, off_model, lambda r, i: off_opt.state[r], True, keys=_ALL)
    vs_ref = _against(model, opt, ref_model, lambda r, i: ref.state(i), exact)
    result = {"kernel": opt.settings.kernel, "vs_overlap_off": vs_off[:5], "vs_reference": vs_ref[:5],
              "reference": "bitwise" if exact else "close", "speculated/committed": (speculated, committed),
              "grad_strides": [g.stride() for g in grads][:3]}
    assert laid_out, f"{layout} {dtype}: the gradients did not have the layout (strides {result['grad_strides']})"
    if fake is not None:
        result.update(device_order_violations=len(fake.violations), fake_errors=fake.errors()[:3])
    return result


def check_layouts(device: str, *, fault: Callable[[str, nn.Module], None] | None = None,
                  fake: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Gradient layouts with overlap on, no sync in the loop: channels_last conv weights (their
    gradients channels_last), each matrix's .grad replaced by a hook with a non-contiguous
    (transposed) view of the same values, and gradient accumulation (3 backward passes per step,
    all but the last under ``opt.accumulating()``); fp32 and bf16. Each equals overlap off bitwise
    AND an independent reference (torch's AdamW on fp32 masters on the host; bitwise, or close for
    fused-mp where it is not verified), and its last step commits every chunk it started. On the
    CPU the bf16 runs go through the CUDA transport over the fake device (its device order
    checked); on CUDA with cuDNN's deterministic algorithms (three runs compared bitwise).
    ``fault(layout, model)``: run on the overlapped model before each ``step()`` (the tests'
    seam); ``fake``: makes the fake device (default ``bench.device_checks._fake_device.FakeDevice``)."""
    from bench.device_checks._fake_device import FakeDevice

    make = FakeDevice if fake is None else fake
    out: dict[str, Any] = {"layouts": dict(LAYOUTS)}
    failed = []
    for layout in LAYOUTS:
        for dtype in (torch.float32, torch.bfloat16):
            dev = make() if device == "cpu" and dtype == torch.bfloat16 else None
            hook = None if fault is None else (lambda model, layout=layout: fault(layout, model))
            try:  # cuDNN's weight-gradient algorithms may add in any order: the deterministic ones
                with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
                    r = _run_layout(layout, device, dtype, dev, hook)
            finally:
                if dev is not None:
                    dev.close()
            name = f"{'fake-cuda-' if dev is not None else ''}{layout}-{dtype}"
            out[name] = r
            speculated, committed = r["speculated/committed"]
            if (r["vs_overlap_off"] or r["vs_reference"] or not (speculated > 0 and committed == speculated)
                    or r.get("device_order_violations") or r.get("fake_errors")):
                failed.append(name)
    assert not failed, f"gradient layouts failed: {failed}: " + "; ".join(
        f"{n}: overlap off differs in {out[n]['vs_overlap_off']}, the reference in {out[n]['vs_reference']}, "
        f"speculated/committed {out[n]['speculated/committed']}" for n in failed)
    return out


def dist_layouts(device: str, kind: str) -> dict[str, Any]:
    """``check_dist``'s DDP layouts (one rank): ``ddp-bucket-view`` (``gradient_as_bucket_view=True``,
    ``attach_ddp``) and ``ddp-accumulate`` (``attach_ddp``, 3 micro-batches, all but the last under
    ``no_sync()`` and ``opt.accumulating()``), fp32: overlap on against overlap off (bitwise) and the
    independent reference (a plain model, torch's AdamW on fp32 masters: one rank's all-reduce
    leaves the gradients' bits)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from offload.kernels._fused_mp import bitwise_matches_torch

    dtype, micro = torch.float32, MICRO if kind == "ddp-accumulate" else 1
    batch = lambda step: _batch(device, dtype, step)  # noqa: E731
    ref_model = _model(device, dtype)
    ref = HostReference(ref_model)
    _loop(ref_model, ref, batch, micro=micro)
    runs = []
    for overlap in (False, True):
        model = _model(device, dtype)
        wrapped = DDP(model, gradient_as_bucket_view=kind == "ddp-bucket-view")
        opt = _optimizer(model, overlap=overlap)
        if overlap:
            opt.attach_ddp(wrapped)
        try:
            _loop(model, opt, batch, micro=micro, wrapped=wrapped)
            runs.append((model, opt, _counts(opt)))
        finally:
            opt.close()
    (off_model, off_opt, _), (model, opt, counts) = runs
    vs_off = _against(model, opt, off_model, lambda r, i: off_opt.state[r], True, keys=_ALL)
    exact = opt.settings.kernel == "torch" or bitwise_matches_torch()
    vs_ref = _against(model, opt, ref_model, lambda r, i: ref.state(i), exact)
    assert not vs_off and not vs_ref, (f"{kind}: overlap differs from overlap off in {vs_off[:5]}, "
                                       f"from the reference in {vs_ref[:5]}")
    assert counts[0] > 0 and counts[0] == counts[1], f"{kind}: speculated/committed {counts} in the last step"
    return {"differs": vs_off, "vs_reference": vs_ref, "committed_last_step": counts[1]}
