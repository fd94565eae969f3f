"""How close the offloaded AdamW step gets to the machine's memory bandwidth.

    python -m bench.membus.bandwidth                      # 50M-parameter model, fp32 and bf16
    python -m bench.membus.bandwidth --dtypes fp32 --threads 1,2 --chunks 1048576,4194304
    python -m bench.membus.bandwidth --quick --out-dir /tmp/bw   # tiny model, seconds (CI)

For every dtype, thread count and chunk size it times ``CPUOffloadAdamW.step()`` on a GPT
model's parameters (synthetic gradients, no forward/backward) and reports:

* ``adam_kernel`` effective bandwidth: 28 B per parameter (fp32 reads of param, grad, exp_avg,
  exp_avg_sq = 16 B; writes of param, exp_avg, exp_avg_sq = 12 B) over the stage's time;
* the whole step's effective bandwidth over ``step_s``, counting the bytes the step must move.
  fp32 on the CPU (either kernel): the parameter is its own master and the kernel reads the
  gradient in place, so the step is the kernel's 28 B and nothing else. bf16 with the native
  kernel ("fused-mp", the default "auto" where verified): one pass, bf16 gradient read (2 B),
  master and moments read and written (24 B), bf16 parameter written (2 B), 28 B. bf16 with
  ``--kernel torch``: the kernel's 28 B plus the gradient upcast (2 + 4 B) and the materialize
  copy (4 + 2 B), 40 B. On CUDA the copies of the model-dtype tensors add their bytes (fp32: 44 B).
  Write-allocate reads of the copies' destinations are not counted;
* host bytes per parameter: the RSS growth from constructing the optimizer and running its first
  step (its slabs and buffers; after a tiny warm-up optimizer took the process's one-time costs),
  next to the same figure for ``torch.optim.AdamW(fused=True)`` on
  the same parameters, measured after it in the same process;
* in the same run, interleaved with the optimizer (probe, optimizer point, probe, ...), the
  read-4/write-3 streaming probes of :mod:`bench.membus._stream` over buffers as large as the slabs, at
  the same thread count, and the ratio adam_kernel GB/s / probe GB/s (the best probe variant at
  that thread count, so the ratio is never flattered by a weak probe).

Results go to ``<out-dir>/<name>.json`` and ``<out-dir>/<name>.md``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from bench._args import int_list, thread_list
from bench._cli import bench_entry
from bench._stats import atomic_write_json, atomic_write_text, iqr, machine_info, median
from bench.membus._harness import add_output, command, new_parser
from bench.membus._stream import PROBE_BYTES_PER_ELEMENT, ProbeBuffers, c_kernel_status
from bench.train.model import GPT, PRESETS, preset

logger = logging.getLogger("bench.membus.bandwidth")

__all__ = ["build_parser", "main", "run", "ADAM_BYTES_PER_PARAM", "judge", "step_bytes_per_param"]

#: fp32 AdamW: read param, grad, exp_avg, exp_avg_sq (16 B), write param, exp_avg, exp_avg_sq (12 B).
ADAM_BYTES_PER_PARAM = 28
#: Target: adam_kernel GB/s at least this fraction of the probe's at its best thread count (both move
#: 28 B per element; what the kernel loses on top is its arithmetic and chunking).
TARGET_RATIO = 0.9
#: Target: the whole step at most this multiple of its kernel stage (the rest is pipeline overhead).
TARGET_STEP_OVER_KERNEL = 1.1
#: The kernel moves the probe's bytes and does AdamW's arithmetic on top, so it cannot beat the
#: streaming probe: a kernel/probe ratio above this says the machine's bandwidth swung between the
#: interleaved measurements (another process, frequency changes), not that the target was met.
PROBE_CEILING = 1.0
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_STAGES = ("step_s", "d2h_s", "adam_kernel_s", "materialize_s", "drain_s")
_MIN_FULL_PARAMS = 50_000_000
_QUICK_CHUNKS = (1 << 12, 1 << 14)
_DEFAULT_CHUNKS = (1 << 20, 1 << 22, 1 << 24)


def step_bytes_per_param(dtype: str, kernel: str = "torch", device: str = "cpu") -> dict[str, int]:
    """Bytes per parameter the whole step moves, by stage, for a model in ``dtype`` on ``device``."""
    size = torch.empty((), dtype=_DTYPES[dtype]).element_size()
    if dtype == "fp32" and device == "cpu":  # in place: the parameter is its own master
        return {"d2h": 0, "adam_kernel": ADAM_BYTES_PER_PARAM, "materialize": 0, "total": ADAM_BYTES_PER_PARAM}
    if kernel == "fused-mp" and dtype != "fp32":
        # One pass: grad read (size) + master/moments read and written (24) + param written (size).
        return {"d2h": 0, "adam_kernel": 24 + 2 * size, "materialize": 0, "total": 24 + 2 * size}
    return {"d2h": size + 4, "adam_kernel": ADAM_BYTES_PER_PARAM, "materialize": 4 + size,
            "total": size + 4 + ADAM_BYTES_PER_PARAM + 4 + size}


def judge(ratio: float, step_over_kernel: float, *, quick: bool) -> dict[str, Any]:
    """The headline's verdicts: ``verdict`` ("met", "not met", "noisy" or "smoke run") and
    ``meets_target`` / ``meets_step_target`` (None where not judged). A ``--quick`` run's tiny
    model and few rounds show that the code runs, not the machine's bandwidth: nothing is judged.
    A ratio above :data:`PROBE_CEILING` is a noisy measurement: judged neither way."""
    if quick:
        return {"verdict": "smoke run", "meets_target": None, "meets_step_target": None}
    meets_step = step_over_kernel <= TARGET_STEP_OVER_KERNEL
    if ratio > PROBE_CEILING:
        return {"verdict": "noisy", "meets_target": None, "meets_step_target": meets_step}
    met = ratio >= TARGET_RATIO
    return {"verdict": "met" if met else "not met", "meets_target": met, "meets_step_target": meets_step}


def verdict_text(headline: dict[str, Any]) -> str:
    """The headline's kernel/probe verdict in words (results without ``verdict``: from ``meets_target``)."""
    verdict = headline.get("verdict") or ("met" if headline["meets_target"] else "not met")
    if verdict == "smoke run":
        return "not judged: --quick is a smoke run (tiny model, few rounds), not a measurement of the machine"
    if verdict == "noisy":
        return (f"not judged: above {PROBE_CEILING:g}, and a kernel cannot beat the streaming probe: the "
                "bandwidth moved during the run; re-measure (more --repeats, an idle machine)")
    return f"target {headline['target']}: {'met' if verdict == 'met' else 'NOT met'}"


