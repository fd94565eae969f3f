"""The GPU checks of ``bench/device_check.sh``: prebuild, races, commits, layouts, syncs, GradScaler, memory, timing.

    python -m bench.device_checks --list                          # the checks and what each asserts
    python -m bench.device_checks --device cuda races commits     # some of them, on the GPU
    python -m bench.device_checks --device cpu races commits      # the same assertions on the host
    torchrun --nproc-per-node 1 -m bench.device_checks --device cuda dist

Each check prints one JSON line (its name, ``ok``, what it measured, the kernel that ran); one that
raises anything is reported and the next runs, one past ``--watchdog-s`` has every thread's stack
dumped (``bench.device_checks._runner``); the command exits 1 if any failed. The race checks compare
``overlap_backward=True`` with ``False`` on the same loop, bitwise; ``producer`` compares with an
independent reference (torch's AdamW on fp32 masters); others assert a count. None reads
``last_stats`` (a host wait for the step's weight copies) between a ``step()`` and the next
forward: it would hand the forward finished copies whether or not ``step()`` ordered the stream.
They run on ``--device cpu`` too (without the GPU-only parts: sleeps on the stream, sync counting,
device memory), which is how CI checks the checks (``tests/test_device_checks.py``). Written
before a GPU was lent to this project: the CUDA parts are reviewed, not yet run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from bench.device_checks._fake_device import FakeDevice
from bench.device_checks._layouts import HostReference, _batch, _counts, _model, _optimizer, check_layouts, dist_layouts
from bench.device_checks._perturb import CpuLoad, SlowCopies, delay_gradients, edit_after_backward
from bench.device_checks._runner import run_check

__all__ = ["CHECKS", "main"]

#: Seconds a check may run before every thread's stack is dumped to stderr (``--watchdog-s``):
#: below each step's ``timeout`` in ``bench/device_check.sh``, above what a check should take.
WATCHDOG_S = 40.0


def _pair(device: str, dtype: torch.dtype, *, device_ops: Any = None, **kwargs: Any) -> list[tuple[nn.Module, Any]]:
    """(model, optimizer) with overlap off, then on; the same weights; ``device_ops``: the
    overlapped optimizer's."""
    out = []
    for overlap in (False, True):
        model = _model(device, dtype, **kwargs)
        out.append((model, _optimizer(model, overlap=overlap, device_ops=device_ops if overlap else None)))
    return out


def _differs(pair: list[tuple[nn.Module, Any]]) -> list[str]:
    (m0, o0), (m1, o1) = pair
    bad = [f"param {i}" for i, (a, b) in enumerate(zip(m0.parameters(), m1.parameters())) if not torch.equal(a, b)]
    for key in ("exp_avg", "exp_avg_sq", "step"):
        for i, (a, b) in enumerate(zip(m0.parameters(), m1.parameters())):
            if not torch.equal(o0.state[a][key], o1.state[b][key]):
                bad.append(f"{key} {i}")
    return bad


def _train(pair: list[tuple[nn.Module, Any]], device: str, dtype: torch.dtype, steps: Sequence[int],
           after_backward: Callable[[nn.Module], None] | None = None) -> list[tuple[int, int]]:
    """Both optimizers through ``steps``; (speculated, committed) of the overlapped one per step.

    No host sync between a ``step()`` and the next forward, as in a training loop: ``last_stats``
    waits on the host for the step's weight copies, so a step's counts are read only once the
    next forward is queued (the last step's after the loop)."""
    counts = []
    for i, step in enumerate(steps):
        for model, opt in pair:
            opt.zero_grad()
            loss = model(_batch(device, dtype, step)).float().square().mean()
            if i and opt is pair[1][1]:
                counts.append(_counts(opt))  # the previous step's: this forward is queued already
            loss.backward()
            if after_backward is not None:
                after_backward(model)
            opt.step()  # no sync before: what a training loop does
    counts.append(_counts(pair[1][1]))
    return counts


