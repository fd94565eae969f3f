"""Shared fixtures: a tiny language model shaped to expose chunking and hook corner cases."""

from __future__ import annotations

import os

# Before torch loads OpenMP, which reads it then: idle OpenMP threads sleep instead of spinning.
# CI runs two pytest workers on two cores (``-n 2``) beside tests that start ranks and worker
# threads of their own; spinning threads of one then burn the cores another needs (a subset of
# the fast tests took 134 s instead of 29 s on the loaded 2-core machine). It changes no result.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import copy
import itertools
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, HIDDEN = 37, 48, 133  # odd sizes: every weight has a scalar tail in the fused kernel


class TinyLM(nn.Module):
    """Embedding tied to the output head, an MLP with odd widths, a LayerNorm, a block run twice
    per backward (inside a reentrant checkpoint and directly: its hooks fire twice), a layer used
    only on some steps and a layer never used (no gradient ever)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.twice = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.sometimes = nn.Linear(DIM, 5)
        self.unused = nn.Linear(5, 3)

    def forward(self, tokens: torch.Tensor, *, use_sometimes: bool = False) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        h = h + checkpoint(self.twice, h, use_reentrant=True) + self.twice(h)
        logits = self.head(self.norm(h)).float()
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens.roll(-1, dims=1).reshape(-1))
        if use_sometimes:
            loss = loss + self.sometimes(h).float().pow(2).mean()
        return loss


def make_model(dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM().to(device=device, dtype=dtype)


def param_groups(model: nn.Module) -> list[dict]:
    """Three groups with different lr and weight decay: matrices, vectors, and the layers that
    get a gradient only sometimes or never (so they do not share chunks with the others)."""
    named = list(model.named_parameters())
    rare = [p for n, p in named if n.startswith(("sometimes.", "unused."))]
    decay = [p for n, p in named if p.dim() >= 2 and not any(p is r for r in rare)]
    rest = [p for n, p in named if p.dim() < 2 and not any(p is r for r in rare)]
    return [
        {"params": decay, "lr": 3e-3, "weight_decay": 0.1},
        {"params": rest, "lr": 1e-3, "weight_decay": 0.0},
        {"params": rare, "lr": 2e-3, "weight_decay": 0.05},
    ]


def batch(step: int, micro: int = 0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, VOCAB, (4, 9), generator=g).to(device)


def uses_sometimes(step: int) -> bool:
    return step % 3 == 1


def clone_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def assert_bitwise(actual: list[torch.Tensor], expected: list[torch.Tensor], what: str) -> None:
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        a, e = a.detach().cpu(), e.detach().cpu()
        assert a.dtype == e.dtype and a.shape == e.shape, f"{what}[{i}]: {a.dtype}{tuple(a.shape)}"
        if not torch.equal(a, e):
            diff = (a.float() - e.float()).abs()
            raise AssertionError(
                f"{what}[{i}] differs in {int((a != e).sum())}/{a.numel()} elements "
                f"(max abs diff {diff.max().item():.3e})"
            )


@pytest.fixture(scope="module")
def kernel() -> object:
    """The native extension (fused-mp AdamW, its fp32 entry and grad_stats), built on first use:
    about 20 s on 2 cores, then reused from the build directory. Skips where there is no C++
    compiler or ninja; fails where the build itself fails: a broken kernel on a machine that can
    build it is a defect, not a skip."""
    from offload.kernels._fused_mp import fused_mp_available, process_loader

    ok, reason = fused_mp_available()
    if not ok:
        if reason.startswith(("no C++ compiler", "ninja is not installed")):
            pytest.skip(f"the native kernel needs a C++ toolchain: {reason}")
        pytest.fail(f"the native kernel failed to build on a machine with a toolchain: {reason}")
    module, _ = process_loader().get()
    return module


@pytest.fixture(scope="session")
def kernel_build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where subprocesses that set their own ``XDG_CACHE_HOME`` (the README's and
    docs/integrations.md's examples, DeepSpeed's JIT ops) build native code: the caller's
    ``TORCH_EXTENSIONS_DIR``, else one directory for the session in which the native kernel's
    build directory is a link to the one this process builds it in, so they reuse the ``kernel``
    fixture's build (keyed by source, path, torch, compiler and flags: a build of their own cost
    ~30 s in CI, one per example ~33 s each before that). DeepSpeed's builds, named without such
    a key, stay in the session's directory."""
    import os

    from offload.kernels._build import build_spec

    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given:
        return Path(given)
    ext = tmp_path_factory.mktemp("ext")
    shared = build_spec().build_dir
    shared.mkdir(parents=True, exist_ok=True)
    (ext / shared.name).symlink_to(shared, target_is_directory=True)
    return ext