def _str_list(choices: Sequence[str]):
    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        bad = [v for v in values if v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of {list(choices)}")
        return values

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("bandwidth", __doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=_str_list(sorted(PRESETS)), default=None,
                   help="model presets, comma-separated (default 50m; tiny with --quick)")
    p.add_argument("--dtypes", type=_str_list(sorted(_DTYPES)), default=["fp32", "bf16"],
                   help="model dtypes, comma-separated")
    p.add_argument("--threads", type=thread_list, default=None, help="thread counts (default 1..cpus)")
    p.add_argument("--chunks", type=int_list, default=None,
                   help=f"chunk sizes in elements (default {','.join(map(str, _DEFAULT_CHUNKS))}; "
                        f"{','.join(map(str, _QUICK_CHUNKS))} with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 5; 2 with --quick)")
    p.add_argument("--steps", type=int, default=None,
                   help="measured steps per point and round, after one discarded (default 2; 1 with --quick)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model lives")
    p.add_argument("--kernel", choices=("auto", "torch", "fused-mp"), default="auto",
                   help="CPU AdamW kernel (fused-mp: the native single-pass kernel; auto: it where "
                        "verified bitwise and built, else torch)")
    p.add_argument("--quick", action="store_true", help="tiny model, small chunks, 2 rounds: a smoke run")
    p.add_argument("--allow-small", action="store_true", help="accept models under 50M parameters")
    add_output(p, None, "result file stem (default bandwidth or bandwidth-quick)")
    p.add_argument("--note", default="", help="free text stored with the result (e.g. machine load)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="logging level (stderr)")
    return p


def _resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    args.sizes = args.sizes or (["tiny"] if args.quick else ["50m"])
    args.threads = args.threads or list(range(1, cpus + 1))
    args.chunks = args.chunks or list(_QUICK_CHUNKS if args.quick else _DEFAULT_CHUNKS)
    args.repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    args.steps = args.steps if args.steps is not None else (1 if args.quick else 2)
    args.name = args.name or ("bandwidth-quick" if args.quick else "bandwidth")
    if args.repeats < 1 or args.steps < 1:
        p.error(f"--repeats {args.repeats} / --steps {args.steps}: expected integers >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch reports no CUDA device here")
    if not (args.quick or args.allow_small):
        small = [s for s in args.sizes if preset(s).num_params < _MIN_FULL_PARAMS]
        if small:
            p.error(f"--sizes {','.join(small)}: under {_MIN_FULL_PARAMS:,} parameters; the benchmark "
                    "needs slabs far larger than the caches (use --allow-small or --quick)")
    return args


def _rss() -> int:
    """Resident set size of this process, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _warm_up(make: Any) -> None:
    """One tiny optimizer's construction and step: the one-time costs of a process (lazy imports,
    libraries mapped: ~45 MB on the first ``torch.optim.Optimizer``) stay out of the bytes/param."""
    p = torch.zeros(64, requires_grad=True)
    p.grad = torch.zeros(64)
    opt = make([p])
    opt.step()
    getattr(opt, "close", lambda: None)()


_TORCH_RSS_SCRIPT = """
import sys, torch
from bench.membus.bandwidth import _DTYPES, _rss, _warm_up
from bench.train.model import GPT, preset
_warm_up(lambda ps: torch.optim.AdamW(ps, fused=True))
model = GPT(preset(sys.argv[1])).to(dtype=_DTYPES[sys.argv[2]])
params = list(model.parameters())
for p in params:
    p.grad = torch.randn(p.shape).mul_(1e-2).to(p.dtype)
before = _rss()
opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
opt.step()
print((_rss() - before) / sum(p.numel() for p in params))
"""


def _torch_adamw_host_bytes(size: str, dtype: str) -> float | None:
    """RSS growth per parameter of ``torch.optim.AdamW(fused=True)``'s construction and first step
    on the same model, in a fresh process (in this one, pages freed by the offloaded optimizer
    would be reused and hide part of it)."""
    import subprocess

    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        out = subprocess.run([sys.executable, "-c", _TORCH_RSS_SCRIPT, size, dtype], env=env,
                             capture_output=True, text=True, timeout=600, check=True)
        return float(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        logger.warning("torch AdamW host bytes not measured: %s", exc)
        return None


def _summary(samples: Sequence[float]) -> dict[str, Any]:
    return {"median": median(samples), "iqr": iqr(samples), "n": len(samples), "samples": list(samples)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bench_one(size: str, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    from offload import CPUOffloadAdamW, OffloadSettings

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(preset(size)).to(device=device, dtype=_DTYPES[dtype])
    params = [p for p in model.parameters()]
    numel = sum(p.numel() for p in params)
    gen = torch.Generator(device=device).manual_seed(1)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen, device=device) * 1e-2).to(p.dtype)
    logger.info("%s %s: %s parameters", size, dtype, f"{numel:,}")
    _warm_up(lambda ps: CPUOffloadAdamW(ps, settings=OffloadSettings(threads=1, kernel=args.kernel)))
    rss0 = _rss()
    opt = CPUOffloadAdamW(params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                          settings=OffloadSettings(threads=args.threads[0], chunk_numel=args.chunks[0],
                                                   kernel=args.kernel))
    opt.step()  # allocates the host state; not measured
    host_bytes = (_rss() - rss0) / numel
    probes = ProbeBuffers(numel)
    for name in probes.probes:  # first touch of the probe buffers' pages, not measured
        probes.run(name, args.threads[-1])

    stage_samples: dict[tuple[int, int], dict[str, list[float]]] = {}
    num_chunks: dict[tuple[int, int], int] = {}
    probe_samples: dict[tuple[int, str], list[float]] = {}
    kernels_ran: set[str] = set()
    for rnd in range(args.repeats):
        # Alternate the sweep direction so slow drift of the machine does not favour one end.
        order = args.threads if rnd % 2 == 0 else list(reversed(args.threads))
        for threads in order:
            for chunk in args.chunks:
                for name in probes.probes:  # A: the probe at this thread count
                    s = probes.run(name, threads)
                    probe_samples.setdefault((threads, name), []).append(s.gbps)
                # B: the optimizer at this point (one discarded step after the change)
                opt.apply_settings(OffloadSettings(threads=threads, chunk_numel=chunk, kernel=args.kernel))
                opt.step()
                _sync(device)
                rows = stage_samples.setdefault((threads, chunk), {k: [] for k in (*_STAGES, "wall_s")})
                for _ in range(args.steps):
                    _sync(device)
                    t0 = time.perf_counter()
                    opt.step()
                    _sync(device)
                    rows["wall_s"].append(time.perf_counter() - t0)
                    st = opt.last_stats
                    for k in _STAGES:
                        rows[k].append(float(getattr(st, k)))
                    num_chunks[(threads, chunk)] = int(st.num_chunks)
                    kernels_ran.add(st.kernel)
                    if st.threads != threads or st.chunk_numel != chunk:
                        logger.warning("asked for threads=%d chunk_numel=%d, the step ran threads=%d "
                                       "chunk_numel=%d", threads, chunk, st.threads, st.chunk_numel)
        logger.info("%s %s: round %d/%d done", size, dtype, rnd + 1, args.repeats)

    kernel = "fused-mp" if kernels_ran == {"fused-mp"} else "torch"
    if kernel != args.kernel and args.kernel != "auto":
        logger.warning("asked for kernel=%s, the steps ran %s", args.kernel, sorted(kernels_ran))
    step_bytes = step_bytes_per_param(dtype, kernel, args.device)
    points = []
    for (threads, chunk), rows in sorted(stage_samples.items()):
        adam_gbps = [step_bytes["adam_kernel"] * numel / t / 1e9 for t in rows["adam_kernel_s"] if t > 0]
        step_gbps = [step_bytes["total"] * numel / t / 1e9 for t in rows["step_s"] if t > 0]
        points.append({
            "threads": threads, "chunk_numel": chunk, "num_chunks": num_chunks[(threads, chunk)],
            **{k: _summary(v) for k, v in rows.items()},
            "adam_gbps": _summary(adam_gbps), "step_gbps": _summary(step_gbps),
        })
    probe_rows = [{"threads": t, "probe": name, "gbps": _summary(v)} for (t, name), v in sorted(probe_samples.items())]

    per_thread = []
    for threads in args.threads:
        mine = [pt for pt in points if pt["threads"] == threads]
        best_pt = max(mine, key=lambda pt: pt["adam_gbps"]["median"])
        probes_t = [r for r in probe_rows if r["threads"] == threads]
        best_probe = max(probes_t, key=lambda r: r["gbps"]["median"])
        per_thread.append({
            "threads": threads,
            "best_chunk_numel": best_pt["chunk_numel"],
            "adam_gbps": best_pt["adam_gbps"]["median"],
            "step_gbps": best_pt["step_gbps"]["median"],
            "step_s": best_pt["step_s"]["median"],
            "adam_kernel_s": best_pt["adam_kernel_s"]["median"],
            "step_over_kernel": best_pt["step_s"]["median"] / best_pt["adam_kernel_s"]["median"],
            "probe": best_probe["probe"],
            "probe_gbps": best_probe["gbps"]["median"],
            "ratio": best_pt["adam_gbps"]["median"] / best_probe["gbps"]["median"],
            "ratio_by_probe": {r["probe"]: best_pt["adam_gbps"]["median"] / r["gbps"]["median"] for r in probes_t},
        })
    top = max(per_thread, key=lambda r: r["probe_gbps"])
    fastest = min(points, key=lambda pt: pt["step_s"]["median"])
    headline = {
        "probe_best_threads": top["threads"], "probe": top["probe"], "probe_gbps": top["probe_gbps"],
        "adam_gbps": top["adam_gbps"], "ratio": top["ratio"], "target": TARGET_RATIO,
        "step_over_kernel": top["step_over_kernel"], "step_target": TARGET_STEP_OVER_KERNEL,
        **judge(top["ratio"], top["step_over_kernel"], quick=args.quick),
        "fastest_step": {"threads": fastest["threads"], "chunk_numel": fastest["chunk_numel"],
                         "step_s": fastest["step_s"]["median"], "step_gbps": fastest["step_gbps"]["median"]},
    }
    del opt, probes
    # (not in --quick runs: a second process costs CI seconds for a figure a tiny model blurs)
    torch_bytes = _torch_adamw_host_bytes(size, dtype) if args.device == "cpu" and not args.quick else None
    del model, params
    return {"model_size": size, "dtype": dtype, "params": numel, "device": args.device, "kernel": kernel,
            "host_bytes_per_param": host_bytes, "torch_adamw_host_bytes_per_param": torch_bytes,
            "step_bytes_per_param": step_bytes, "points": points, "probes": probe_rows,
            "per_thread": per_thread, "headline": headline}


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    info = machine_info()
    started = time.time()
    runs = [_bench_one(size, dtype, args) for size in args.sizes for dtype in args.dtypes]
    result = {
        "benchmark": "bench.membus.bandwidth",
        "command": command("bandwidth", argv),
        "machine": info,
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "duration_s": round(time.time() - started, 1),
        "note": args.note,
        "config": {"sizes": args.sizes, "dtypes": args.dtypes, "threads": args.threads, "chunks": args.chunks,
                   "repeats": args.repeats, "steps_per_point": args.steps, "quick": args.quick,
                   "device": args.device, "kernel": args.kernel},
        "probes": {name: {"bytes_per_element": b} for name, b in PROBE_BYTES_PER_ELEMENT.items()},
        "c_probe_status": c_kernel_status(),
        "adam_bytes_per_param": ADAM_BYTES_PER_PARAM,
        "target_ratio": TARGET_RATIO,
        "runs": runs,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = atomic_write_json(args.out_dir / f"{args.name}.json", result)
    md_path = atomic_write_text(args.out_dir / f"{args.name}.md", render_markdown(result))
    print(render_text(result), flush=True)
    print(f"wrote {json_path} and {md_path}", flush=True)
    return result


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def _bytes(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _noisy_mark(ratio: float) -> str:
    return f" (above {PROBE_CEILING:g}: noisy)" if ratio > PROBE_CEILING else ""


def _step_verdict(h: dict[str, Any]) -> str:
    if h.get("meets_step_target") is None:
        return "not judged"
    return "met" if h["meets_step_target"] else "not met"


def render_text(result: dict[str, Any]) -> str:
    lines = []
    for r in result["runs"]:
        lines.append(f"== {r['model_size']} {r['dtype']} ({r['kernel']}): {r['params']:,} params, step counts "
                     f"{r['step_bytes_per_param']['total']} B/param, adam_kernel {ADAM_BYTES_PER_PARAM} B/param; "
                     f"host {_bytes(r.get('host_bytes_per_param'))} B/param (torch AdamW "
                     f"{_bytes(r.get('torch_adamw_host_bytes_per_param'))})")
        lines.append(f"{'threads':>7} {'chunk':>9} {'step ms':>9} {'iqr':>6} {'d2h':>7} {'adam':>7} {'mat':>7} "
                     f"{'drain':>7} {'adamGB/s':>9} {'stepGB/s':>9}")
        for pt in r["points"]:
            lines.append(
                f"{pt['threads']:>7} {pt['chunk_numel']:>9} {_ms(pt['step_s']['median']):>9} "
                f"{_ms(pt['step_s']['iqr']):>6} {_ms(pt['d2h_s']['median']):>7} "
                f"{_ms(pt['adam_kernel_s']['median']):>7} {_ms(pt['materialize_s']['median']):>7} "
                f"{_ms(pt['drain_s']['median']):>7} {pt['adam_gbps']['median']:>9.2f} {pt['step_gbps']['median']:>9.2f}")
        for pr in r["probes"]:
            lines.append(f"  probe {pr['probe']:<12} threads {pr['threads']:>3}: {pr['gbps']['median']:.2f} GB/s "
                         f"(IQR {pr['gbps']['iqr']:.2f}, n={pr['gbps']['n']})")
        for pt in r["per_thread"]:
            lines.append(f"  threads {pt['threads']:>3}: adam_kernel {pt['adam_gbps']:.2f} GB/s (chunk "
                         f"{pt['best_chunk_numel']}) / probe {pt['probe']} {pt['probe_gbps']:.2f} GB/s = "
                         f"ratio {pt['ratio']:.3f}{_noisy_mark(pt['ratio'])}; "
                         f"step/kernel {pt['step_over_kernel']:.3f}")
        h = r["headline"]
        lines.append(f"  headline: at the probe's best thread count ({h['probe_best_threads']}) adam_kernel/probe = "
                     f"{h['ratio']:.3f} ({verdict_text(h)})")
    return "\n".join(lines)


def render_markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    out = [
        "# Offloaded AdamW step vs. memory bandwidth",
        "",
        f"- command: `{result['command']}`",
        f"- date (UTC): {m['date_utc']}; duration {result['duration_s']} s",
        f"- CPU: {m['cpu_model']}; {m['physical_cores']} physical cores, {m['logical_cpus']} logical, "
        f"{m['affinity_cpus']} in the affinity mask; {m['memory_gib']} GiB; {m['torch_cpu_capability']}",
        f"- torch {m['torch']} ({m['torch_parallel_backend']}); Python {m['python']}; {m['platform']}",
        f"- load average (1/5/15 min) before: {m['load_avg_1_5_15']}, after: {result['load_avg_after']}",
        f"- C probe: {result['c_probe_status']}",
    ]
    if result["note"]:
        out.append(f"- note: {result['note']}")
    out += [
        "",
        f"adam_kernel GB/s counts {ADAM_BYTES_PER_PARAM} B per parameter (read param, grad, exp_avg, "
        "exp_avg_sq; write param, exp_avg, exp_avg_sq, all fp32). Step GB/s counts the bytes the step "
        "must move (see `bench/membus/bandwidth.py`: 28 B for fp32 on the CPU and for bf16 on the native "
        "kernel; 40 B for bf16 on the torch kernel, whose upcast and materialize copies add 12 B). "
        "Probe bytes per element: " + ", ".join(f"`{k}` {v['bytes_per_element']} B"
                                               for k, v in result["probes"].items())
        + " (see `bench/membus/_stream.py`). Probe and optimizer measurements alternate in one run; "
        "values are medians over rounds, IQR in parentheses. The ratio uses the best probe at each "
        "thread count.",
    ]
    for r in result["runs"]:
        h = r["headline"]
        out += [
            "",
            f"## {r['model_size']} ({r['params']:,} parameters), {r['dtype']}",
            "",
            f"**adam_kernel / probe at the probe's best thread count ({h['probe_best_threads']}): "
            f"{h['ratio']:.3f}** ({verdict_text(h)}); "
            f"step/kernel there **{h['step_over_kernel']:.3f}** (target <= {h['step_target']}: "
            f"{_step_verdict(h)}). "
            f"Fastest step: threads {h['fastest_step']['threads']}, chunk {h['fastest_step']['chunk_numel']}, "
            f"{_ms(h['fastest_step']['step_s'])} ms ({h['fastest_step']['step_gbps']:.2f} GB/s at "
            f"{r['step_bytes_per_param']['total']} B/param).",
            "",
            f"Host bytes/param (RSS growth of construction + first step): "
            f"{_bytes(r.get('host_bytes_per_param'))}; torch.optim.AdamW(fused=True) on the same "
            f"parameters: {_bytes(r.get('torch_adamw_host_bytes_per_param'))}. Kernel: {r['kernel']}.",
            "",
            "| threads | best chunk | kernel GB/s | step GB/s | probe | probe GB/s | kernel/probe | step/kernel "
            "| step ms | host B/param |",
            "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
        ]
        for pt in r["per_thread"]:
            out.append(f"| {pt['threads']} | {pt['best_chunk_numel']} | {pt['adam_gbps']:.2f} | {pt['step_gbps']:.2f} | "
                       f"{pt['probe']} | {pt['probe_gbps']:.2f} | "
                       f"{pt['ratio']:.3f}{_noisy_mark(pt['ratio'])} | "
                       f"{pt.get('step_over_kernel', float('nan')):.3f} | {_ms(pt['step_s'])} | "
                       f"{_bytes(r.get('host_bytes_per_param'))} |")
        out += ["", "| threads | chunk | chunks | step ms | d2h ms | adam_kernel ms | materialize ms | drain ms "
                "| adam GB/s | step GB/s |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for pt in r["points"]:
            out.append(
                f"| {pt['threads']} | {pt['chunk_numel']} | {pt['num_chunks']} | {_ms(pt['step_s']['median'])} "
                f"({_ms(pt['step_s']['iqr'])}) | {_ms(pt['d2h_s']['median'])} | {_ms(pt['adam_kernel_s']['median'])} "
                f"({_ms(pt['adam_kernel_s']['iqr'])}) | {_ms(pt['materialize_s']['median'])} | "
                f"{_ms(pt['drain_s']['median'])} | {pt['adam_gbps']['median']:.2f} | {pt['step_gbps']['median']:.2f} |")
        out += ["", "| threads | probe | GB/s | IQR | n |", "|---:|---|---:|---:|---:|"]
        for pr in r["probes"]:
            g = pr["gbps"]
            out.append(f"| {pr['threads']} | {pr['probe']} | {g['median']:.2f} | {g['iqr']:.2f} | {g['n']} |")
    return "\n".join(out) + "\n"


main = bench_entry(build_parser=build_parser, run=run, resolve=_resolve)


if __name__ == "__main__":
    sys.exit(main())