def check_races(device: str) -> dict[str, Any]:
    """After backward, an in-place gradient change queued behind a GPU sleep (A -> A/2, and A -> 2A
    -> A), ``step()`` with no sync: overlap gives the bits of overlap off given the final gradients
    (what the early chunks consumed must be what ``step()`` validates). On CUDA also with a copy
    stream that falls behind (a GPU sleep before each chunk's copies, ``device_ops=``) and with
    the CPU kernels slowed by a competing load (A -> B -> A around late kernels)."""
    from contextlib import nullcontext

    variants: dict[str, tuple[Any, Any]] = {"": (None, nullcontext)}
    if device == "cuda":
        from offload.testing import TorchCudaOps

        variants["slow-copies-"] = (SlowCopies(TorchCudaOps(torch.device(device))), nullcontext)
        variants["cpu-load-"] = (None, CpuLoad)
    out: dict[str, Any] = {}
    for variant, (ops, load) in variants.items():
        for dtype in (torch.float32, torch.bfloat16):
            for how in ("half", "aba"):
                pair = _pair(device, dtype, device_ops=ops)
                _train(pair, device, dtype, range(2))
                with load():
                    counts = _train(pair, device, dtype, range(2, 6), after_backward=edit_after_backward(device, how))
                bad = _differs(pair)
                out[f"{variant}{dtype}-{how}"] = {"differs": bad[:5], "speculated/committed": counts,
                                                  "kernel": pair[1][1].settings.kernel}
                # (a chunk that read A/2, its worker having got to it after the change, rightly
                # commits: only the bits are asserted)
                assert not bad, f"{variant}{dtype} {how}: overlap differs from overlap off in {bad[:5]}"
    return out


def check_commits(device: str) -> dict[str, Any]:
    """A plain loop commits every chunk it started (more than none), bitwise overlap off."""
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        pair = _pair(device, dtype)
        counts = _train(pair, device, dtype, range(6))[1:]  # the first step only calibrates
        bad = _differs(pair)
        out[str(dtype)] = {"speculated/committed": counts, "differs": bad[:5], "kernel": pair[1][1].settings.kernel}
        assert not bad, f"{dtype}: overlap differs from overlap off in {bad[:5]}"
        assert all(s == c and s > 0 for s, c in counts), f"{dtype}: not every started chunk committed {counts}"
    return out


