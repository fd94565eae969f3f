"""accelerate's FSDP2 preparation with ``CPUOffloadAdamW`` on 2 CPU gloo ranks (a real client).

accelerate only honours its FSDP plugin on an accelerator device, so the test drives the very path
``Accelerator.prepare`` takes under ``FullyShardedDataParallelPlugin(fsdp_version=2)``:
``Accelerator._prepare_fsdp2`` builds the optimizer on the plain parameters, replaces them in
``param_groups`` with placeholders, runs ``fsdp2_prepare_model`` (``fully_shard`` per
``GPT2Block`` and the root) and re-binds ``param_groups[i]["params"]`` to the new DTensor
parameters (``fsdp2_switch_optimizer_parameters``). The optimizer must step those re-bound
parameters (issue 17: before, it kept its own list and silently trained nothing), bitwise like
``torch.optim.AdamW(fused=True)`` under the same preparation.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _dist_util import run_workers

from _client_util import require

require("accelerate")
require("transformers")

STEPS = 4


def _prepared(kind: str):
    import transformers
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    from offload import CPUOffloadAdamW

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    if kind == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    else:
        opt = CPUOffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    accelerator = Accelerator(cpu=True)
    # Without a GPU accelerate drops the plugin (MULTI_CPU); put it back to take the FSDP2 path.
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    model, opt = accelerator._prepare_fsdp2(model, opt)
    return model, opt


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    runs = {}
    for kind in ("torch", "ours"):
        model, opt = _prepared(kind)
        assert all(isinstance(p, DTensor) for p in model.parameters()), kind
        initial = [p.to_local().clone() for p in model.parameters()]
        for step in range(STEPS):
            ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
            model(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        final = [p.to_local().clone() for p in model.parameters()]
        moved = max((a - b).abs().max().item() for a, b in zip(final, initial) if a.numel())
        runs[kind] = (final, moved)
        if hasattr(opt, "close"):
            opt.close()
    same = all(torch.equal(a, b) for a, b in zip(runs["ours"][0], runs["torch"][0], strict=True))
    return {"moved": {k: v[1] for k, v in runs.items()}, "bitwise": same}


@pytest.mark.slow
def test_accelerate_fsdp2_preparation_trains_bitwise_like_torch() -> None:
    results = run_workers(_worker, world_size=2, timeout_s=300)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)
    for r in results:
        assert r.value["moved"]["torch"] > 1e-3, r.value
        assert r.value["moved"]["ours"] > 1e-3, r.value  # the weights changed (issue 17: 0.0)
        assert r.value["bitwise"], r.value
