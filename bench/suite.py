"""The benchmark suite: every claim measured side by side in one run (``python -m bench``).

    python -m bench                       # everything (tuner_quality and simulate at their own defaults)
    python -m bench --only roofline,scenarios   # the table and the roofline: ~12 min on 2 cores
    python -m bench --quick               # tiny model, bf16 only, one round: a smoke run (~3 min here)
    python -m bench --only scenarios --ranks 1 --dtypes fp32 --rows 4 --rounds 1   # one scenario alone

Sections (``--only`` picks some):

``scenarios``
    For each (local ranks, dtype) group, rows 1-6 of the scenario table, each a real ``bench.train`` run
    (see :mod:`bench._scenarios` for how each row maps to flags and environment). The runs go
    round-robin over ``--rounds`` rounds, every unit of every group once per round in a rotated
    order, so drift of the shared machine hits all rows alike. Per row: median step time (median
    over rounds of each round's median), IQR over the pooled steps, the optimizer's stage medians,
    and the ratio of the row's median to row 1's and to row 5b's (the autotuned cache-hit run) of
    the same group. Row 7 (DeepSpeedCPUAdam) is a note unless DeepSpeed is installed.
``roofline``
    ``bench.membus.bandwidth`` (the read-4/write-3 probe and the offload kernel's effective GB/s per
    thread count, interleaved) plus a PNG of both against threads.
``fused_mp``
    ``bench.membus.fused_mp_optimizer``: the whole offload step of the ``125m`` bf16 preset with
    ``kernel="fused-mp"`` against ``kernel="torch"`` and the read-4/write-3 probe, interleaved;
    the suite's table quotes its speed-up and bandwidth ratio at the best thread count.
``tuner_quality``, ``simulate``
    ``bench.tuner_quality`` and ``bench.simulate``, run in this process when those modules exist
    (they write their own files into the same folder); a missing module is a note, not an error.

Writes ``<out-dir>/<name>.{json,md,png}`` (default ``suite``; ``suite-quick`` with ``--quick``)
and ``<out-dir>/roofline.{json,md,png}`` (``roofline-quick``). Absolute times are printed, never
asserted: on shared machines the ratios of one interleaved run are the figures that count.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from bench import _scenarios as sc
from bench._args import OUT_DIR_HELP, PATH_RULE, HelpFormatter, output_dir
from bench._cli import bench_main, command_module
from bench._stats import atomic_write_json, atomic_write_text, iqr, machine_info, median
from bench._suite_report import plot_roofline, plot_scenarios, render_roofline_md, render_suite_md

logger = logging.getLogger("bench.suite")

__all__ = ["SECTIONS", "build_parser", "main", "run"]

SECTIONS = ("scenarios", "roofline", "fused_mp", "tuner_quality", "simulate")
_DTYPES = ("bf16", "fp32")


# --------------------------------------------------------------------------- command line


def _csv(kind, choices: Sequence[str] | None = None):
    def parse(text: str) -> list:
        items = [x.strip() for x in text.split(",") if x.strip()]
        try:
            values = [kind(x) for x in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list") from None
        if not values or (choices is not None and any(v not in choices for v in values)):
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of {list(choices or [])}")
        if kind is int and any(v < 1 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
        return values

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, bf16, 3 steps, one round: a smoke run")
    p.add_argument("--only", type=_csv(str, SECTIONS), default=list(SECTIONS),
                   help=f"sections to run, comma-separated (default all: {','.join(SECTIONS)})")
    p.add_argument("--ranks", type=_csv(int), default=[1, 2], help="local rank counts (default 1,2)")
    p.add_argument("--dtypes", type=_csv(str, _DTYPES), default=None,
                   help="model dtypes (default bf16,fp32; bf16 with --quick)")
    p.add_argument("--rows", type=_csv(str, ("1", "2", "3", "4", "5", "6")), default=["1", "2", "3", "4", "5", "6"],
                   help="scenario rows (default 1,2,3,4,5,6; 5 = both autotuned runs)")
    p.add_argument("--model-size", default=None, help="trainer model preset (default small; tiny with --quick)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step and rank (default 1)")
    p.add_argument("--seq-len", type=int, default=4,
                   help="tokens per sequence (default 4: short, so the optimizer is a large share)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps of a plain run, the first left out (default 16; 3 with --quick); a first "
                        "autotuned run adds the tuner's probe budget")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 2; 1 with --quick)")
    p.add_argument("--roofline-size", default=None, help="bandwidth model preset (default 50m; tiny with --quick)")
    p.add_argument("--roofline-repeats", type=int, default=None, help="bandwidth rounds (default 3; 1 with --quick)")
    p.add_argument("--out-dir", type=output_dir, default=None, help=OUT_DIR_HELP)
    p.add_argument("--name", default=None, help="scenario result stem (default suite or suite-quick)")
    p.add_argument("--keep-runs", type=output_dir, default=None,
                   help=f"keep every run's summary, trace and output here ({PATH_RULE})")
    p.add_argument("--note", default="", help="free text stored with the results (e.g. machine load)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="logging level (stderr)")
    return p


def _resolve(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    from bench.train.model import PRESETS

    q = args.quick
    args.model_size = args.model_size or ("tiny" if q else "small")
    args.roofline_size = args.roofline_size or ("tiny" if q else "50m")
    args.steps = args.steps if args.steps is not None else (3 if q else 16)
    args.rounds = args.rounds if args.rounds is not None else (1 if q else 2)
    args.roofline_repeats = args.roofline_repeats if args.roofline_repeats is not None else (1 if q else 3)
    args.name = args.name or ("suite-quick" if q else "suite")
    args.dtypes = args.dtypes or (["bf16"] if q else list(_DTYPES))
    for flag, value in (("--model-size", args.model_size), ("--roofline-size", args.roofline_size)):
        if value not in PRESETS:
            p.error(f"{flag} {value!r}: expected one of {sorted(PRESETS)}")
    for flag, value, low in (("--steps", args.steps, 2), ("--rounds", args.rounds, 1),
                             ("--roofline-repeats", args.roofline_repeats, 1), ("--batch-size", args.batch_size, 1),
                             ("--seq-len", args.seq_len, 1)):
        if value < low:
            p.error(f"{flag} {value}: expected an integer >= {low}")
    return args


# --------------------------------------------------------------------------- scenarios


def _cpu_counts() -> tuple[int, int]:
    cpu_count = os.cpu_count() or 1
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpu_count
    return cpu_count, affinity


def _units(args: argparse.Namespace, cpu_count: int,
           affinity: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(groups with their rows, measurement units). A unit is one trainer run per round, or the
    autotuned pair; rows with identical command and environment share one unit."""
    wanted = [r for r in sc.ROW_NAMES if r.rstrip("ab") in args.rows]
    groups, units = [], []
    for ranks in args.ranks:
        for dtype in args.dtypes:
            rows = sc.build_rows(ranks=ranks, dtype=dtype, cpu_count=cpu_count, affinity=affinity, rows=wanted)
            group = {"ranks": ranks, "dtype": dtype, "rows": rows, "unit_of": {}}
            by_spec: dict[sc.RunSpec, int] = {}
            for row in rows:
                if row.spec.autotune:
                    key = ("autotune", ranks, dtype)
                    found = next((i for i, u in enumerate(units) if u["key"] == key), None)
                    if found is None:
                        units.append({"key": key, "spec": row.spec, "autotune": True, "group": (ranks, dtype)})
                        found = len(units) - 1
                    group["unit_of"][row.row] = found
                    continue
                if row.spec not in by_spec:
                    units.append({"key": ("plain", ranks, dtype, row.row), "spec": row.spec, "autotune": False,
                                  "group": (ranks, dtype)})
                    by_spec[row.spec] = len(units) - 1
                group["unit_of"][row.row] = by_spec[row.spec]
            groups.append(group)
    return groups, units


