"""One node agreement: a tuned optimizer's thread plan, kernel vote and tuner share one gloo group.

Two real gloo ranks count the process groups built (``torch.distributed.new_group``, wrapped) while
``CPUOffloadAdamW(autotune=...)`` (a bf16 model: the kernel vote runs where fused-mp is bitwise
equal to torch's kernel) and ``tune_step_threads`` are constructed: one group each. The plans still
see both ranks' masks (exchanged through the agreement), and closing twice is harmless.
"""

from __future__ import annotations

from typing import Any

import pytest

from _dist_util import run_workers

pytestmark = pytest.mark.slow


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from autotune import AutotuneConfig
    from offload import CPUOffloadAdamW, tune_step_threads
    from offload.kernels._fused_mp import bitwise_matches_torch

    made: list[list[int] | None] = []
    real = dist.new_group

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(kwargs.get("ranks", args[0] if args else None))
        return real(*args, **kwargs)

    dist.new_group = counting  # patching torch is fine: count every group any module makes
    config = AutotuneConfig(use_cache=False, timeout_s=60)
    out: dict[str, Any] = {"kernel_vote": bool(bitwise_matches_torch())}
    try:
        params = [torch.randn(n, dtype=torch.bfloat16, requires_grad=True) for n in (300, 4097)]
        opt = CPUOffloadAdamW(params, autotune=config)
        out["offload_groups"] = len(made)
        out["tuner_ranks"] = opt.tuner.summary().get("local_world_size")
        out["kernel_knob"] = "kernel" in opt.tuner.space.names  # the vote ran, through the agreement
        opt.close()
        opt.close()

        made.clear()
        stock = torch.optim.AdamW([torch.randn(100, requires_grad=True)], fused=True)
        wrapped = tune_step_threads(stock, autotune=config)
        out["stock_groups"] = len(made)
        out["stock_threads"] = wrapped.threads
        wrapped.close()
        wrapped.close()
    finally:
        dist.new_group = real
    return out


def test_a_tuned_optimizer_builds_one_gloo_group_per_node() -> None:
    results = run_workers(_worker, world_size=2, kwargs={}, timeout_s=600)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)
    for r in results:
        assert r.value["kernel_knob"] == r.value["kernel_vote"], r.value  # fused-mp builds here
        assert r.value["offload_groups"] == 1, r.value  # was 3: thread plan, kernel vote, tuner
        assert r.value["stock_groups"] == 1, r.value  # the agreement; the thread plan makes none
        assert r.value["tuner_ranks"] == 2, r.value
