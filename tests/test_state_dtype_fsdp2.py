"""``state_dtype=torch.bfloat16`` on FSDP2 (``fully_shard``) models, 2 gloo ranks: bitwise the
stated reference per shard (fp32 update on the upcast moments, rounded to bf16 after every step),
fp32 and bf16 shards, overlap off and on; moments are bf16 DTensors in ``state_dict()``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _dist_util import run_workers


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    from _fsdp_models import ShardMixedPrecisionReference, assert_same, groups, schedule, sharded, train
    from offload import CPUOffloadAdamW, OffloadSettings
    from offload.state._dtensor import is_dtensor

    torch.set_num_threads(1)
    checked = []
    for dtype in (torch.float32, torch.bfloat16):
        ref_model = sharded(dtype)
        ref = ShardMixedPrecisionReference(ref_model)
        step = ref.step

        def rounded_step(step=step, ref=ref) -> None:  # the stated reference: moments rounded to bf16
            step()
            with torch.no_grad():
                for st in ref.opt.state.values():
                    for key in ("exp_avg", "exp_avg_sq"):
                        st[key].copy_(st[key].to(torch.bfloat16))

        ref.step = rounded_step
        train(ref_model, ref, schedule(ref.opt), rank, range(6))
        for overlap in (False, True):
            model = sharded(dtype)
            opt = CPUOffloadAdamW(groups(model), lr=1e-3, state_dtype=torch.bfloat16, overlap_backward=overlap,
                                  settings=OffloadSettings(threads=2, chunk_numel=1024))
            train(model, opt, schedule(opt), rank, range(6), overlap=overlap)
            what = f"{dtype} overlap={overlap}"
            assert_same(list(model.parameters()), list(ref_model.parameters()), f"{what} params")
            for key in ("exp_avg", "exp_avg_sq"):
                got = [opt.state[p][key] for p in model.parameters()]
                assert all(t.dtype == torch.bfloat16 for t in got), (what, [(type(t).__name__, t.dtype) for t in got])
                assert_same([t.float() for t in got], [ref.state(p)[key] for p in ref_model.parameters()],
                            f"{what} {key}")
            saved = opt.state_dict()["state"]
            assert all(is_dtensor(s["exp_avg"]) and s["exp_avg"].dtype == torch.bfloat16 for s in saved.values())
            checked.append(what)
            opt.close()
    return {"checked": checked}


@pytest.mark.slow
def test_bf16_moments_on_fsdp2_shards_are_the_reference_bitwise() -> None:
    results = run_workers(_worker, world_size=2, timeout_s=600)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)
    assert all(len(r.value["checked"]) == 4 for r in results), [r.value for r in results]
