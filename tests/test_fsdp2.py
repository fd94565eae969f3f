"""CPUOffloadAdamW on FSDP2 (``fully_shard``) models: real gloo ranks, bitwise against torch.

One launch per world size runs every numerics check (launches cost seconds on 2 cores): fp32
shards against ``torch.optim.AdamW(fused=True)`` on the identical sharded model, bf16 shards
against the per-shard mixed-precision reference, fp32 shards under
``MixedPrecisionPolicy(param_dtype=bf16)``, other settings (threads, chunk size, kernel), and
``overlap_backward`` with and without gradient accumulation. 3 ranks give uneven shards; 2 and 3
ranks give ranks with an empty shard.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _dist_util import run_workers

STEPS = 10


def _numerics_worker(rank: int, world_size: int) -> dict[str, Any]:
    from _fsdp_models import (ShardMixedPrecisionReference, assert_same, groups, schedule,
                              sharded, train)
    from offload import CPUOffloadAdamW, OffloadSettings
    from offload.state._dtensor import local
    from offload.kernels._fused_mp import bitwise_matches_torch, fused_mp_available

    torch.set_num_threads(1)
    steps = range(STEPS)
    small = OffloadSettings(threads=2, chunk_numel=1024)
    checked = []
    _check_construction(world_size)
    checked.append("construction")
    _check_mixed_plain_and_sharded(rank)
    checked.append("mixed plain and sharded")
    _check_edits_and_added_group(rank)
    checked.append("weight edits and add_param_group")

    def ours(model, settings=None, **kw):
        opt = CPUOffloadAdamW(groups(model), lr=1e-3, settings=settings, **kw)
        return opt, schedule(opt)

    def check(model, opt, ref_model, ref_state, what):
        assert_same(list(model.parameters()), list(ref_model.parameters()), f"{what} params")
        for name in ("exp_avg", "exp_avg_sq"):
            assert_same([opt.state[p][name] for p in model.parameters()],
                        [ref_state(p)[name] for p in ref_model.parameters()], f"{what} {name}")
        assert_same([opt.state[p]["step"] for p in model.parameters()],
                     [ref_state(p)["step"].cpu() for p in ref_model.parameters()], f"{what} step")
        checked.append(what)

    # fp32 shards, and fp32 shards under MixedPrecisionPolicy(param_dtype=bf16).
    for what, param_dtype in (("fp32", None), ("fp32+mp-bf16", torch.bfloat16)):
        ref = sharded(param_dtype=param_dtype)
        ref_opt = torch.optim.AdamW(groups(ref), lr=1e-3, fused=True)
        train(ref, ref_opt, schedule(ref_opt), rank, steps)
        for label, settings, kw in (("default", None, {}), ("threads2-chunk1024", small, {}),
                                    ("overlap", small, {"overlap_backward": True})):
            model = sharded(param_dtype=param_dtype)
            opt, sched = ours(model, settings, **kw)
            train(model, opt, sched, rank, steps, overlap="overlap_backward" in kw)
            check(model, opt, ref, lambda p: ref_opt.state[p], f"{what} {label}")
            if kw:
                # overlap really started chunks during backward, on every rank
                assert opt.last_stats.speculated_chunks > 0, f"{what} {label}: no early launch"
            opt.close()

    # Gradient accumulation (no reduce-scatter but on the last micro-batch), with and without overlap.
    ref = sharded()
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-3, fused=True)
    train(ref, ref_opt, schedule(ref_opt), rank, range(4), accum=3)
    for kw in ({}, {"overlap_backward": True}):
        model = sharded()
        opt, sched = ours(model, small, **kw)
        train(model, opt, sched, rank, range(4), accum=3, overlap=bool(kw))
        check(model, opt, ref, lambda p: ref_opt.state[p], f"fp32 accum3 {kw}")
        opt.close()

    # bf16 shards (model cast before fully_shard) against the mixed-precision reference.
    ref = sharded(torch.bfloat16)
    mp_ref = ShardMixedPrecisionReference(ref)
    train(ref, mp_ref, schedule(mp_ref.opt), rank, steps)
    variants = [("default", None), ("threads2-chunk1024", small)]
    if fused_mp_available()[0] and bitwise_matches_torch():
        variants.append(("fused-mp", OffloadSettings(threads=2, chunk_numel=1024, kernel="fused-mp")))
    for label, settings in variants:
        model = sharded(torch.bfloat16)
        opt, sched = ours(model, settings)
        train(model, opt, sched, rank, steps)
        check(model, opt, ref, mp_ref.state, f"bf16 {label}")
        assert_same([opt.state[p]["master_param"] for p in model.parameters()],
                    [mp_ref.master[p] for p in ref.parameters()], f"bf16 {label} master")
        opt.close()

    empty = sum(1 for p in sharded().parameters() if local(p).numel() == 0)
    return {"checked": checked, "empty_shards": empty,
            "local_numel": sum(local(p).numel() for p in sharded().parameters())}


def _check_construction(world_size: int) -> None:
    """A Partial parameter raises ValueError at construction, naming the parameter and placement
    (the layouts that are supported: tests/test_layouts.py)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from offload import CPUOffloadAdamW

    mesh = init_device_mesh("cpu", (world_size,))
    t = DTensor.from_local(torch.zeros(6, 6), mesh, [Partial()], run_check=False)
    try:
        CPUOffloadAdamW([("good", torch.nn.Parameter(torch.zeros(3))), ("bad.weight", torch.nn.Parameter(t))])
    except ValueError as exc:
        assert "parameter 1 ('bad.weight')" in str(exc) and "Partial(sum)" in str(exc), str(exc)
    else:
        raise AssertionError("Partial(sum): no ValueError at construction")


