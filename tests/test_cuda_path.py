"""The CUDA path (pinned staging, side streams, events) against a CPU fp32-master reference.

Runs standalone on a CUDA machine in well under a minute:
``python -m pytest -q tests/test_cuda_path.py`` (or ``python tests/test_cuda_path.py``).
"""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import assert_bitwise, batch, make_model, param_groups, uses_sometimes

from offload import CPUOffloadAdamW, OffloadSettings

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS = 12


class CpuMasterReference:
    """fp32 masters on the host updated by torch.optim.AdamW(fused=True) from the gradients the
    model produced (upcast); the expected model weight is the master cast to the model dtype."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = list(model.parameters())
        self.master = {p: p.detach().float().cpu().clone().requires_grad_(True) for p in self.params}
        groups = [
            {**g, "params": [self.master[p] for p in g["params"]]} for g in param_groups(model)
        ]
        self.opt = torch.optim.AdamW(groups, fused=True)

    def step(self, grads: list[torch.Tensor | None]) -> None:
        for p, g in zip(self.params, grads):
            self.master[p].grad = None if g is None else g.float().cpu()
        self.opt.step()

    def expected(self) -> list[torch.Tensor]:
        return [self.master[p].detach().to(p.dtype) for p in self.params]


def _run(dtype: torch.dtype, settings: OffloadSettings, *, overlap: bool, side_stream: bool) -> None:
    device = "cuda"
    model = make_model(dtype, device=device)
    ref = CpuMasterReference(model)
    opt = CPUOffloadAdamW(param_groups(model), settings=settings, overlap_backward=overlap)
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    early, registered = [], []
    transport = opt._pipeline.transport
    with torch.cuda.stream(stream):
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            with opt.accumulating():
                (model(batch(step, 1, device), use_sometimes=uses_sometimes(step)) / 2).backward()
            (model(batch(step, 0, device), use_sometimes=uses_sometimes(step)) / 2).backward()
            grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
            opt.step()
            # enqueued right after step() on the same stream, with no host sync in between:
            # must already see the updated weights (last_stats, read only after it, waits on the
            # host for the step's weight copies and would hide a missing stream order)
            seen = [p.detach().clone() for p in model.parameters()]
            early.append(opt.last_stats.speculated_chunks)
            registered.append(opt.last_stats.pinned_registrations)
            ref.step(grads)
            assert_bitwise(seen, ref.expected(), f"params after step {step}")
    torch.cuda.synchronize()

    stats = opt.last_stats
    assert stats is not None
    assert stats.d2h_s > 0 and stats.adam_kernel_s > 0 and stats.materialize_s > 0
    assert 0 <= stats.drain_s <= stats.step_s
    by_chunk: dict[int, dict[str, tuple[float, float]]] = {}
    for s in stats.spans:
        assert s.start_s <= s.end_s
        by_chunk.setdefault(s.chunk, {})[s.stage] = (s.start_s, s.end_s)
    for stages in by_chunk.values():
        if "d2h" in stages:
            assert stages["d2h"][1] <= stages["adam_kernel"][0]
        if "adam_kernel" in stages and "materialize" in stages:
            assert stages["adam_kernel"][1] <= stages["materialize"][0]
    if overlap:
        assert early[0] == 0 and all(n > 0 for n in early[1:]), early
    else:  # host memory: the state and the chunk-sized rings, no place per parameter
        assert transport._lowp.places == 0
    # pinned blocks: registered in the first steps of the layout (the second is the first in which
    # the sometimes-used layer has a gradient: a larger chunk, places of its own), never after
    assert registered[0] > 0 and registered[2:] == [0] * (STEPS - 2), registered
    assert stats.pinned_bytes == transport.pinned.nbytes > 0
    numel = sum(p.numel() for p in model.parameters())
    assert opt._layout.slabs.nbytes <= 12 * numel + 3 * 64 * 4 * len(list(model.parameters()))
    opt.close()
    assert transport.pinned.nbytes == 0 and not transport._ops._blocks, "close() left pinned blocks registered"


@pytest.mark.parametrize("kernel", ["torch", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_numel", [1024, 1 << 20])
def test_cuda_step_matches_cpu_master_reference(dtype: torch.dtype, chunk_numel: int, kernel: str) -> None:
    _run(dtype, OffloadSettings(threads=2, chunk_numel=chunk_numel, kernel=kernel),  # type: ignore[arg-type]
         overlap=False, side_stream=False)


@pytest.mark.parametrize("kernel", ["torch", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_overlap_backward_matches_cpu_master_reference(dtype: torch.dtype, kernel: str) -> None:
    _run(dtype, OffloadSettings(threads=2, chunk_numel=1500, kernel=kernel),  # type: ignore[arg-type]
         overlap=True, side_stream=False)


def test_cuda_on_a_non_default_current_stream() -> None:
    _run(torch.bfloat16, OffloadSettings(threads=2, chunk_numel=1024), overlap=True, side_stream=True)


def test_cuda_state_dict_round_trip_resumes_bitwise() -> None:
    dtype, device = torch.bfloat16, "cuda"
    models = [make_model(dtype, device=device) for _ in range(2)]
    opts = [CPUOffloadAdamW(param_groups(m), settings=OffloadSettings(chunk_numel=1024)) for m in models]

    def train(i: int, steps: range) -> None:
        for step in steps:
            opts[i].zero_grad()
            models[i](batch(step, 0, device), use_sometimes=uses_sometimes(step)).backward()
            opts[i].step()

    train(0, range(8))
    train(1, range(4))
    sd = {k: v for k, v in opts[1].state_dict().items()}
    fresh = make_model(dtype, device=device, seed=5)
    fresh.load_state_dict(models[1].state_dict())
    opts[1].close()
    models[1] = fresh
    opts[1] = CPUOffloadAdamW(param_groups(fresh), settings=OffloadSettings(threads=1))
    opts[1].load_state_dict(sd)
    train(1, range(4, 8))
    torch.cuda.synchronize()
    assert_bitwise(list(models[1].parameters()), list(models[0].parameters()), "params")
    for opt in opts:
        opt.close()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
