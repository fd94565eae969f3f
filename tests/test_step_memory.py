"""Host state per parameter, no gradient kept alive, and kernel calls described once per chunk."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import batch, make_model, param_groups

from offload import CPUOffloadAdamW, OffloadSettings
from offload.state._slabs import _ALIGN


def _padded(model: torch.nn.Module) -> int:
    return sum(-(-p.numel() // _ALIGN) * _ALIGN for p in model.parameters())


@pytest.mark.parametrize(
    ("dtype", "overlap", "bytes_per_param"),
    [(torch.float32, False, 8), (torch.bfloat16, False, 12), (torch.float32, True, 8)],
)
def test_host_slabs_hold_the_state_and_no_gradient(dtype, overlap, bytes_per_param) -> None:
    """CPU fp32: the parameter is its own master (8 B: the moments); bf16: fp32 master + moments
    (12 B); with overlap_backward too (its second generation is counted apart,
    tests/test_overlap_memory.py). No full-size gradient slab in any case."""
    model = make_model(dtype)
    opt = CPUOffloadAdamW(param_groups(model), settings=OffloadSettings(chunk_numel=1024),
                          overlap_backward=overlap)
    assert opt._layout.slabs.nbytes <= bytes_per_param * _padded(model)
    assert opt._layout.slabs.nbytes >= bytes_per_param * sum(p.numel() for p in model.parameters())
    model(batch(0)).backward()
    opt.step()
    sd = opt.state_dict()
    assert all(("master_param" in s) == (dtype != torch.float32) for s in sd["state"].values())  # torch's keys; a master only where the weight cannot hold it
    opt.close()


def test_step_keeps_no_gradient_alive() -> None:
    model = make_model()
    opt = CPUOffloadAdamW(param_groups(model), settings=OffloadSettings(chunk_numel=1024))
    for step in range(2):
        model(batch(step)).backward()
        opt.step()
        refs = [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]
        opt.zero_grad(set_to_none=True)
        gc.collect()
        assert refs and all(r() is None for r in refs), "the optimizer still holds gradients"
    opt.close()


def test_items_and_kernel_calls_are_made_once_per_chunk_layout() -> None:
    """A later step reuses each chunk's Items and prepared call templates (per-step Python does not
    rebuild per-tensor descriptions); a new chunk layout makes new ones. Values stay torch's."""
    torch.manual_seed(0)
    params = [torch.randn(n, requires_grad=True) for n in (5, 700, 3000, 64, 1)]
    reference = [p.detach().clone().requires_grad_(True) for p in params]
    opt = CPUOffloadAdamW(params, lr=1e-2, settings=OffloadSettings(chunk_numel=1024))
    ref = torch.optim.AdamW(reference, lr=1e-2, fused=True)
    held = []  # the snapshots' objects stay alive, so their ids cannot be reused

    def snapshot():
        items = dict(opt._layout.items.entries)
        prepared = dict(opt._pipeline.calls.templates)
        held.append((items, prepared))
        return ({i: id(c.items) for i, c in items.items()}, {i: id(e.calls) for i, e in prepared.items()})

    for step in range(4):
        if step == 3:
            opt.apply_settings(OffloadSettings(chunk_numel=2048))
        for p, r in zip(params, reference):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            p.grad, r.grad = g, g.clone()
        opt.step()
        ref.step()
        if step == 1:
            first = snapshot()
        if step == 2:
            assert first[0] and first == snapshot()
    assert set(snapshot()[0].values()).isdisjoint(first[0].values())
    assert all(torch.equal(p, r) for p, r in zip(params, reference))
    opt.close()
