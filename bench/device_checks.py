"""The GPU checks of ``bench/device_check.sh``: races, commits, syncs, GradScaler, memory, timing.

    python -m bench.device_checks --list                          # the checks and what each asserts
    python -m bench.device_checks --device cuda races commits     # some of them, on the GPU
    python -m bench.device_checks --device cpu races commits      # the same assertions on the host
    torchrun --nproc-per-node 1 -m bench.device_checks --device cuda dist

Each check prints one JSON line (its name, ``ok``, what it measured) and the command exits 1 if any
check failed. Every check compares ``overlap_backward=True`` with ``False`` on the same loop,
bitwise, or asserts a count; they run on ``--device cpu`` too (without the GPU-only parts: sleeps
on the stream, sync counting, device memory), which is how CI checks the checks themselves
(``tests/test_device_checks.py``). Written before a GPU was lent to this project: the CUDA parts
are reviewed, not yet run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["CHECKS", "main"]

_SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time: long enough for a side stream to run ahead


def _model(device: str, dtype: torch.dtype, *, width: int = 256, layers: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device=device, dtype=dtype)


def _pair(device: str, dtype: torch.dtype, *, device_ops: Any = None, **kwargs: Any) -> list[tuple[nn.Module, Any]]:
    """(model, optimizer) with overlap off, then on; the same weights; small chunks (several per
    model, so some start during backward); ``device_ops``: the overlapped optimizer's."""
    from offload import CPUOffloadAdamW, OffloadSettings

    out = []
    for overlap in (False, True):
        model = _model(device, dtype, **kwargs)
        opt = CPUOffloadAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, overlap_backward=overlap,
                              settings=OffloadSettings(threads=2, chunk_numel=1 << 15),
                              device_ops=device_ops if overlap else None)
        out.append((model, opt))
    return out


class _SlowCopies:
    """The real CUDA device ops with a GPU sleep queued on the copy stream before each chunk's
    copies: a copy engine that falls behind, so a chunk's gradients come down long after its
    launch, while the loop goes on changing them."""

    def __init__(self, ops: Any) -> None:
        self._ops = ops

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)

    def copies(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: Any, **kwargs: Any) -> None:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(_SLEEP_CYCLES // 4)
        self._ops.copies(dsts, srcs, stream, **kwargs)


class _CpuLoad:
    """Two threads of CPU matrix products (GIL released) for the block: the optimizer's kernels
    run slowly and late, so copies and in-place changes land around them."""

    def __enter__(self) -> _CpuLoad:
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


def _batch(device: str, dtype: torch.dtype, step: int, width: int = 256) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, width, generator=gen).to(device=device, dtype=dtype)


def _differs(pair: list[tuple[nn.Module, Any]]) -> list[str]:
    (m0, o0), (m1, o1) = pair
    bad = [f"param {i}" for i, (a, b) in enumerate(zip(m0.parameters(), m1.parameters())) if not torch.equal(a, b)]
    for key in ("exp_avg", "exp_avg_sq", "step"):
        for i, (a, b) in enumerate(zip(m0.parameters(), m1.parameters())):
            if not torch.equal(o0.state[a][key], o1.state[b][key]):
                bad.append(f"{key} {i}")
    return bad


def _sleep(device: str) -> None:
    if device == "cuda":
        torch.cuda._sleep(_SLEEP_CYCLES)


def _edit_after_backward(device: str, how: str) -> Callable[[nn.Module], None]:
    """An in-place change of the gradients after backward, queued behind a GPU sleep so that a
    copy stream that does not wait for it runs first: ``half`` (A -> A/2), ``aba`` (A -> 2A -> A,
    the content step() sees is A again)."""

    def edit(model: nn.Module) -> None:
        with torch.no_grad():
            _sleep(device)
            for p in model.parameters():
                p.grad.mul_(0.5 if how == "half" else 2.0)
            if how == "aba":
                _sleep(device)
                for p in model.parameters():
                    p.grad.mul_(0.5)

    return edit