def check_prebuild(device: str) -> dict[str, Any]:
    """Builds (or loads from its cache) the native kernel before any timed step, and says what runs
    here: torch, CUDA, the CPU capability, whether fused-mp builds (and why not), whether
    ``kernel="auto"`` picks it (only on a torch build where it is verified bitwise torch's kernel)
    and the build's seconds. Fails only where a C++ toolchain is there and the build failed."""
    from offload.kernels._fused_mp import bitwise_matches_torch, fused_mp_available

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if device == "cuda":
        t0 = time.perf_counter()
        torch.cuda.init()
        out["gpu"] = torch.cuda.get_device_name()
        out["cuda_init_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    ok, reason = fused_mp_available()  # the first call in a process builds or loads the extension
    out.update(build_s=round(time.perf_counter() - t0, 2), fused_mp=ok, reason=reason,
               auto="fused-mp" if ok and bitwise_matches_torch() else "torch")
    assert ok or reason.startswith(("no C++ compiler", "ninja is not installed")), (
        f"the native kernel failed to build on a machine with a toolchain: {reason}")
    return out


def _reference(device: str, dtype: torch.dtype, steps: Sequence[int]) -> tuple[nn.Module, list[dict[str, Any]]]:
    """An independent run of the loop (:class:`bench.device_checks._layouts.HostReference`: torch's
    AdamW(fused=True) on fp32 masters on the host, host syncs anywhere). Its weights and moments
    (per parameter) after ``steps``."""
    model = _model(device, dtype)
    ref = HostReference(model)
    for step in steps:
        ref.zero_grad()
        model(_batch(device, dtype, step)).float().square().mean().backward()
        ref.step()
    return model, [ref.state(i) for i in range(len(ref.masters))]


def check_producer(device: str, *, fake: Callable[[], FakeDevice] = FakeDevice) -> dict[str, Any]:
    """Gradients that become final after their hooks fired (a GPU sleep queued in every layer's
    backward pre-hook, before the ops that produce its gradients), overlap on, no sync anywhere in
    the loop: the weights and moments equal an independent reference (torch's AdamW on fp32 masters
    on the host) bitwise (within assert_close's tolerance for fused-mp on a torch build where it
    is not verified bitwise), and the last step commits every chunk it started (a gradient copied
    before it was final fails its checksum and is redone). With torch's kernel and, where it
    builds, the native one forced (it writes the weights into the h2d ring and the early places).
    On the CPU also the CUDA transport over a fake device (``bench.device_checks._fake_device``, bf16): the same
    comparisons, and every gradient copy ordered after the work that produced it (its wait on the
    ready event) and every weight copy after the work queued before it (its wait on the write
    event), as a GPU would order them; ``fake``: makes that device (tests: one that drops a wait)."""
    from offload.kernels._fused_mp import fused_mp_available

    steps = range(6)
    kernels = ["torch"] + (["fused-mp"] if fused_mp_available()[0] else [])
    runs = [(dtype, kernel, None) for dtype in (torch.float32, torch.bfloat16) for kernel in kernels]
    if device == "cpu":  # the CUDA transport's path, its device order checked
        runs += [(torch.bfloat16, kernel, fake) for kernel in kernels]
    refs = {dtype: _reference(device, dtype, steps) for dtype in {dtype for dtype, _, _ in runs}}
    out: dict[str, Any] = {}
    for dtype, kernel, make in runs:
        name = f"{'fake-cuda-' if make is not None else ''}{dtype}-{kernel}"
        out[name] = _producer_run(device, dtype, kernel, steps, refs[dtype], None if make is None else make())
    return out


def _producer_run(device: str, dtype: torch.dtype, kernel: str, steps: Sequence[int],
                  ref: tuple[nn.Module, list[dict[str, Any]]], fake: FakeDevice | None) -> dict[str, Any]:
    """One run of :func:`check_producer`: its result, or AssertionError saying what differs."""
    from offload.kernels._fused_mp import bitwise_matches_torch

    ref_model, ref_state = ref
    model = _model(device, dtype)
    calls = delay_gradients(model, device)
    if fake is not None:
        fake.producing(model)  # (before the optimizer's hooks)
    opt = _optimizer(model, overlap=True, kernel=kernel, device_ops=fake)
    try:
        with warnings.catch_warnings():  # (the first layer's input needs no gradient: said once per hook)
            warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
            for step in steps:
                opt.zero_grad()
                if fake is not None:
                    fake.sync()  # the forward's kernels: after what the caller's stream waits for
                model(_batch(device, dtype, step)).float().square().mean().backward()
                opt.step()  # no sync before, none after until the next forward
        if fake is not None:
            fake.sync()
        exact = opt.settings.kernel == "torch" or bitwise_matches_torch()
        bad = []
        for i, (p, r, rs) in enumerate(zip(model.parameters(), ref_model.parameters(), ref_state)):
            pairs = [("param", p.detach(), r.detach())]
            pairs += [(key, opt.state[p][key], rs[key]) for key in ("exp_avg", "exp_avg_sq")]
            for what, a, b in pairs:
                a, b = a.cpu(), b.cpu().to(a.dtype)
                if not (torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1.6e-2, atol=1e-5)):
                    bad.append(f"{what} {i}")
        speculated, committed = _counts(opt)  # after the loop: nothing left to mask
        result = {"kernel": opt.settings.kernel, "compared": "bitwise" if exact else "close", "differs": bad[:5],
                  "speculated/committed": (speculated, committed), "delays": calls[0]}
    finally:
        opt.close()
        if fake is not None:
            fake.close()
    what = f"{'fake device ' if fake is not None else ''}{dtype} {kernel}"
    if fake is not None:
        result.update(device_order=fake.violations[:3], device_order_violations=len(fake.violations),
                      dropped_waits=fake.dropped, produced=fake.produced)
        assert not fake.errors(), f"{what}: the fake device's streams raised {fake.errors()[:3]}"
        assert fake.produced == sum(p.numel() > 0 for p in model.parameters()) * len(steps), (
            f"{what}: {fake.produced} gradients produced on the fake device, expected one per parameter and step")
    assert not bad, f"{what}: differs from the reference in {bad[:5]}"
    if fake is not None:
        assert not fake.violations, (f"{what}: {len(fake.violations)} copies not in device order, first: "
                                     f"{fake.violations[0]}")
    assert calls[0] == len(model) * len(steps), f"{what}: {calls[0]} delays, expected one per layer and step"
    assert speculated > 0 and committed == speculated, (
        f"{what}: {committed} of {speculated} early chunks committed in the last step: "
        "what a chunk consumed was not the final gradient")
    return result


