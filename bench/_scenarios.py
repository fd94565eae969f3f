"""The suite's thread-count scenarios: what each row runs, how it is launched, and its statistics.

Every row is a real ``bench.train`` run, launched the way a user would launch it: ``python -m
bench.train`` for one rank, ``torchrun --standalone --nproc-per-node N`` (gloo) for more. The
thread rules of rows 1-3 are applied the only way a user can apply them, by the thread counts they
give: the trainer receives ``--threads T --compute-threads T`` (optimizer and forward/backward) and
the environment the rule implies. Row 4 passes no thread flag (the trainer's ``ThreadPlan``), row
5 ``--autotune`` with a fresh cache (first run) and again with the same cache (second run), row 6
no ``--optim-cpu-offload`` (``torch.optim.AdamW(fused=True)`` on the model's device).

One rank runs without torchrun: with a world size of 1 the trainer's step has no collective, so
the step times are the same, and torchrun's rendezvous costs ~7 s per run on this machine. Every
run gets ``OMP_NUM_THREADS=1`` (what torchrun sets for each of several ranks) except row 2.

Rows whose command line and environment are identical (on a 2-core machine with 2 ranks every
rule gives 1 thread) are measured once and share the measurement; the table says so.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from autotune.report._runs import resolve_run_dir
from bench._stats import iqr, median
from bench.train._dist import run_torchrun

logger = logging.getLogger(__name__)

__all__ = [
    "ROW_NAMES",
    "RunSpec",
    "Row",
    "STAGES",
    "ScenarioError",
    "TABLE_LABEL",
    "TABLE_ROWS",
    "TrainerConfig",
    "TrainerRun",
    "build_rows",
    "command",
    "deepspeed_note",
    "launch",
    "run_stats",
    "select_steps",
    "thread_rules",
]

REPO = Path(__file__).resolve().parents[1]

#: Table rows, in order. "5a"/"5b" are the first (fresh cache) and second (cache hit) autotuned runs.
ROW_NAMES: dict[str, str] = {
    "1": "launcher default (OMP_NUM_THREADS=1)",
    "2": "env override OMP_NUM_THREADS=cores/ranks",
    "3": "old static rule min(affinity, cpu_count // ranks)",
    "4": "ThreadPlan (static budget)",
    "5a": "autotuned, first run",
    "5b": "autotuned, second run (cache hit)",
    "6": "no offload: torch AdamW(fused=True) on the device",
}
#: Rows of the suite's scenario table, in order; 5a is reported twice (probing included / excluded).
TABLE_ROWS = ("1", "2", "3", "4", "5a-incl", "5a-excl", "5b", "6")
TABLE_LABEL = {
    "1": "1 launcher default (OMP_NUM_THREADS=1)",
    "2": "2 env override OMP_NUM_THREADS=cores/ranks",
    "3": "3 old static rule",
    "4": "4 ThreadPlan",
    "5a-incl": "5 autotuned, 1st run, probing included",
    "5a-excl": "5 autotuned, 1st run, probing excluded",
    "5b": "5 autotuned, 2nd run (cache hit)",
    "6": "6 no offload: AdamW(fused=True)",
}
#: Stage times reported per row (``StepStats`` field names).
STAGES = ("adam_kernel_s", "materialize_s", "drain_s")
#: Environment variables a parent process may have set that would change what a row runs.
_SCRUB = ("OFFLOAD_AUTOTUNE_THREADS", "OFFLOAD_AUTOTUNE_CACHE", "OMP_NUM_THREADS", "LOCAL_WORLD_SIZE",
          "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "ROLE_RANK")


class ScenarioError(RuntimeError):
    """A trainer run failed or wrote no usable summary."""


def thread_rules(*, cpu_count: int, affinity: int, ranks: int) -> dict[str, int]:
    """Threads per rank each static rule gives: ``launcher`` (row 1), ``env`` (row 2), ``static`` (row 3)."""
    from offload.threads._rule import static_rule_threads

    for name, value in (("cpu_count", cpu_count), ("affinity", affinity), ("ranks", ranks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"thread_rules({name}={value!r}): expected an int >= 1")
    return {
        "launcher": 1,
        "env": max(1, cpu_count // ranks),
        "static": static_rule_threads(affinity, cpu_count, ranks),
    }


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec:
    """One trainer invocation of a (ranks, dtype) group: scenario flags and environment."""

    ranks: int
    dtype: str
    flags: tuple[str, ...]
    """Trainer flags beyond the common ones (model, dtype, steps, ...)."""
    env: tuple[tuple[str, str], ...]
    """Environment variables set for the launcher (all others as inherited, minus ``_SCRUB``)."""
    autotune: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One table row: which run measures it and how that run maps the row's rule."""

    row: str
    ranks: int
    dtype: str
    spec: RunSpec
    threads: int | None
    """Threads the rule gives (None: the trainer decides: plan, tuner or torch's AdamW)."""
    mapping: str