def _train(pair: list[tuple[nn.Module, Any]], device: str, dtype: torch.dtype, steps: Sequence[int],
           after_backward: Callable[[nn.Module], None] | None = None) -> list[tuple[int, int]]:
    """Both optimizers through ``steps``; (speculated, committed) of the overlapped one per step."""
    counts = []
    for step in steps:
        for model, opt in pair:
            opt.zero_grad()
            model(_batch(device, dtype, step)).float().square().mean().backward()
            if after_backward is not None:
                after_backward(model)
            opt.step()  # no sync before: what a training loop does
        stats = pair[1][1].last_stats
        counts.append((stats.speculated_chunks, stats.committed_chunks))
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
        from offload import TorchCudaOps

        variants["slow-copies-"] = (_SlowCopies(TorchCudaOps(torch.device(device))), nullcontext)
        variants["cpu-load-"] = (None, _CpuLoad)
    out: dict[str, Any] = {}
    for variant, (ops, load) in variants.items():
        for dtype in (torch.float32, torch.bfloat16):
            for how in ("half", "aba"):
                pair = _pair(device, dtype, device_ops=ops)
                _train(pair, device, dtype, range(2))
                with load():
                    counts = _train(pair, device, dtype, range(2, 6), after_backward=_edit_after_backward(device, how))
                bad = _differs(pair)
                out[f"{variant}{dtype}-{how}"] = {"differs": bad[:5], "speculated/committed": counts}
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
        out[str(dtype)] = {"speculated/committed": counts, "differs": bad[:5]}
        assert not bad, f"{dtype}: overlap differs from overlap off in {bad[:5]}"
        assert all(s == c and s > 0 for s, c in counts), f"{dtype}: not every started chunk committed {counts}"
    return out


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
    iteration, overlap off and on (3 iterations each after 2), and the step's stage times."""
    if device != "cuda":
        return {"skipped": "the 1B timing is a GPU measurement"}
    from offload import CPUOffloadAdamW, OffloadSettings

    out: dict[str, Any] = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(8192, 8192, bias=False) for _ in range(16)]).to(device, torch.bfloat16)
        opt = CPUOffloadAdamW(model.parameters(), lr=1e-5, overlap_backward=overlap,
                              settings=OffloadSettings(threads=os.cpu_count() or 2))
        x = torch.randn(16, 8192, device=device, dtype=torch.bfloat16)
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
            if it >= 2:
                s = opt.last_stats
                rows.append({"backward_s": t1 - t0, "step_s": t2 - t1, "d2h_s": s.d2h_s,
                             "kernel_s": s.adam_kernel_s, "materialize_s": s.materialize_s})
        out["on" if overlap else "off"] = {k: round(sorted(r[k] for r in rows)[1], 4) for k in rows[0]}
        opt.close()
        del model, opt
        torch.cuda.empty_cache()
    return out


def check_dist(device: str) -> dict[str, Any]:
    """Under torchrun (one process is enough): FSDP2 with overlap, and DDP with ``attach_ddp``,
    each bitwise the same loop with overlap off (NCCL on CUDA, gloo on the CPU)."""
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
    finally:
        if started:
            dist.destroy_process_group()
    return out


#: name -> (check, one line of what it asserts)
CHECKS: dict[str, Callable[[str], dict[str, Any]]] = {
    "races": check_races,
    "commits": check_commits,
    "data_edits": check_data_edits,
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
    args = parser.parse_args(argv)
    if args.list:
        for name, fn in CHECKS.items():
            print(f"{name}: {' '.join((fn.__doc__ or '').split())}")
        return 0
    unknown = [n for n in args.names if n not in CHECKS]
    if unknown:
        parser.error(f"unknown check(s) {unknown}: expected some of {list(CHECKS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    failed = 0
    for name in args.names or list(CHECKS):
        t0 = time.perf_counter()
        try:
            result: dict[str, Any] = {"check": name, "ok": True, **CHECKS[name](args.device)}
        except AssertionError as exc:
            failed += 1
            result = {"check": name, "ok": False, "error": str(exc)}
        result["seconds"] = round(time.perf_counter() - t0, 2)
        print(json.dumps(result, default=str), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