def check_data_edits(device: str) -> dict[str, Any]:
    """Weights edited through ``.data`` (WGAN's ``p.data.clamp_()``: no version counter the optimizer
    sees), after ``step()`` and once between backward and ``step()``: bitwise the same loop with the
    edit made under ``no_grad`` (which the version counters show), bf16 and fp16, overlap off and
    on. On CUDA the device checksums of the written weights find it (``offload.state._device_edits``),
    on the host the kernel's comparison."""
    from offload import CPUOffloadAdamW, OffloadSettings

    out: dict[str, Any] = {}
    for dtype in (torch.bfloat16, torch.float16):
        for overlap in (False, True):
            models = []
            for how in ("no_grad", "data"):
                model = _model(device, dtype)
                opt = CPUOffloadAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, overlap_backward=overlap,
                                      settings=OffloadSettings(threads=2, chunk_numel=1 << 15))

                def clamp(model: nn.Module = model, how: str = how) -> None:
                    for p in model.parameters():
                        if how == "data":
                            p.data.clamp_(-0.03, 0.03)
                        else:
                            with torch.no_grad():
                                p.clamp_(-0.03, 0.03)

                for step in range(5):
                    opt.zero_grad()
                    model(_batch(device, dtype, step)).float().square().mean().backward()
                    if step == 3:
                        clamp()  # between backward and step(): early chunks must not be kept
                    opt.step()
                    clamp()
                models.append(model)
                opt.close()
            bad = [name for (name, a), b in zip(models[0].named_parameters(), models[1].parameters())
                   if not torch.equal(a.detach().cpu().view(torch.int16), b.detach().cpu().view(torch.int16))]
            out[f"{dtype}-overlap={overlap}"] = {"differs": bad[:5]}
            assert not bad, f"{dtype} overlap={overlap}: a .data edit was lost in {bad[:5]}"
    return out


def check_syncs(device: str) -> dict[str, Any]:
    """Host-device syncs during an overlapped backward (expected none: hooks only enqueue, also
    with the lr a CUDA tensor) and during ``opt.clip_grad_norm_`` (counted), with
    ``torch.cuda.set_sync_debug_mode("warn")``; the early chunks then commit."""
    if device != "cuda":
        return {"skipped": "sync counting needs a CUDA device"}
    pair = _pair(device, torch.bfloat16)
    for _, o in pair:  # a CUDA-tensor lr: each launch copies it without waiting (issue 24)
        o.param_groups[0]["lr"] = torch.tensor(1e-3, device=device)
    _train(pair, device, torch.bfloat16, range(2))
    model, opt = pair[1]
    opt.zero_grad()
    loss = model(_batch(device, torch.bfloat16, 9)).float().square().mean()
    torch.cuda.synchronize()
    counts, norm = {}, 0.0
    for phase in ("backward", "clip"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                if phase == "backward":
                    loss.backward()
                else:
                    norm = float(opt.clip_grad_norm_(1.0))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[phase] = sum("synchroniz" in str(w.message) for w in caught)
    opt.step()
    assert counts["backward"] == 0, f"{counts['backward']} host-device syncs during an overlapped backward"
    # The lr each chunk copied at launch is the step's: they commit, unless the clip clipped.
    stats = opt.last_stats
    expected = stats.speculated_chunks if norm <= 1.0 else 0
    assert stats.speculated_chunks > 0 and stats.committed_chunks == expected, (
        stats.committed_chunks, stats.speculated_chunks, norm)
    return {"syncs": counts, "lr": "a CUDA tensor", "committed": stats.committed_chunks}


def check_scaler(device: str) -> dict[str, Any]:
    """GradScaler with fp16 autocast and overflow steps (an inf in the loss): overlap on and off
    give the same parameters and the same scale."""
    if device != "cuda":
        return {"skipped": "fp16 autocast with GradScaler is the CUDA loop"}
    out = []
    for model, opt in _pair(device, torch.float32):
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12)
        for step in range(8):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(_batch(device, torch.float32, step)).float().square().mean()
            if step in (3, 5):
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        out.append((model, opt, scaler.get_scale()))
    bad = _differs([(m, o) for m, o, _ in out])
    assert not bad and out[0][2] == out[1][2], f"GradScaler: differs in {bad[:5]}, scales {out[0][2]} / {out[1][2]}"
    return {"scale": out[0][2]}


