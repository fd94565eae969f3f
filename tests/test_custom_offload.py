"""An in-house CPU offload optimizer, tuned through ``TuningSession`` (issue 37, item 2).

:class:`ChunkedCPUAdamW` is in the shape of prime-rl's ``FullCPUOffloadOptimizer`` (not its code):
fp32 masters and moments in flat host buffers, a chunk-size constant, threads set with
``torch.set_num_threads``, torch's fused CPU AdamW per chunk, gradients copied in and weights
copied out. Its team would not swap it for ours, but it can let the tuner turn its two constants
(docs/integrations.md, "An in-house offload optimizer"). Checked here: every setting of the
space gives the same bits as ``torch.optim.AdamW(fused=True)``; two gloo ranks agree on one
setting and time each step as the slower of the two; a second run hits the cache. Step times are
injected (a clock per setting), so the decision is certain and no test depends on this machine's
speed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from _dist_util import run_workers
from torch import nn

from autotune import AutotuneConfig, Knob, SearchSpace, TuningSession

CHUNK_NUMEL = 1 << 14
"""The constant such an optimizer hard-codes (prime-rl: 16 Mi elements); here the baseline."""


class ChunkedCPUAdamW:
    """AdamW with fp32 master, exp_avg and exp_avg_sq in flat host buffers, stepped chunk by chunk
    with torch's fused CPU kernel. ``chunk_numel`` and ``threads`` change how fast, never what: a
    chunk boundary lands on a multiple of 1024 elements (torch's kernel rounds a tensor's scalar
    tail apart from its vector body, so chunks are cut at aligned offsets, as our optimizer does)."""

    def __init__(self, params: list[nn.Parameter], *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, chunk_numel: int = CHUNK_NUMEL,
                 threads: int | None = None) -> None:
        self.params = list(params)
        for p in self.params:
            if p.numel() % 1024:
                raise ValueError(f"a parameter of {p.numel()} elements: expected a multiple of 1024")
        self.hyper = {"lr": lr, "beta1": betas[0], "beta2": betas[1], "eps": eps, "weight_decay": weight_decay}
        self.master = torch.cat([p.detach().reshape(-1).float() for p in self.params])
        self.grads = torch.zeros_like(self.master)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.views = []
        start = 0
        for p in self.params:
            self.views.append(slice(start, start + p.numel()))
            start += p.numel()
        self.steps = 0
        self.chunk_numel = chunk_numel
        # prime-rl's rule: min(affinity, cpu_count // local_world_size)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.threads = threads or max(1, min(len(os.sched_getaffinity(0)), (os.cpu_count() or 1) // local))

    def apply(self, setting: dict[str, Any]) -> None:
        """The tuner's setting, between steps."""
        self.chunk_numel = setting["chunk_numel"]
        self.threads = setting["threads"]

    @torch.no_grad()
    def step(self) -> None:
        torch.set_num_threads(self.threads)
        self.steps += 1
        for p, v in zip(self.params, self.views):  # the "d2h" copy
            self.grads[v].copy_(p.grad.reshape(-1))
        step = torch.tensor(float(self.steps))
        for start in range(0, self.master.numel(), self.chunk_numel):
            part = slice(start, start + self.chunk_numel)
            torch._fused_adamw_([self.master[part]], [self.grads[part]], [self.exp_avg[part]],
                                [self.exp_avg_sq[part]], [], [step], amsgrad=False, maximize=False, **self.hyper)
        for p, v in zip(self.params, self.views):  # the "h2d" copy
            p.copy_(self.master[v].view_as(p))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


SPACE = SearchSpace((Knob("threads", (1, 2)), Knob("chunk_numel", (1 << 12, CHUNK_NUMEL, 1 << 16))))
BASELINE = {"threads": 1, "chunk_numel": CHUNK_NUMEL}
COST = {(1, 1 << 12): 9.0, (1, CHUNK_NUMEL): 8.0, (1, 1 << 16): 7.5,
        (2, 1 << 12): 6.0, (2, CHUNK_NUMEL): 4.0, (2, 1 << 16): 5.0}
"""Injected step times (ms) by (threads, chunk_numel): (2, CHUNK_NUMEL) is the fastest."""


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128, bias=False), nn.Tanh(), nn.Linear(128, 64, bias=False),
                         nn.Tanh(), nn.Linear(64, 32, bias=False))