def build_rows(*, ranks: int, dtype: str, cpu_count: int, affinity: int,
               rows: Sequence[str] = tuple(ROW_NAMES)) -> list[Row]:
    """The rows of one (ranks, dtype) group, in table order."""
    unknown = [r for r in rows if r not in ROW_NAMES]
    if unknown:
        raise ValueError(f"rows {unknown}: expected some of {list(ROW_NAMES)}")
    rule = thread_rules(cpu_count=cpu_count, affinity=affinity, ranks=ranks)
    launcher_env = (("OMP_NUM_THREADS", "1"),)  # what torchrun sets for every rank
    off = ("--optim-cpu-offload",)

    def explicit(t: int) -> tuple[str, ...]:
        return (*off, "--threads", str(t), "--compute-threads", str(t))

    out: list[Row] = []
    for row in rows:
        if row == "1":
            t = rule["launcher"]
            spec = RunSpec(ranks=ranks, dtype=dtype, flags=explicit(t), env=launcher_env)
            mapping = f"OMP_NUM_THREADS=1 and --threads {t} --compute-threads {t}"
        elif row == "2":
            t = rule["env"]
            spec = RunSpec(ranks=ranks, dtype=dtype, flags=explicit(t), env=(("OMP_NUM_THREADS", str(t)),))
            mapping = f"OMP_NUM_THREADS={t} (= {cpu_count} cores // {ranks}) and --threads {t} --compute-threads {t}"
        elif row == "3":
            t = rule["static"]
            spec = RunSpec(ranks=ranks, dtype=dtype, flags=explicit(t), env=launcher_env)
            mapping = (f"--threads {t} --compute-threads {t} (= min({affinity}, {cpu_count} // {ranks})); "
                       "OMP_NUM_THREADS=1")
        elif row == "4":
            t = None
            spec = RunSpec(ranks=ranks, dtype=dtype, flags=off, env=launcher_env)
            mapping = "no thread flag: the trainer's plan_cpu_threads(); OMP_NUM_THREADS=1"
        elif row in ("5a", "5b"):
            t = None
            spec = RunSpec(ranks=ranks, dtype=dtype, flags=(*off, "--autotune"), env=launcher_env, autotune=True)
            mapping = "--autotune, " + ("fresh --cache file" if row == "5a" else "the cache file the first run wrote")
            mapping += "; OMP_NUM_THREADS=1"
        else:  # "6"
            t = None
            spec = RunSpec(ranks=ranks, dtype=dtype, flags=(), env=launcher_env)
            mapping = "no --optim-cpu-offload; forward/backward and AdamW threads from the plan; OMP_NUM_THREADS=1"
        out.append(Row(row=row, ranks=ranks, dtype=dtype, spec=spec, threads=t, mapping=mapping))
    return out


def deepspeed_note() -> str:
    """Row 7: DeepSpeed is never a dependency; say why the row is absent."""
    if importlib.util.find_spec("deepspeed") is None:
        return "row 7 (DeepSpeedCPUAdam) skipped: deepspeed is not installed (it is never a dependency)"
    return ("row 7 (DeepSpeedCPUAdam) not measured: deepspeed is installed, but bench.train has no "
            "DeepSpeedCPUAdam optimizer option to run it on the same model and steps")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerConfig:
    """What every run of the suite shares."""

    model_size: str
    batch_size: int
    seq_len: int
    steps: int
    """Steps of a plain run; the first is left out of every statistic."""
    probe_budget: int
    """The tuner's probe budget (``AutotuneConfig().probe_steps``); a first autotuned run adds it."""
    timeout_s: float = 900.0