@pytest.fixture(scope="module")
def single_threaded_main():
    """Tiny models: intra-op threads in the test's own thread only add contention on a loaded
    2-core machine (tens of ms per forward). The optimizer's worker keeps its own setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def isolated_trainer(monkeypatch: pytest.MonkeyPatch):
    """``bench.train._main.main`` in this process: no inherited thread or local-world overrides, and the
    process-wide intra-op thread count the trainer sets is restored afterwards."""
    monkeypatch.delenv("OFFLOAD_AUTOTUNE_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def train_summary(out: Path, *args: str) -> dict:
    """Run ``bench.train`` in this process with ``args`` and return its ``--summary-json``."""
    from bench.train import _main as train

    assert train.main([*args, "--summary-json", str(out)]) == 0
    return json.loads(out.read_text())


def fake_fingerprint(*, workload: Any, space: Any, local_world_size: int) -> Any:
    """A tuner fingerprint keyed by the space alone (tests of the lock-in, no machine facts)."""
    return SimpleNamespace(key=f"key-{space.digest()}", details={"space": space.to_dict()})


def lock_in(space: Any, baseline: dict[str, Any], cost: Callable[[dict[str, Any]], float], *,
            max_steps: int = 200) -> tuple[Any, int]:
    """A real ``OnlineTuner`` over ``space``, fed the injected step time ``cost(setting)`` of the
    setting it applied, until it locks in (at most ``max_steps``); returns (tuner, steps taken)."""
    from autotune import AutotuneConfig, OnlineTuner, StepSample

    current: dict[str, Any] = {}
    tuner = OnlineTuner(space, baseline=baseline, apply=current.update, config=AutotuneConfig(),
                        workload={"params": 1}, clock=itertools.count().__next__, fingerprint=fake_fingerprint)
    tuner.start()
    steps = 0
    while tuner.state != "locked" and steps < max_steps:
        tuner.observe(StepSample(time_s=cost(current), stages={}, spans=()))
        steps += 1
    return tuner, steps


def until_locked(tuning: Any, *, max_steps: int = 100) -> dict[str, Any]:
    """Call an ``OffloadTuning``'s ``after_step`` until its tuner locks in; its summary."""
    for _ in range(max_steps):
        tuning.after_step()
        if tuning.tuner.state == "locked":
            break
    return tuning.tuner.summary()


class FakeTunable:
    """What ``offload.tuning._glue.OffloadTuning`` sees of ``CPUOffloadAdamW`` (``Tunable``): the
    settings in force, every ``apply_settings``, and a step of 0.8 s where ``fast(settings)``, else
    1.0 s (the injected measurement)."""

    def __init__(self, settings: Any, fast: Callable[[Any], bool]) -> None:
        self.settings = settings
        self.applied: list[Any] = []
        self._fast = fast

    @property
    def last_stats(self) -> Any:
        from offload import StepStats

        step_s = 0.8 if self._fast(self.settings) else 1.0
        return StepStats(step_s=step_s, d2h_s=0.0, adam_kernel_s=0.0, materialize_s=0.0, drain_s=0.0,
                         threads=self.settings.threads, chunk_numel=self.settings.chunk_numel, num_chunks=1,
                         numel=1024)

    def apply_settings(self, settings: Any) -> None:
        self.settings = settings
        self.applied.append(settings)

