"""DeepSpeed ZeRO-Offload's CPU Adam step, tuned with ``offload.tune_deepspeed`` (issue 37, item 3).

A ``deepspeed.initialize`` engine with ``DS_ACCELERATOR=cpu``: ZeRO stage 2, ``offload_optimizer``
on the CPU (``DeepSpeedCPUAdam``), bf16, gradient clipping on, two parameter groups (decay and
no-decay, as HF Trainer passes them: ZeRO steps the inner optimizer once per group). In real gloo
ranks (1 and 2) a tuned engine trains beside an untuned one of the same seed: every step the
bf16 parameters and the fp32 master partitions are bitwise equal while the tuner applies 1, 2
and 4 threads; both ranks lock in the node's optimum (the max over ranks, which neither rank
alone would pick); a second tuning of the engine hits the cache (its key names DeepSpeed's
version) with no probe steps; the trace and ``python -m autotune show`` see it. Step times come
from an injected clock, so the decision is certain. DeepSpeed's CPU Adam JIT-builds once per
session (about 50 s, and the CPU accelerator's shm op about 40 s), in the session's
``TORCH_EXTENSIONS_DIR``. ``python -m bench.deepspeed_step --quick`` runs end to end too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _client_util import require
from _dist_util import REPO_ROOT, costed_tuning, run_workers
from _forked import run_python

require("deepspeed")

pytestmark = pytest.mark.slow

#: Fake seconds of one CPU Adam call, per rank and thread count (two calls per engine step, one
#: per group). Alone, rank 0 would pick 2 threads and rank 1 would pick 4; the node's time (max
#: over ranks) is lowest at 2: 1 -> 3.0, 2 -> 1.5, 4 -> 2.0. One rank: rank 0's row.
STEPS = 28


def _engine(seed: int) -> Any:
    import deepspeed
    import torch
    from torch import nn

    torch.manual_seed(seed)
    # Odd sizes: uneven partitions and vector tails; 310k elements split over the kernel's threads.
    model = nn.Sequential(nn.Linear(300, 1031), nn.GELU(), nn.Linear(1031, 29), nn.LayerNorm(29))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=groups)
    return engine


def _train_step(engine: Any, step: int, rank: int) -> None:
    import torch

    g = torch.Generator().manual_seed(100 * step + rank)
    loss = engine(torch.randn(4, 300, generator=g).to(torch.bfloat16)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()


def _bits(engine: Any) -> list[Any]:
    masters = engine.optimizer.single_partition_of_fp32_groups
    return [t.detach().clone() for t in [*engine.module.parameters(), *masters]]


def _same(a: list[Any], b: list[Any]) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _worker(rank: int, world_size: int, *, cache_path: str, trace_dir: str, ext_dir: str) -> dict[str, Any]:
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["TORCH_EXTENSIONS_DIR"] = ext_dir
    import torch

    from offload import tune_deepspeed

    torch.set_num_threads(1)
    plan, config, clock = costed_tuning(rank, world_size, cache_path=cache_path, trace_dir=trace_dir)

    ref, engine = _engine(0), _engine(0)
    used: list[int] = []
    engine.optimizer.optimizer.register_step_pre_hook(lambda *_: used.append(torch.get_num_threads()))
    out: dict[str, Any] = {}
    for run in ("first", "second"):
        tuning = tune_deepspeed(engine, autotune=config, plan=plan, clock=clock)
        mismatches = []
        offset = 0 if run == "first" else STEPS
        for step in range(offset, offset + STEPS):
            _train_step(ref, step, rank)  # untuned: the caller's 1 thread
            _train_step(engine, step, rank)
            if not _same(_bits(engine), _bits(ref)):
                mismatches.append(step)
        summary = tuning.summary()
        out[run] = {"mismatch_steps": mismatches, "threads_used": sorted(set(used)),
                    **{k: summary[k] for k in ("state", "winner", "cache_status", "cache_hit", "probe_steps",
                                               "cache_key")}}
        used.clear()
        tuning.close()
    out["restored"] = "step" not in vars(engine.optimizer) and "step" not in vars(engine.optimizer.optimizer)
    out["threads_after"] = torch.get_num_threads()
    return out


@pytest.fixture(scope="module")
def ds_ext_dir(kernel_build_dir: Path) -> Path:
    """Build DeepSpeed's CPU Adam (and the CPU accelerator's shm op) once, before ranks race for it."""
    code = ("import torch\nfrom deepspeed.ops.adam import DeepSpeedCPUAdam\n"
            "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder\n"
            "DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])\nShareMemCommBuilder().load()\n")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(kernel_build_dir)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return kernel_build_dir


@pytest.mark.parametrize("world_size", [1, 2])
def test_zero2_offload_tuned_bitwise_agreed_and_cached(world_size: int, tmp_path: Path, ds_ext_dir: Path) -> None:
    cache, trace = tmp_path / "cache.json", tmp_path / "trace"
    results = run_workers(_worker, world_size=world_size,
                          kwargs={"cache_path": str(cache), "trace_dir": str(trace), "ext_dir": str(ds_ext_dir)},
                          timeout_s=420)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)
    # Alone, rank 0 picks 2 threads; two ranks pick the node optimum, 2, which rank 1 alone would not.
    for rank, r in enumerate(results):
        first, second = r.value["first"], r.value["second"]
        assert first["mismatch_steps"] == [] and second["mismatch_steps"] == [], (rank, r.value)
        assert first["threads_used"] == [1, 2, 4], (rank, first)  # every rung applied, still bitwise
        assert first["state"] == "locked" and first["winner"] == {"threads": 2}, (rank, first)
        assert first["cache_status"] == "miss", (rank, first)
        assert second["state"] == "locked" and second["cache_hit"] and second["probe_steps"] == 0, (rank, second)
        assert second["winner"] == {"threads": 2}, (rank, second)
        assert r.value["restored"] and r.value["threads_after"] == 1, (rank, r.value)
    keys = {r.value["first"]["cache_key"] for r in results} - {None}
    assert len(keys) == 1, keys
    assert (trace / "run-1" / "summary.json").is_file() and (trace / "run-2" / "summary.json").is_file()
    # The cache key names DeepSpeed's version; python -m autotune show lists the entry.
    from importlib.metadata import version

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    raw = subprocess.run([sys.executable, "-m", "autotune", "show", "--cache", str(cache), "--json"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert raw.returncode == 0, raw.stderr
    entry = json.loads(raw.stdout)[keys.pop()]
    assert f'"deepspeed": "{version("deepspeed")}"' in json.dumps(entry), entry
    table = subprocess.run([sys.executable, "-m", "autotune", "show", "--cache", str(cache)], env=env,
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "threads=2" in table.stdout, table.stdout


def test_refuses_what_is_not_a_zero_offload_engine(tmp_path: Path) -> None:
    """In another process (a fork: ``_forked.py``), so the ZeRO runtime tune_deepspeed imports stays
    out of the test session."""
    code = ("from offload import DeepSpeedTuningError, tune_deepspeed\n"
            "class Engine:\n    optimizer = object()\n"
            "try:\n    tune_deepspeed(Engine())\nexcept DeepSpeedTuningError as e:\n    print(e)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "DS_ACCELERATOR": "cpu"}
    proc = run_python(["-c", code], env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].startswith(
        "tune_deepspeed: engine.optimizer is object: expected DeepSpeedZeroOptimizer"), proc.stdout


def test_benchmark_runs_and_writes_its_row(tmp_path: Path, ds_ext_dir: Path) -> None:
    """``python -m bench.deepspeed_step --quick`` (bench/results/deepspeed_step.md's command, tiny):
    every arm measured, the OpenMP check ran, both files written."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "DS_ACCELERATOR": "cpu",
           "TORCH_EXTENSIONS_DIR": str(ds_ext_dir), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    proc = run_python(["-m", "bench.deepspeed_step", "--quick", "--out-dir", str(tmp_path)], env=env, timeout=420,
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "deepspeed_step.json").read_text())
    assert set(result["here"]["arms"]) == {"ds_1_thread", "ds_default", "ds_tuned", "cpu_offload_adamw"}
    assert all(a["adam"]["n"] == 3 for a in result["here"]["arms"].values())
    assert [r["set_num_threads"] for r in result["openmp"]["rows"]][0] == 1
    assert "| ds_tuned |" in (tmp_path / "deepspeed_step.md").read_text()