@dataclass(kw_only=True, slots=True)
class TrainerRun:
    """A finished run: its summary and rank 0's per-step rows."""

    spec: RunSpec
    command: list[str]
    summary: dict[str, Any]
    step_rows: list[dict[str, Any]]
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def _env(spec: RunSpec, workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # A tuner that somehow ran without --cache must never touch the user's real cache.
    env["OFFLOAD_AUTOTUNE_CACHE"] = str(workdir / "unused-default-cache.json")
    env.update(dict(spec.env))
    return env


def command(spec: RunSpec, cfg: TrainerConfig, *, steps: int, summary: Path, trace_dir: Path,
            cache: Path | None) -> list[str]:
    if spec.ranks == 1:
        launcher = [sys.executable, "-m", "bench.train"]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                    str(spec.ranks), "-m", "bench.train"]
    cmd = [*launcher, "--model-size", cfg.model_size, "--dtype", spec.dtype, "--device", "cpu",
           "--batch-size", str(cfg.batch_size), "--seq-len", str(cfg.seq_len), "--steps", str(steps),
           "--seed", "0", "--log-level", "WARNING", *spec.flags,
           "--summary-json", str(summary), "--trace-dir", str(trace_dir)]
    if cache is not None:
        cmd += ["--cache", str(cache)]
    return cmd


def launch(spec: RunSpec, cfg: TrainerConfig, workdir: Path, *, steps: int, cache: Path | None = None) -> TrainerRun:
    """Run the trainer once; raise :class:`ScenarioError` with the output's tail if it fails."""
    workdir.mkdir(parents=True, exist_ok=True)
    summary_path, trace_dir = workdir / "summary.json", workdir / "trace"
    cmd = command(spec, cfg, steps=steps, summary=summary_path, trace_dir=trace_dir, cache=cache)
    t0 = time.perf_counter()
    try:
        proc = run_torchrun(cmd, cwd=workdir, env=_env(spec, workdir), timeout_s=cfg.timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise ScenarioError(f"{' '.join(cmd)}: no result after {cfg.timeout_s:.0f} s") from exc
    wall = time.perf_counter() - t0
    (workdir / "stdout.txt").write_text(proc.stdout)
    (workdir / "stderr.txt").write_text(proc.stderr)
    if proc.returncode != 0 or not summary_path.is_file():
        tail = (proc.stdout[-1500:] + "\n" + proc.stderr[-2500:]).strip()
        raise ScenarioError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{tail}")
    summary = json.loads(summary_path.read_text())
    steps_file = resolve_run_dir(trace_dir) / "train_steps.jsonl"  # the trainer's trace_dir/run-N
    rows = [json.loads(line) for line in steps_file.read_text().splitlines() if line.strip()] \
        if steps_file.is_file() else []
    return TrainerRun(spec=spec, command=cmd, summary=summary, step_rows=rows, wall_s=wall)


def select_steps(run: TrainerRun, which: str) -> list[int]:
    """0-based step indices a statistic uses.

    ``all``: every step but the first (one-off allocation). ``locked``: the steps after the
    tuner's probing (``probe_steps`` + the re-check steps of a cached choice), minus the first
    locked step, which runs right after the switch to the winner.
    """
    n = len(run.summary.get("step_times_s") or [])
    if which == "all":
        return list(range(1 if n > 1 else 0, n))
    if which != "locked":
        raise ValueError(f"select_steps(which={which!r}): expected 'all' or 'locked'")
    tuner = run.summary.get("tuner") or {}
    busy = int(tuner.get("probe_steps") or 0) + int(tuner.get("check_steps") or 0)
    first = max(1, busy + 1)
    return list(range(first, n))


def run_stats(run: TrainerRun, which: str) -> dict[str, Any]:
    """Median step time and stage medians of one run over :func:`select_steps`."""
    idx = select_steps(run, which)
    times = run.summary["step_times_s"]
    samples = [float(times[i]) for i in idx]
    by_step = {int(r["step"]) - 1: r for r in run.step_rows}
    stages: dict[str, float | None] = {}
    for name in STAGES:
        vals = [float(by_step[i]["stats"][name]) for i in idx
                if i in by_step and by_step[i].get("stats") is not None]
        stages[name] = median(vals) if vals else None
    knobs = sorted({(by_step[i].get("threads"), by_step[i].get("chunk_numel")) for i in idx if i in by_step},
                   key=str)
    return {"step_s": samples, "step_s_median": median(samples) if samples else None,
            "step_s_mean": sum(samples) / len(samples) if samples else None,
            "step_s_iqr": iqr(samples) if samples else None, "n": len(samples), "stages_s": stages,
            "knobs": [list(k) for k in knobs]}
