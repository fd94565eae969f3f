"""NUMA placement of the optimizer state: the node decision on injected topologies, the bind on a
fake sysfs tree, and the optimizer's bind-then-first-touch order (values unchanged)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from conftest import assert_bitwise

import offload._threads as threads_mod
from offload import CPUOffloadAdamW, OffloadSettings
from offload._slabs import HostSlabs
from offload._threads import bind_rank_numa_node, numa_node_for

TWO_SOCKETS = ((0, frozenset(range(0, 16))), (1, frozenset(range(16, 32))))


@pytest.mark.parametrize(
    ("mask", "device_node", "expected"),
    [
        (range(0, 32), 1, 1),        # a GPU on socket 1: its node, whatever the mask
        (range(0, 4), 1, 1),         # ... even a mask on the other socket (the copies decide)
        (range(16, 24), None, 1),    # CPU only: the socket of the mask
        ([0, 1, 2, 16, 17], None, 0),  # the node with most of the mask
        (range(8, 24), None, 0),     # a tie: the lowest node
        ([40, 41], None, None),      # the mask meets no node
    ],
)
def test_node_decision_on_two_sockets(mask, device_node, expected) -> None:
    assert numa_node_for(mask=frozenset(mask), nodes=TWO_SOCKETS, device_node=device_node) == expected


def test_one_node_has_nothing_to_choose() -> None:
    one = ((0, frozenset(range(8))),)
    assert numa_node_for(mask=frozenset(range(8)), nodes=one, device_node=None) is None
    assert numa_node_for(mask=frozenset(range(8)), nodes=(), device_node=None) is None


def _fake_nodes(root: Path, nodes: dict[int, str]) -> None:
    for node, cpulist in nodes.items():
        path = root / f"sys/devices/system/node/node{node}/cpulist"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(cpulist + "\n")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs an affinity mask of >= 2 CPUs")
def test_cpu_rank_binds_to_the_node_of_most_of_its_mask_and_restores(tmp_path: Path) -> None:
    mask = frozenset(os.sched_getaffinity(0))
    keep = sorted(mask)[1:]  # node 1 holds all but one CPU of the mask
    _fake_nodes(tmp_path, {0: str(min(mask)), 1: ",".join(map(str, keep))})
    with bind_rank_numa_node("cpu", root=tmp_path) as binding:
        assert binding.bound and binding.node == (1 if len(keep) > 1 else 0)
        assert frozenset(os.sched_getaffinity(0)) == binding.cpus
    assert frozenset(os.sched_getaffinity(0)) == mask


def test_single_node_machine_is_a_no_op(tmp_path: Path) -> None:
    mask = frozenset(os.sched_getaffinity(0))
    _fake_nodes(tmp_path, {0: ",".join(map(str, sorted(mask)))})
    binding = bind_rank_numa_node("cpu", root=tmp_path)
    assert not binding.bound and binding.node is None and frozenset(os.sched_getaffinity(0)) == mask


def test_optimizer_binds_before_allocating_and_first_touches_on_its_worker(monkeypatch) -> None:
    events: list[tuple[str, object]] = []
    real_bind = threads_mod.bind_rank_numa_node
    real_init, real_touch = HostSlabs.__init__, HostSlabs.first_touch

    def bind(device=None, *, root="/"):
        events.append(("bind", str(device)))
        return real_bind(device, root=root)

    def init(self, *args, **kwargs):
        events.append(("alloc", kwargs.get("zero", True)))
        real_init(self, *args, **kwargs)

    def touch(self):
        events.append(("touch", (threading.current_thread().name.startswith("offload-adamw-"),
                                 torch.get_num_threads())))
        real_touch(self)

    monkeypatch.setattr(threads_mod, "bind_rank_numa_node", bind)
    monkeypatch.setattr(HostSlabs, "__init__", init)
    monkeypatch.setattr(HostSlabs, "first_touch", touch)
    torch.manual_seed(0)
    params = [torch.randn(n, requires_grad=True) for n in (1000, 37, 4097)]
    reference = [p.detach().clone().requires_grad_(True) for p in params]
    opt = CPUOffloadAdamW(params, lr=1e-2, settings=OffloadSettings(threads=2, bind_numa=True))
    assert events == [("bind", "cpu"), ("alloc", False), ("touch", (True, 2))]
    ref = torch.optim.AdamW(reference, lr=1e-2, fused=True)
    for step in range(3):
        for p, r in zip(params, reference):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            p.grad, r.grad = g, g.clone()
        opt.step()
        ref.step()
    assert_bitwise(params, reference, "params")
    opt.close()


def test_bind_numa_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="bind_numa=1: expected a bool"):
        OffloadSettings(bind_numa=1)  # type: ignore[arg-type]


def test_trainer_numa_flag_binds_and_keeps_the_math(tmp_path: Path, monkeypatch) -> None:
    """``bench.train --numa-bind``: the optimizer gets ``bind_numa=True``; same parameters."""
    import json

    from bench import train

    seen: list[bool] = []
    real = CPUOffloadAdamW._make_slabs

    def spy(self, settings, overlap_backward):
        seen.append(bool(settings is not None and settings.bind_numa))
        return real(self, settings, overlap_backward)

    monkeypatch.setattr(CPUOffloadAdamW, "_make_slabs", spy)
    threads = torch.get_num_threads()
    common = ["--model-size", "tiny", "--device", "cpu", "--batch-size", "4", "--seq-len", "32",
              "--dtype", "fp32", "--steps", "3", "--compute-threads", "1", "--optim-cpu-offload"]
    try:
        sums = []
        for extra in ([], ["--numa-bind"]):
            out = tmp_path / f"s{len(extra)}.json"
            assert train.main([*common, *extra, "--summary-json", str(out)]) == 0
            sums.append(json.loads(out.read_text()))
    finally:
        torch.set_num_threads(threads)
    assert seen == [False, True]
    assert sums[0]["ranks"][0]["param_sha256"] == sums[1]["ranks"][0]["param_sha256"]