def _round_order(n: int, rnd: int, rounds: int) -> list[int]:
    """Unit indices of round ``rnd``: rotated by a stride so each unit runs at several positions."""
    if n == 0:
        return []
    shift = (rnd * max(1, n // max(1, rounds))) % n
    order = list(range(n))
    return order[shift:] + order[:shift]


def _run_unit(unit: dict[str, Any], cfg: sc.TrainerConfig, workdir: Path, measure_steps: int) -> dict[str, Any]:
    spec = unit["spec"]
    if not unit["autotune"]:
        return {"run": sc.launch(spec, cfg, workdir / "run", steps=cfg.steps)}
    cache = workdir / "cache.json"  # fresh every round
    first = sc.launch(spec, cfg, workdir / "first", steps=cfg.probe_budget + cfg.steps, cache=cache)
    second = sc.launch(spec, cfg, workdir / "second", steps=cfg.steps + measure_steps, cache=cache)
    return {"first": first, "second": second}


def _row_source(row: str) -> tuple[str, str]:
    """(run of the unit, step selection) a table row reads."""
    special = {"5a-incl": ("first", "all"), "5a-excl": ("first", "locked"), "5b": ("second", "all")}
    return special.get(row, ("run", "all"))


def _aggregate(per_round: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over rounds of per-round medians; IQR over all rounds' pooled samples."""
    meds = [r["step_s_median"] for r in per_round if r["step_s_median"] is not None]
    means = [r["step_s_mean"] for r in per_round if r["step_s_mean"] is not None]
    pooled = [x for r in per_round for x in r["step_s"]]
    stages = {}
    for name in sc.STAGES:
        vals = [r["stages_s"][name] for r in per_round if r["stages_s"].get(name) is not None]
        stages[name] = median(vals) if vals else None
    return {"step_s_median": median(meds) if meds else None, "step_s_iqr": iqr(pooled) if pooled else None,
            "step_s_mean": median(means) if means else None,
            "n": len(pooled), "rounds": len(meds), "stages_s": stages,
            "round_medians_s": meds}


def _tuner_view(run: sc.TrainerRun) -> dict[str, Any]:
    t = run.summary.get("tuner") or {}
    return {k: t.get(k) for k in ("state", "cache_status", "cache_hit", "probe_steps", "check_steps",
                                  "n_candidates", "baseline", "winner", "speedup", "kept_baseline", "reason",
                                  "watch_steps", "switches")}


def run_scenarios(args: argparse.Namespace, workdir: Path, on_round=None) -> dict[str, Any]:
    """Measure every unit round by round; ``on_round(partial_result)`` after each finished round."""
    from autotune import AutotuneConfig

    cpu_count, affinity = _cpu_counts()
    groups, units = _units(args, cpu_count, affinity)
    tune_defaults = AutotuneConfig()
    cfg = sc.TrainerConfig(model_size=args.model_size, batch_size=args.batch_size, seq_len=args.seq_len,
                           steps=args.steps, probe_budget=tune_defaults.probe_steps)
    results: list[list[dict[str, Any] | None]] = [[None] * args.rounds for _ in units]
    errors: list[str] = []
    started = time.perf_counter()
    for rnd in range(args.rounds):
        for i in _round_order(len(units), rnd, args.rounds):
            u = units[i]
            label = f"round {rnd + 1}/{args.rounds} unit {i + 1}/{len(units)} {u['key']}"
            t0 = time.perf_counter()
            try:
                results[i][rnd] = _run_unit(u, cfg, workdir / f"r{rnd}" / f"u{i}", tune_defaults.measure_steps)
                logger.info("%s: %.1f s (elapsed %.0f s)", label, time.perf_counter() - t0,
                            time.perf_counter() - started)
            except sc.ScenarioError as exc:
                logger.error("%s failed: %s", label, exc)
                errors.append(f"{label}: {exc}")
        if on_round is not None and rnd + 1 < args.rounds:
            partial = _summarise(args, groups, units, results, errors, cfg, tune_defaults, cpu_count, affinity,
                                 time.perf_counter() - started)
            partial["rounds_completed"] = rnd + 1
            on_round(partial)
    out = _summarise(args, groups, units, results, errors, cfg, tune_defaults, cpu_count, affinity,
                     time.perf_counter() - started)
    out["rounds_completed"] = args.rounds
    return out


def _summarise(args, groups, units, results, errors, cfg, tune_defaults, cpu_count, affinity,
               elapsed_s: float) -> dict[str, Any]:
    out_groups = []
    for g in groups:
        ranks, dtype = g["ranks"], g["dtype"]
        rows_out: dict[str, dict[str, Any]] = {}
        for row in g["rows"]:
            unit = g["unit_of"][row.row]
            table_rows = ["5a-incl", "5a-excl"] if row.row == "5a" else [row.row]
            for trow in table_rows:
                part, which = _row_source(trow)
                per_round, knobs, tuner = [], set(), []
                for res in results[unit]:
                    if res is None:
                        continue
                    st = sc.run_stats(res[part], which)
                    st["run_wall_s"] = round(res[part].wall_s, 2)
                    per_round.append(st)
                    knobs.update(tuple(k) for k in st["knobs"])
                    if row.spec.autotune:
                        tuner.append(_tuner_view(res[part]))
                shared = [r.row for r in g["rows"] if g["unit_of"][r.row] == unit and r.row != row.row
                          and not row.spec.autotune]
                first_res = next((res for res in results[unit] if res is not None), None)
                rows_out[trow] = {
                    "row": trow, "label": sc.TABLE_LABEL[trow], "mapping": row.mapping, "threads_rule": row.threads,
                    "selection": which, "shared_with": shared,
                    "command": shlex.join(first_res[part].command) if first_res else None,
                    "env": dict(row.spec.env),
                    "threads_chunk_used": sorted([list(k) for k in knobs], key=str),
                    "compute_threads": ([r.get("compute_threads") for r in first_res[part].summary["ranks"]]
                                        if first_res else None),
                    "tuner": tuner or None,
                    **_aggregate(per_round),
                    "per_round": [{k: v for k, v in st.items() if k != "knobs"} for st in per_round],
                }
        for trow, r in rows_out.items():
            for ref, key in (("1", "ratio_to_row1"), ("5b", "ratio_to_row5b")):
                base = rows_out.get(ref, {}).get("step_s_median")
                r[key] = (r["step_s_median"] / base) if (base and r["step_s_median"] is not None) else None
        params = next((res[p].summary["params"] for u in set(g["unit_of"].values()) for res in results[u]
                       if res is not None for p in res), None)
        out_groups.append({"ranks": ranks, "dtype": dtype, "params": params,
                           "launcher": "python -m bench.train" if ranks == 1 else
                           f"torchrun --standalone --nproc-per-node {ranks} (gloo)",
                           "rows": [rows_out[k] for k in sc.TABLE_ROWS if k in rows_out]})
    return {
        "config": {"model_size": args.model_size, "batch_size": args.batch_size, "seq_len": args.seq_len,
                   "steps": args.steps, "first_autotuned_run_steps": cfg.probe_budget + args.steps,
                   "second_autotuned_run_steps": args.steps + tune_defaults.measure_steps,
                   "rounds": args.rounds, "ranks": args.ranks, "dtypes": args.dtypes, "rows": args.rows,
                   "cpu_count": cpu_count, "affinity": affinity, "probe_budget": cfg.probe_budget},
        "thread_rules": {str(r): sc.thread_rules(cpu_count=cpu_count, affinity=affinity, ranks=r) for r in args.ranks},
        "units": len(units),
        "runs": sum(2 if u["autotune"] else 1 for u in units) * args.rounds,
        "groups": out_groups,
        "notes": [sc.deepspeed_note()],
        "errors": list(errors),
        "duration_s": round(elapsed_s, 1),
    }


# --------------------------------------------------------------------------- roofline


def run_roofline(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import json

    from bench.membus import bandwidth

    cpu_count, affinity = _cpu_counts()
    threads = list(range(1, affinity + 1))
    argv = ["--sizes", args.roofline_size, "--dtypes", ",".join(args.dtypes),
            "--threads", ",".join(map(str, threads)), "--repeats", str(args.roofline_repeats),
            "--out-dir", str(workdir), "--name", "bandwidth", "--log-level", "WARNING"]
    if args.quick:
        argv.append("--quick")
    if args.note:
        argv += ["--note", args.note]
    started = time.perf_counter()
    rc = bandwidth.main(argv)
    if rc != 0:
        raise RuntimeError(f"python -m bench.membus.bandwidth {shlex.join(argv)} returned {rc}")
    raw = json.loads((workdir / "bandwidth.json").read_text())
    series = []
    for r in raw["runs"]:
        series.append({
            "model_size": r["model_size"], "dtype": r["dtype"], "params": r["params"],
            "points": [{"threads": pt["threads"], "probe": pt["probe"], "probe_gbps": pt["probe_gbps"],
                        "adam_gbps": pt["adam_gbps"], "ratio": pt["ratio"], "best_chunk_numel": pt["best_chunk_numel"],
                        "step_gbps": pt["step_gbps"], "step_over_kernel": pt.get("step_over_kernel")}
                       for pt in r["per_thread"]],
            "headline": r["headline"], "kernel": r.get("kernel"),
            "host_bytes_per_param": r.get("host_bytes_per_param"),
            "torch_adamw_host_bytes_per_param": r.get("torch_adamw_host_bytes_per_param"),
        })
    return {"command": "python -m bench.membus.bandwidth " + shlex.join(argv).replace(str(workdir), "<tmp>"),
            "duration_s": round(time.perf_counter() - started, 1), "threads": threads,
            "uptime_after_roofline": _uptime(),
            "adam_bytes_per_param": raw.get("adam_bytes_per_param"), "probes": raw.get("probes"),
            "c_probe_status": raw.get("c_probe_status"), "series": series, "bandwidth": raw}


# --------------------------------------------------------------------------- other engineers' sections


_EXTERNAL = {"fused_mp": ("bench.membus.fused_mp_optimizer", "fused_mp_optimizer"),
             "tuner_quality": ("bench.tuner_quality", "tuner_quality"),
             "simulate": ("bench.simulate", "simulated_nodes")}


def run_external(section: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``python -m <module>``'s ``main`` in this process when the module exists; a missing one is a note."""
    module, stem = _EXTERNAL[section]
    name = f"{stem}-quick" if args.quick else stem
    if importlib.util.find_spec(module) is None:
        return {"status": "skipped", "note": f"{module} is not present in this checkout: section skipped"}
    if section == "fused_mp":
        from offload.kernels._fused_mp import fused_mp_available

        ok, reason = fused_mp_available()
        if not ok:
            return {"status": "skipped", "note": f"the fused-mp kernel is unavailable here: {reason}"}
    argv = ["--out-dir", str(args.out_dir), "--name", name, "--log-level", "WARNING"]
    if args.quick:
        argv.insert(0, "--quick")
    started = time.perf_counter()
    try:
        rc = command_module(module).main(argv)
    except SystemExit as exc:  # argparse errors and explicit exits
        rc = exc.code
    except Exception as exc:  # noqa: BLE001 - another engineer's section must not sink the suite
        logger.exception("%s failed", module)
        return {"status": "failed", "note": f"python -m {module} {shlex.join(argv)} raised {exc!r}",
                "duration_s": round(time.perf_counter() - started, 1)}
    files = sorted(p.name for p in args.out_dir.glob(f"{name}.*"))
    status = "ok" if rc in (0, None) else "failed"
    out = {"status": status, "command": f"python -m {module} {shlex.join(argv)}", "returncode": rc,
           "files": files, "duration_s": round(time.perf_counter() - started, 1)}
    if section == "fused_mp" and status == "ok":
        out["headline"] = _fused_mp_headline(args.out_dir / f"{name}.json")
    return out


def _fused_mp_headline(path: Path) -> str:
    """The fused-mp section's figures, read back from the file it wrote."""
    import json

    try:
        r = json.loads(path.read_text(encoding="utf-8"))
        pa = r["paired_at_fused_best_threads"]
        return (f"at the best thread count ({r['best_threads']['fused-mp']}): "
                f"torch/fused-mp {r['speedup_torch_over_fused']:.2f}x (per round "
                f"{pa['torch_over_fused']['median']:.2f}x), fused-mp/probe GB/s "
                f"{r['fused_over_probe_gbps']:.2f} (per round {pa['fused_over_probe_gbps']['median']:.2f})")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"figures unreadable from {path.name}: {exc!r}"


# --------------------------------------------------------------------------- driver


def _uptime() -> str:
    exe = shutil.which("uptime")
    if exe:
        try:
            return subprocess.run([exe], capture_output=True, text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    started = time.time()
    machine = machine_info()
    uptime_before = _uptime()
    command = "python -m bench " + shlex.join(argv)
    result: dict[str, Any] = {"benchmark": "bench.suite", "command": command, "machine": machine,
                              "uptime_before": uptime_before, "note": args.note}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    roof_name = "roofline-quick" if args.quick else "roofline"
    tmp = tempfile.TemporaryDirectory(prefix="bench-suite-") if args.keep_runs is None else None
    workdir = Path(tmp.name) if tmp is not None else args.keep_runs
    try:
        if "roofline" in args.only:  # first: short, and a stopped run still has it
            try:
                result["roofline"] = run_roofline(args, workdir / "roofline")
            except Exception as exc:  # noqa: BLE001 - report it with the rest
                logger.exception("roofline failed")
                result["roofline"] = {"error": repr(exc), "series": []}
            result["roofline_file"] = f"{roof_name}.md"
        if "scenarios" in args.only:
            def on_round(partial: dict[str, Any]) -> None:
                result["scenarios"] = partial
                _write(args, result, started, uptime_before, roof_name)
                logger.info("round %d of %d done: partial results written", partial["rounds_completed"], args.rounds)

            result["scenarios"] = run_scenarios(args, workdir / "scenarios", on_round)
        for section in ("fused_mp", "tuner_quality", "simulate"):
            if section in args.only:
                result[section] = run_external(section, args)
            else:
                stem = _EXTERNAL[section][1] + ("-quick" if args.quick else "")
                files = sorted(p.name for p in args.out_dir.glob(f"{stem}.*"))
                result[section] = {"status": "not run in this invocation",
                                   "note": "earlier results in this folder" if files else "no earlier results",
                                   "files": files}
    finally:
        if tmp is not None:
            tmp.cleanup()
    result["written"] = [str(p) for p in _write(args, result, started, uptime_before, roof_name)]
    return result


def _write(args: argparse.Namespace, result: dict[str, Any], started: float, uptime_before: str,
           roof_name: str) -> list[Path]:
    command, machine = result["command"], result["machine"]
    result["uptime_after"] = _uptime()
    result["duration_s"] = round(time.time() - started, 1)
    m = machine
    header = [f"- command: `{command}`",
              f"- date (UTC): {m['date_utc']}; duration {result['duration_s']} s",
              f"- CPU: {m['cpu_model']}; {m['physical_cores']} physical cores, {m['logical_cpus']} logical, "
              f"{m['affinity_cpus']} in the affinity mask; {m['memory_gib']} GiB; torch {m['torch']}",
              f"- uptime before: `{uptime_before}`", f"- uptime after: `{result['uptime_after']}`"]
    if args.note:
        header.append(f"- note: {args.note}")
    result["header"] = header
    written = []
    if "roofline" in result:
        r = result["roofline"]
        written.append(atomic_write_json(args.out_dir / f"{roof_name}.json",
                                         {"command": command, "machine": machine, "uptime_before": uptime_before,
                                          "uptime_after": result["uptime_after"], **r}))
        if r.get("series"):
            written.append(atomic_write_text(args.out_dir / f"{roof_name}.md",
                                             render_roofline_md(r, header, f"{roof_name}.png")))
            png = plot_roofline(r, args.out_dir / f"{roof_name}.png")
            if png is not None:
                written.append(png)
    if "scenarios" in result:
        png = plot_scenarios(result["scenarios"], args.out_dir / f"{args.name}.png")
        if png is not None:
            written.append(png)
    slim = {k: v for k, v in result.items() if k != "roofline"}
    if "roofline" in result:
        slim["roofline"] = {k: v for k, v in result["roofline"].items() if k != "bandwidth"}
    written.append(atomic_write_json(args.out_dir / f"{args.name}.json", slim))
    written.append(atomic_write_text(args.out_dir / f"{args.name}.md", render_suite_md(result)))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    result = bench_main(argv, build_parser=build_parser, run=run, resolve=_resolve)
    print(render_suite_md(result), flush=True)
    for path in result["written"]:
        print(f"wrote {path}", flush=True)
    failed = bool(result.get("scenarios", {}).get("errors")) or bool(result.get("roofline", {}).get("error"))
    failed |= any(result.get(s, {}).get("status") == "failed" for s in ("fused_mp", "tuner_quality", "simulate"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
