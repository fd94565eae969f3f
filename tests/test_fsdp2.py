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
                              sharded, shards, train)
    from offload import CPUOffloadAdamW, OffloadSettings
    from offload._dtensor import local
    from offload._fused_mp import bitwise_matches_torch, fused_mp_available

    torch.set_num_threads(1)
    steps = range(STEPS)
    small = OffloadSettings(threads=2, chunk_numel=1024)
    checked = []
    _check_construction(world_size)
    checked.append("construction")
    _check_mixed_plain_and_sharded(rank)
    checked.append("mixed plain and sharded")

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
                assert opt._early_launches_last_step > 0, f"{what} {label}: no early launch"
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
    """Unsupported placements raise ValueError at construction, naming the parameter and placement."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from offload import CPUOffloadAdamW

    mesh = init_device_mesh("cpu", (world_size,))
    mesh2 = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    full = torch.zeros(6, 6)
    bad = {
        "Shard(dim=1)": distribute_tensor(full, mesh, [Shard(1)]),
        "Replicate()": distribute_tensor(full, mesh, [Replicate()]),
        "Partial(sum)": DTensor.from_local(torch.zeros(6, 6), mesh, [Partial()], run_check=False),
        "2-D mesh": distribute_tensor(full, mesh2, [Replicate(), Shard(0)]),
    }
    for placement, t in bad.items():
        good = torch.nn.Parameter(torch.zeros(3))
        try:
            CPUOffloadAdamW([("good", good), ("bad.weight", torch.nn.Parameter(t))])
        except ValueError as exc:
            text = str(exc)
            assert "parameter 1 ('bad.weight')" in text, text
            assert (placement in text) if placement != "2-D mesh" else ("2-D mesh" in text), text
        else:
            raise AssertionError(f"{placement}: no ValueError at construction")


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


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_shards_bitwise_equal_to_torch(world_size: int) -> None:
    results = run_workers(_numerics_worker, world_size=world_size, timeout_s=600)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)
    values = [r.value for r in results]
    required = {f"{w} {s}" for w in ("fp32", "fp32+mp-bf16") for s in ("default", "threads2-chunk1024", "overlap")}
    required |= {"construction", "mixed plain and sharded", "fp32 accum3 {}", "fp32 accum3 {'overlap_backward': True}", "bf16 default", "bf16 threads2-chunk1024"}
    assert all(required <= set(v["checked"]) for v in values), values
    assert any(v["empty_shards"] > 0 for v in values), values  # the empty-shard path ran
    if world_size == 3:
        assert len({v["local_numel"] for v in values}) > 1, values  # uneven shards