def loss(m: nn.Module, step: int, rank: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    return m(torch.randn(8, 64, generator=g)).square().mean()


class Clock:
    """``TuningSession(clock=)``: a step of ``opt`` lasts ``cost[(threads, chunk_numel)]`` ms."""

    def __init__(self, opt: ChunkedCPUAdamW, cost: dict[tuple[int, int], float] = COST) -> None:
        self.opt, self.cost, self.t, self.inside = opt, cost, 0.0, False

    def __call__(self) -> float:
        if self.inside:
            self.t += self.cost[(self.opt.threads, self.opt.chunk_numel)] / 1e3
        self.inside = not self.inside
        return self.t


def train(opt: ChunkedCPUAdamW, m: nn.Module, steps: int, session: TuningSession | None = None,
          rank: int = 0) -> None:
    for i in range(steps):
        loss(m, i, rank).backward()
        if session is None:
            opt.step()
        else:
            session.step(opt.step)
        opt.zero_grad()


def test_every_setting_gives_torch_fused_adamw_bits() -> None:
    ref_model = model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, weight_decay=1e-2, fused=True)
    for i in range(6):
        loss(ref_model, i).backward()
        ref.step()
        ref.zero_grad()
    for threads, chunk in ((t, c) for t in SPACE.knobs[0].values for c in SPACE.knobs[1].values):
        m = model()
        opt = ChunkedCPUAdamW(list(m.parameters()), threads=threads, chunk_numel=chunk)
        train(opt, m, 6)
        for p, q in zip(m.parameters(), ref_model.parameters()):
            assert torch.equal(p, q), (threads, chunk)
        for v, q in zip(opt.views, ref_model.parameters()):
            assert torch.equal(opt.exp_avg[v].view_as(q), ref.state[q]["exp_avg"]), (threads, chunk)
            assert torch.equal(opt.exp_avg_sq[v].view_as(q), ref.state[q]["exp_avg_sq"]), (threads, chunk)


def test_tuned_it_locks_in_the_fastest_setting_and_a_second_run_hits_the_cache(tmp_path: Path) -> None:
    config = AutotuneConfig(cache_path=tmp_path / "cache.json", trace_dir=tmp_path / "runs")
    summaries = []
    for run in range(2):
        m = model()
        opt = ChunkedCPUAdamW(list(m.parameters()), threads=1)
        with TuningSession(SPACE, baseline=BASELINE, apply=opt.apply, config=config, clock=Clock(opt),
                           workload={"optimizer": "ChunkedCPUAdamW", "numel": opt.master.numel()}) as session:
            train(opt, m, 50, session)
        summaries.append(session.summary())
        assert (opt.threads, opt.chunk_numel) == (2, CHUNK_NUMEL)
        ref_model = model()  # and the bits are torch's, whatever it probed
        ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, weight_decay=1e-2, fused=True)
        for i in range(50):
            loss(ref_model, i).backward()
            ref.step()
            ref.zero_grad()
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), ref_model.parameters()))
    first, second = summaries
    assert first["state"] == "locked" and not first["cache_hit"] and first["winner"] == {"threads": 2,
                                                                                        "chunk_numel": CHUNK_NUMEL}
    assert second["cache_hit"] and second["probe_steps"] == 0 and second["winner"] == first["winner"]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir() if p.name.startswith("run-")) == ["run-1", "run-2"]


def _rank(rank: int, world_size: int, *, cache_path: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    m = model()
    opt = ChunkedCPUAdamW(list(m.parameters()), threads=1)
    # rank 1 runs 2 threads 3x slower (its cores are busy): the node's time is the slower rank's
    cost = {k: (v * 3 if k[0] == 2 and rank == 1 else v) for k, v in COST.items()}
    timer = Clock(opt, cost)
    config = AutotuneConfig(cache_path=cache_path, timeout_s=60.0)
    seen = []
    with TuningSession(SPACE, baseline=BASELINE, apply=opt.apply, config=config, clock=timer,
                       workload={"optimizer": "ChunkedCPUAdamW"}) as session:
        for i in range(50):
            loss(m, i, rank).backward()
            session.step(opt.step)
            opt.zero_grad()
            seen.append((opt.threads, opt.chunk_numel))
    ref_model = model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, weight_decay=1e-2, fused=True)
    for i in range(50):
        loss(ref_model, i, rank).backward()
        ref.step()
        ref.zero_grad()
    return {"seen": seen, "winner": session.summary()["winner"], "state": session.state,
            "exact": all(torch.equal(p, q) for p, q in zip(m.parameters(), ref_model.parameters()))}


def test_two_gloo_ranks_agree_and_the_slower_rank_sets_the_pace(tmp_path: Path) -> None:
    results = run_workers(_rank, world_size=2, kwargs={"cache_path": str(tmp_path / "cache.json")}, timeout_s=120)
    assert all(r.ok for r in results), [r.describe() for r in results]
    a, b = (r.value for r in results)
    assert a["seen"] == b["seen"], "every step runs the same setting on both ranks"
    assert a["state"] == b["state"] == "locked"
    # 2 threads run 3x slower on rank 1: on the node, 1 thread and 64 Ki elements is fastest
    assert a["winner"] == b["winner"] == {"threads": 1, "chunk_numel": 1 << 16}
    assert a["exact"] and b["exact"]