def _check_mixed_plain_and_sharded(rank: int) -> None:
    """One optimizer over a sharded model and a plain parameter: each equals torch's AdamW."""
    from _fsdp_models import assert_same, batch, groups, sharded
    from offload import CPUOffloadAdamW

    model, ref = sharded(), sharded()
    torch.manual_seed(1)
    extra = torch.nn.Parameter(torch.randn(300))
    ref_extra = torch.nn.Parameter(extra.detach().clone())
    opt = CPUOffloadAdamW([*groups(model), {"params": [extra], "weight_decay": 0.0}], lr=1e-3)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-3, fused=True)
    ref_extra_opt = torch.optim.AdamW([ref_extra], lr=1e-3, weight_decay=0.0, fused=True)
    for step in range(3):
        for m, e, opts in ((model, extra, (opt,)), (ref, ref_extra, (ref_opt, ref_extra_opt))):
            x, y = batch(rank, step)
            (m(x, y) + (e * x.mean()).sum()).backward()
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
    assert_same([*model.parameters(), extra], [*ref.parameters(), ref_extra], "mixed params")
    opt.close()


def _check_edits_and_added_group(rank: int) -> None:
    """Sharded weights clamped in place between steps (the master follows the shard) and a param
    group added mid-training: bitwise the same as torch AdamW given the same edits."""
    from _fsdp_models import D, assert_same, batch, groups, sharded
    from offload import CPUOffloadAdamW

    model, ref = sharded(), sharded()
    extra = [torch.nn.Parameter(torch.full((3, D), 0.01)) for _ in range(2)]
    opt = CPUOffloadAdamW(groups(model), lr=1e-3)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-3, fused=True)
    for step in range(5):
        if step == 2:
            with torch.no_grad():
                for p in (*model.parameters(), *ref.parameters()):
                    p.clamp_(-0.05, 0.05)  # a DTensor op: writes the local shard in place
        if step == 3:
            opt.add_param_group({"params": [extra[0]], "lr": 3e-3})
            ref_opt.add_param_group({"params": [extra[1]], "lr": 3e-3})
        for m, e, o in ((model, extra[0], opt), (ref, extra[1], ref_opt)):
            x, y = batch(rank, step)
            (m(x, y) + (e.sum(0) * x).mean()).backward()
            o.step()
            o.zero_grad(set_to_none=True)
    assert_same([*model.parameters(), extra[0]], [*ref.parameters(), extra[1]], "edited params")
    opt.close()


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_shards_bitwise_equal_to_torch(world_size: int) -> None:
    results = run_workers(_numerics_worker, world_size=world_size, timeout_s=600)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)
    values = [r.value for r in results]
    required = {f"{w} {s}" for w in ("fp32", "fp32+mp-bf16") for s in ("default", "threads2-chunk1024", "overlap")}
    required |= {"construction", "mixed plain and sharded", "weight edits and add_param_group", "fp32 accum3 {}", "fp32 accum3 {'overlap_backward': True}", "bf16 default", "bf16 threads2-chunk1024"}
    assert all(required <= set(v["checked"]) for v in values), values
    assert any(v["empty_shards"] > 0 for v in values), values  # the empty-shard path ran
    if world_size == 3:
        assert len({v["local_numel"] for v in values}) > 1, values  # uneven shards


def _uneven_tuning_worker(rank: int, world_size: int) -> dict[str, Any]:
    """A 5 Mi-element parameter on 3 ranks: shards of 2, 2 and 1 Mi elements. Sized by its own
    shard, each rank would offer other chunk sizes to the tuner (an AgreementMismatch)."""
    from torch.distributed.fsdp import fully_shard

    from autotune import AutotuneConfig
    from offload import CPUOffloadAdamW

    torch.set_num_threads(1)
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.zeros(5, 1 << 20))
    fully_shard(module)
    opt = CPUOffloadAdamW(module.parameters(), autotune=AutotuneConfig(use_cache=False, probe_steps=16))
    for _ in range(24):
        module.weight.grad = torch.ones_like(module.weight)
        opt.step()
    summary = opt.tuner.summary()
    opt.close()
    return {"local_numel": module.weight.to_local().numel(), "state": summary["state"],
            "winner": summary["winner"], "space": opt.tuner.space.to_dict()}


@pytest.mark.slow
def test_uneven_shards_tune_one_agreed_setting() -> None:
    results = run_workers(_uneven_tuning_worker, world_size=3, timeout_s=300)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)
    values = [r.value for r in results]
    assert [v["local_numel"] for v in values] == [2 << 20, 2 << 20, 1 << 20]
    assert all(v["state"] == "locked" for v in values), values
    assert all(v["winner"] == values[0]["winner"] and v["space"] == values[0]["space"] for v in values)
    chunks = [k for k in values[0]["space"]["knobs"] if k["name"] == "chunk_numel"][0]["values"]
    assert len(chunks) > 1, chunks  # the chunk knob is really tuned