def check_memory(device: str) -> dict[str, Any]:
    """Peak device memory beyond the gradients during an overlapped backward, a clip and a step of
    one 256M-element fp32 parameter: the checksums and the norm take O(chunk), never O(tensor)."""
    if device != "cuda":
        return {"skipped": "device memory needs a CUDA device"}
    from offload import CPUOffloadAdamW, OffloadSettings

    n = 256 << 20
    p = nn.Parameter(torch.randn(n, device=device) * 1e-3)
    x = torch.randn(n, device=device)
    opt = CPUOffloadAdamW([p], lr=1e-4, overlap_backward=True, settings=OffloadSettings(threads=os.cpu_count() or 2))
    extra = []
    for _ in range(3):
        opt.zero_grad()
        loss = (p * x).sum()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated() + 4 * n  # the gradient about to exist
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        torch.cuda.synchronize()
        extra.append(torch.cuda.max_memory_allocated() - base)
    limit = 256 << 20
    assert max(extra) <= limit, f"{max(extra) / 2**20:.0f} MiB beyond the gradient (limit {limit >> 20})"
    return {"extra_MiB": [round(e / 2**20, 1) for e in extra]}


def check_timing(device: str) -> dict[str, Any]:
    """A ~1B bf16 model (16 x Linear(8192, 8192)) on the GPU: backward, exposed step and
    iteration, overlap off and on (3 iterations each after 2), and the step's stage times. The
    model is made once, on the device (made on the host and moved it cost ~40 s per arm), and
    its first weights are put back for the second arm."""
    if device != "cuda":
        return {"skipped": "the 1B timing is a GPU measurement"}
    from offload import CPUOffloadAdamW, OffloadSettings

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = nn.Sequential(*[nn.Linear(8192, 8192, bias=False, device=device, dtype=torch.bfloat16)
                            for _ in range(16)])
    first = [p.detach().clone() for p in model.parameters()]
    out: dict[str, Any] = {"model_s": round(time.perf_counter() - t0, 2)}
    x = torch.randn(16, 8192, device=device, dtype=torch.bfloat16)
    for overlap in (False, True):
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, w in zip(model.parameters(), first):
                p.copy_(w)
        t0 = time.perf_counter()
        opt = CPUOffloadAdamW(model.parameters(), lr=1e-5, overlap_backward=overlap,
                              settings=OffloadSettings(threads=os.cpu_count() or 2))
        made_s = time.perf_counter() - t0
        rows = []
        for it in range(5):
            opt.zero_grad()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(x).float().square().mean().backward()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            opt.step()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if it >= 2:  # (a timing loop: synchronized anyway)
                s = opt.last_stats
                rows.append({"backward_s": t1 - t0, "step_s": t2 - t1, "d2h_s": s.d2h_s,
                             "kernel_s": s.adam_kernel_s, "materialize_s": s.materialize_s})
        arm = {k: round(sorted(r[k] for r in rows)[1], 4) for k in rows[0]}
        out["on" if overlap else "off"] = {**arm, "optimizer_s": round(made_s, 2), "kernel": opt.settings.kernel}
        opt.close()
        del opt
        gc.collect()
    del model, first
    torch.cuda.empty_cache()
    return out


