"""``tune_step_threads`` on FSDP2 ``CPUOffloadPolicy`` models in two real gloo ranks.

One launch (two processes, on the 2-core CI machine) checks everything that needs ranks:
numerics of the wrapped step against the same stock optimizer unwrapped on an identically sharded
model (AdamW fused and foreach, SGD with momentum: every local shard and state bitwise, every step,
across the thread counts probed), agreement (both ranks lock in the same choice: the node optimum
by the max over ranks, which neither rank alone would pick), the cache (a second wrapper reuses
it), and ``torch.distributed.checkpoint``'s optimizer helpers on the sharded wrapped optimizer.
Step times come from an injected clock, so the decision is certain.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from _dist_util import costed_tuning, run_workers

pytestmark = pytest.mark.slow

#: Fake step seconds per rank and thread count. Alone, rank 0 would pick 2 and rank 1 would pick
#: 4 threads; the node's time (max over ranks) is lowest at 2: 1->3.0, 2->1.5, 4->2.0.


def _sharded_model(seed: int = 0) -> Any:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(seed)
    # Odd sizes: uneven shards and vector tails; one weight of 310k elements splits over threads.
    model = nn.Sequential(nn.Linear(300, 1031), nn.GELU(), nn.Linear(1031, 29), nn.LayerNorm(29))
    mesh = init_device_mesh("cpu", (2,))
    policy = CPUOffloadPolicy(pin_memory=False)  # pinning needs an accelerator
    for layer in model:
        if isinstance(layer, (nn.Linear, nn.LayerNorm)):
            fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return model


def _loss(model: Any, step: int, rank: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(100 * step + rank)
    return model(torch.randn(4, 300, generator=g)).pow(2).mean()


def _local(tensors: Any) -> list[Any]:
    return [t.to_local().detach().clone() if hasattr(t, "to_local") else t.detach().clone() for t in tensors]


def _same(a: list[Any], b: list[Any]) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _train_step(pairs: Any, step: int, rank: int) -> None:
    """One step of (reference model, its unwrapped optimizer at 1 thread), (model, wrapped optimizer)."""
    from offload import ThreadTunedOptimizer, thread_limit

    for model, opt in pairs:
        _loss(model, step, rank).backward()
        if isinstance(opt, ThreadTunedOptimizer):
            opt.step()
        else:
            with thread_limit(1):
                opt.step()
        opt.zero_grad(set_to_none=True)


def _worker(rank: int, world_size: int, *, cache_path: str, trace_dir: str) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from offload import tune_step_threads

    torch.set_num_threads(1)
    plan, config, clock = costed_tuning(rank, world_size, cache_path=cache_path, trace_dir=trace_dir)

    makers = {
        "adamw-fused": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1, fused=True),
        "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1, foreach=True),
        "sgd-momentum": lambda p: torch.optim.SGD(p, lr=3e-2, momentum=0.9),
    }
    out: dict[str, Any] = {"runs": {}}
    for name, make in makers.items():
        ref_model, model = _sharded_model(), _sharded_model()
        ref = make(ref_model.parameters())
        opt = tune_step_threads(make(model.parameters()), autotune=config, plan=plan, clock=clock)
        used: list[int] = []
        opt.register_step_pre_hook(lambda *_: used.append(torch.get_num_threads()))
        mismatches = []
        for step in range(28):
            _train_step(((ref_model, ref), (model, opt)), step, rank)
            if not _same(_local(model.parameters()), _local(ref_model.parameters())):
                mismatches.append(step)
        states_equal = all(
            _same(_local(v for v in opt.state[p].values() if torch.is_tensor(v)),
                  _local(v for v in ref.state[q].values() if torch.is_tensor(v)))
            for p, q in zip(model.parameters(), ref_model.parameters())
        )
        summary = opt.tuner.summary()
        run = {"mismatch_steps": mismatches, "states_equal": states_equal, "threads_used": sorted(set(used)),
               "state": summary["state"], "winner": summary["winner"], "cache_status": summary["cache_status"],
               "probe_steps": summary["probe_steps"], "cache_key": summary["cache_key"]}
        if name == "adamw-fused":
            # torch.distributed.checkpoint: the wrapped optimizer's sharded state, keyed by FQN,
            # equals the reference's; loading it into a fresh wrapper (its first tuned run now
            # re-checks the cached choice) continues bitwise.
            got = get_optimizer_state_dict(model, opt)
            want = get_optimizer_state_dict(ref_model, ref)
            run["dcp_fqns"] = sorted(got["state"])
            run["dcp_equal"] = sorted(got["state"]) == sorted(want["state"]) and all(
                _same(_local([got["state"][f][k]]), _local([v])) for f, e in want["state"].items() for k, v in e.items()
            )
            model2 = _sharded_model(seed=1)
            model2.load_state_dict(copy.deepcopy(model.state_dict()))
            opt2 = tune_step_threads(make(model2.parameters()), autotune=config, plan=plan, clock=clock)
            set_optimizer_state_dict(model2, opt2, copy.deepcopy(got))
            resumed = []
            for step in range(28, 46):
                _train_step(((ref_model, ref), (model2, opt2)), step, rank)
                resumed.append(_same(_local(model2.parameters()), _local(ref_model.parameters())))
                if opt2.tuner.state == "locked" and step >= 32:
                    break
            second = opt2.tuner.summary()
            run["resumed_equal"] = all(resumed)
            run["second"] = {k: second[k] for k in ("state", "cache_hit", "cache_status", "probe_steps", "winner",
                                                    "cache_key")}
            opt2.close()
        opt.close()
        out["runs"][name] = run
    return out


def test_fsdp2_cpu_offload_tunes_agrees_caches_and_stays_bitwise(tmp_path: Path) -> None:
    cache, trace = tmp_path / "cache.json", tmp_path / "trace"
    results = run_workers(_worker, world_size=2, kwargs={"cache_path": str(cache), "trace_dir": str(trace)},
                          timeout_s=240)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)
    runs = [r.value["runs"] for r in results]
    for name in runs[0]:
        for rank, by_rank in enumerate(runs):
            run = by_rank[name]
            where = f"{name} rank {rank}: {run}"
            assert run["mismatch_steps"] == [] and run["states_equal"], where
            # Every rank applied every rung of the ladder (capped at its own plan of 4) ...
            assert run["threads_used"] == [1, 2, 4], where
            # ... and all lock in the node optimum, not what either rank alone would pick.
            assert run["state"] == "locked" and run["winner"] == {"threads": 2}, where
        assert runs[0][name]["cache_key"] == runs[1][name]["cache_key"] or runs[1][name]["cache_key"] is None
    keys = {name: runs[0][name]["cache_key"] for name in runs[0]}
    assert len(set(keys.values())) == 3, keys  # class and implementation flags split the cache
    fused = [by_rank["adamw-fused"] for by_rank in runs]
    for rank, run in enumerate(fused):
        assert run["cache_status"] == "miss", run
        assert run["dcp_equal"] and run["dcp_fqns"] == ["0.bias", "0.weight", "2.bias", "2.weight", "3.bias",
                                                        "3.weight"], run
        assert run["resumed_equal"], run
        second = run["second"]
        assert second["state"] == "locked" and second["cache_hit"] and second["probe_steps"] == 0, (rank, second)
        assert second["winner"] == {"threads": 2}
    assert cache.is_file() and (trace / "run-1" / "summary.json").is_file()  # its run folder
