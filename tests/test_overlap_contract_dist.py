"""The overlap contract (issue 16) under FSDP2 and DDP: real gloo ranks, one launch per world size.

Each scenario trains the same loop three times on this rank: ``torch.optim.AdamW(fused=True)``,
``CPUOffloadAdamW`` with ``overlap_backward`` off, and on; the parameters (this rank's shards),
moments, steps, losses and clip norms must be bitwise equal (ours with overlap vs without, and
without overlap vs torch's AdamW). Scenarios:

* FSDP2 (``fully_shard``, the tiny model of tests/_fsdp_models.py: uneven and empty shards on 2 and
  3 ranks), 2 micro-batches per step, clipping by none / ``torch.nn.utils.clip_grad_norm_`` / ours
  (``opt.clip_grad_norm_``, the reference applying the coefficient our norm implies), with a
  reduce-scatter after every micro-batch (torchtitan's default: each gradient arrives twice) or
  ``set_requires_gradient_sync(False)`` on all but the last;
  (3 ranks: only the scenarios with clipping, to keep the launch short);
* DDP (2 ranks): clipping by none / torch's / ours (its all-reduce rewrites every gradient after
  the hooks fired).

A launch costs 10-20 s on 2 cores, so all scenarios of a world size run in one launch
(:func:`_results`, cached); one test per scenario reads its outcome. A failing call inside a
scenario's loop is recorded and the loop goes on, so every rank runs the same collectives and
the later scenarios stay meaningful.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from _dist_util import run_workers

STEPS, ACCUM, MAX_NORM = 3, 2, 0.05  # the first backward calibrates: two steps overlap
FSDP_SCENARIOS = [f"fsdp2 clip={c} sync={s}" for c in ("none", "torch", "ours")
                  for s in ("every-micro-batch", "last-micro-batch")]
DDP_SCENARIOS = [f"ddp clip={c}" for c in ("none", "torch", "ours")] + [
    f"ddp attached clip={c}" for c in ("none", "ours")]  # opt.attach_ddp: chunks start after the all-reduce


#: 3 ranks, gradient_as_bucket_view=True: DDP divides some gradients and multiplies others by the
#: reciprocal; they differ where the size is not a power of two, so attach_ddp refuses.
REFUSED = "ddp gradient_as_bucket_view attach refused"
#: 3 ranks: DDP's reduction multiplies by the reciprocal of 3 (not exact as a division), and DDP
#: over a sub-group (ranks 0 and 1; rank 2 alone): attach_ddp must reduce as DDP does, over its group.
DDP3_SCENARIOS = ["ddp attached clip=none", "ddp subgroup attached clip=none", REFUSED]


def _scenarios(world_size: int) -> list[str]:
    """2 ranks: all; 3 ranks (uneven shards, slower on 2 cores): FSDP2 with clipping, and DDP
    attached (over the world and over a sub-group)."""
    if world_size == 2:
        return FSDP_SCENARIOS + DDP_SCENARIOS
    return [s for s in FSDP_SCENARIOS if "clip=none" not in s] + DDP3_SCENARIOS


def _train(kind: str, scenario: str, rank: int, shared: dict[int, torch.Tensor]) -> dict[str, Any]:
    """One run of ``scenario`` with optimizer ``kind`` ("torch", "off", "on"). ``shared``: our clip
    norms by step (written by the "off" run, applied by the "torch" run)."""
    from _fsdp_models import Net, batch, groups, sharded
    from torch.nn.parallel import DistributedDataParallel

    from offload import CPUOffloadAdamW, OffloadSettings
    from offload.state._dtensor import local

    fsdp = scenario.startswith("fsdp2")
    clip = scenario.split("clip=")[1].split()[0]
    every_micro = "sync=every-micro-batch" in scenario
    accum = ACCUM if fsdp else 1
    if "subgroup" in scenario:  # every rank makes every group, in the same order
        import torch.distributed as dist

        pairs = [dist.new_group([0, 1]), dist.new_group([2])]
        model = DistributedDataParallel(Net(), process_group=pairs[0] if rank < 2 else pairs[1])
    else:
        model = sharded() if fsdp else DistributedDataParallel(Net())
    if kind == "torch":
        opt: Any = torch.optim.AdamW(groups(model), lr=1e-3, fused=True)
    else:
        opt = CPUOffloadAdamW(groups(model), lr=1e-3, overlap_backward=kind == "on",
                              settings=OffloadSettings(threads=1, chunk_numel=1024, kernel="torch"))
    if kind == "on" and "attached" in scenario:
        opt.attach_ddp(model)
    errors: list[str] = []
    committed = 0

    def guarded(fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # recorded; the loop goes on so every rank runs the same collectives
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            return None

    returned: list[torch.Tensor] = []
    clipped = 0
    for step in range(STEPS):
        guarded(opt.zero_grad, set_to_none=True)
        for micro in range(accum):
            if fsdp:
                model.set_requires_gradient_sync(every_micro or micro == accum - 1)
            loss = model(*batch(rank, step, micro)).div(accum)
            loss.backward()
            returned.append(loss.detach().clone())
        total = None
        if clip == "torch":
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        elif clip == "ours":
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            torch_total = torch.nn.utils.get_total_norm(grads, 2.0)  # collectives on every kind
            torch_total = torch_total.full_tensor() if hasattr(torch_total, "full_tensor") else torch_total
            if kind == "torch":
                total = shared.get(step, torch.tensor(float("nan")))
                coef = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0)
                torch._foreach_mul_([local(g) for g in grads], coef)
            else:
                before = [local(g).clone() for g in grads]
                total = guarded(lambda: opt.clip_grad_norm_(MAX_NORM, norm_type=2.0,
                                                            error_if_nonfinite=False, foreach=None))
                if total is not None:
                    if type(total) is not torch.Tensor or total.dim() != 0:
                        errors.append(f"clip_grad_norm_ returned {type(total).__name__} {total!r}")
                    rel = float((total.double() - torch_total.double()).abs() / torch_total.double())
                    if rel > 1e-6:
                        errors.append(f"our norm {float(total)} vs torch's {float(torch_total)} (rel {rel:.1e})")
                    if not all(torch.equal(local(g), b) for g, b in zip(grads, before)):
                        errors.append("opt.clip_grad_norm_ wrote p.grad")
                    if kind == "off":
                        shared[step] = total.detach().clone()
                else:
                    total = torch.tensor(float("nan"))
        if total is not None:
            total = total.full_tensor() if hasattr(total, "full_tensor") else total
            clipped += int(float(total) > MAX_NORM)
            returned.append(total.detach().clone())
        guarded(opt.step)
        if kind == "on":
            committed += opt.last_stats.committed_chunks
    params = list(model.parameters())
    state = {key: [local(opt.state.get(p)[key]).detach().clone().reshape(-1) for p in params
                   if opt.state.get(p)] for key in ("exp_avg", "exp_avg_sq", "step")}
    if isinstance(opt, CPUOffloadAdamW):
        opt.close()
    return {"params": [local(p).detach().clone() for p in params], "returned": returned,
            "has_state": [bool(opt.state.get(p)) for p in params], **state, "errors": errors,
            "clipped": clipped, "committed": committed}


def _compare(actual: dict[str, Any], expected: dict[str, Any], what: str) -> str | None:
    if actual["has_state"] != expected["has_state"]:
        return f"{what}: parameters with state {actual['has_state']} vs {expected['has_state']}"
    for key in ("returned", "params", "exp_avg", "exp_avg_sq", "step"):
        a, e = actual[key], expected[key]
        if len(a) != len(e):
            return f"{what}: {key}: {len(a)} vs {len(e)} tensors"
        for i, (x, y) in enumerate(zip(a, e)):
            if x.dtype != y.dtype or x.shape != y.shape:
                return f"{what}: {key}[{i}]: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
            if not torch.equal(x, y) and not (torch.equal(x.isnan(), y.isnan())
                                              and torch.equal(x.nan_to_num(0.0), y.nan_to_num(0.0))):
                diff = (x.double() - y.double()).abs().nan_to_num(float("inf")).max().item()
                return f"{what}: {key}[{i}] differs in {int((x != y).sum())}/{x.numel()} elements (max abs diff {diff:.3e})"
    return None


def _contract_worker(rank: int, world_size: int) -> dict[str, str]:
    """Every scenario of this world size: "ok", or the first error or mismatch (one line)."""
    torch.set_num_threads(1)
    outcome: dict[str, str] = {}
    for scenario in _scenarios(world_size):
        if scenario == REFUSED:
            outcome[scenario] = _refused()
            continue
        shared: dict[int, torch.Tensor] = {}
        try:
            runs = {kind: _train(kind, scenario, rank, shared) for kind in ("off", "on", "torch")}
        except Exception as exc:  # an error the loop did not expect: later scenarios may be off too
            outcome[scenario] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            continue
        problems = [f"{kind}: {e}" for kind, r in runs.items() for e in r["errors"][:1]]
        problems += [m for m in (_compare(runs["on"], runs["off"], "overlap on vs off"),
                                 _compare(runs["off"], runs["torch"], "overlap off vs torch AdamW"))
                     if m is not None]
        if "attached clip=none" in scenario and runs["on"]["committed"] == 0:
            problems.append("attach_ddp: no chunk started after the all-reduce was committed")
        if "clip=none" not in scenario and runs["torch"]["clipped"] == 0:
            problems.append("the clip was never active (max_norm too large for this loop)")
        outcome[scenario] = problems[0] if problems else "ok"
    return outcome


def _refused() -> str:
    from _fsdp_models import Net, groups
    from torch.nn.parallel import DistributedDataParallel

    from offload import CPUOffloadAdamW

    model = DistributedDataParallel(Net(), gradient_as_bucket_view=True)
    opt = CPUOffloadAdamW(groups(model), overlap_backward=True)
    try:
        opt.attach_ddp(model)
    except ValueError as exc:
        return "ok" if "gradient_as_bucket_view=True) on 3 ranks" in str(exc) else f"wrong message: {exc}"
    finally:
        opt.close()
    return "attach_ddp accepted gradient_as_bucket_view=True on 3 ranks"


@functools.lru_cache(maxsize=None)
def _results(world_size: int) -> tuple[dict[str, str], ...] | str:
    """One launch per world size: per rank, the outcome of every scenario (or why the launch failed)."""
    results = run_workers(_contract_worker, world_size=world_size, timeout_s=300)
    if not all(r.ok for r in results):
        return "\n".join(r.describe() for r in results)
    return tuple(r.value for r in results)


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "scenario"),
                         [(w, s) for w in (2, 3) for s in _scenarios(w)])
def test_overlap_contract_multi_process(world_size: int, scenario: str) -> None:
    results = _results(world_size)
    assert not isinstance(results, str), results
    outcomes = {rank: r[scenario] for rank, r in enumerate(results)}
    assert all(o == "ok" for o in outcomes.values()), outcomes