def check_dist(device: str) -> dict[str, Any]:
    """Under torchrun (one process is enough): FSDP2 with overlap, and DDP with ``attach_ddp``,
    each bitwise the same loop with overlap off (NCCL on CUDA, gloo on the CPU); then DDP with
    ``gradient_as_bucket_view=True`` and DDP accumulating 3 micro-batches under ``no_sync()`` and
    ``opt.accumulating()``, each bitwise overlap off and the independent reference, every early
    chunk of the last step committed (``bench.device_checks._layouts.dist_layouts``)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from offload import CPUOffloadAdamW, OffloadSettings

    if "RANK" not in os.environ:
        return {"skipped": "run under torchrun (python -m torch.distributed.run --nproc-per-node 1 ...)"}
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    out: dict[str, Any] = {}
    try:
        for kind in ("fsdp2", "ddp"):
            runs = []
            for overlap in (False, True):
                model = _model(device, torch.float32)
                if kind == "fsdp2":
                    for layer in model:
                        fully_shard(layer)
                    fully_shard(model)
                    wrapped = model
                else:
                    wrapped = DDP(model)
                opt = CPUOffloadAdamW(model.parameters(), lr=1e-3, overlap_backward=overlap,
                                      settings=OffloadSettings(threads=2, chunk_numel=1 << 15))
                if kind == "ddp" and overlap:
                    opt.attach_ddp(wrapped)
                for step in range(5):
                    opt.zero_grad()
                    wrapped(_batch(device, torch.float32, step)).square().mean().backward()
                    opt.step()
                runs.append(([p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()],
                             opt.last_stats.committed_chunks))
                opt.close()
            bad = [i for i, (a, b) in enumerate(zip(runs[0][0], runs[1][0])) if not torch.equal(a, b)]
            out[kind] = {"differs": bad, "committed_last_step": runs[1][1]}
            assert not bad, f"{kind}: overlap differs from overlap off in params {bad}"
        for kind in ("ddp-bucket-view", "ddp-accumulate"):  # also against the reference (bench.device_checks._layouts)
            out[kind] = dist_layouts(device, kind)
    finally:
        if started:
            dist.destroy_process_group()
    return out


#: name -> check (its docstring says what it asserts); ``prebuild`` first, before anything timed.
CHECKS: dict[str, Callable[[str], dict[str, Any]]] = {
    "prebuild": check_prebuild,
    "races": check_races,
    "producer": check_producer,
    "commits": check_commits,
    "data_edits": check_data_edits,
    "layouts": check_layouts,
    "syncs": check_syncs,
    "scaler": check_scaler,
    "memory": check_memory,
    "timing": check_timing,
    "dist": check_dist,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.device_checks", description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help=f"checks to run (default: all): {', '.join(CHECKS)}")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--list", action="store_true", help="print each check's name and what it asserts")
    parser.add_argument("--watchdog-s", type=float, default=WATCHDOG_S,
                        help="dump every thread's stack to stderr when a check runs longer (0: never; "
                             "default %(default)s)")
    args = parser.parse_args(argv)
    if args.list:
        for name, fn in CHECKS.items():
            print(f"{name}: {' '.join((fn.__doc__ or '').split())}")
        return 0
    unknown = [n for n in args.names if n not in CHECKS]
    if unknown:
        parser.error(f"unknown check(s) {unknown}: expected some of {list(CHECKS)}")
    if args.watchdog_s < 0:
        parser.error(f"--watchdog-s {args.watchdog_s:g}: expected seconds >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    failed = 0
    for name in args.names or list(CHECKS):
        result = run_check(name, CHECKS[name], args.device, watchdog_s=args.watchdog_s)
        failed += not result["ok"]
        print(json.dumps(result, default=str), flush=True)
    return 1 if failed else 0
