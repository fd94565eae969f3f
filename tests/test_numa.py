"""NUMA placement of the optimizer state: the node decision on injected topologies, the bind on a
fake sysfs tree, and the optimizer's bind-then-first-touch order (values unchanged)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from conftest import assert_bitwise

from offload import CPUOffloadAdamW, OffloadSettings
from offload.threads._numa import bind_rank_numa_node, numa_node_for

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


def test_optimizer_binds_before_allocating_and_first_touches_on_its_worker() -> None:
    binds: list[str] = []

    def bind(device):
        binds.append(str(device))
        return bind_rank_numa_node(device)

    torch.manual_seed(0)
    params = [torch.randn(n, requires_grad=True) for n in (1000, 37, 4097)]
    reference = [p.detach().clone().requires_grad_(True) for p in params]
    opt = CPUOffloadAdamW(params, lr=1e-2, settings=OffloadSettings(threads=2, bind_numa=True),
                          numa_binder=bind)
    placement = opt.numa_placement
    assert binds == ["cpu"] and placement is not None and placement.device == "cpu"
    assert placement.order == ["bind", "allocate", "first-touch"]
    assert placement.zeroed_at_allocation is False
    assert placement.touch_thread.startswith("offload-adamw-") and placement.touch_threads == 2
    assert placement.touch_thread != threading.main_thread().name
    ref = torch.optim.AdamW(reference, lr=1e-2, fused=True)
    for step in range(3):
        for p, r in zip(params, reference):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            p.grad, r.grad = g, g.clone()
        opt.step()
        ref.step()
    assert_bitwise(params, reference, "params")
    opt.close()


def test_without_bind_numa_nothing_is_placed() -> None:
    opt = CPUOffloadAdamW([torch.randn(10, requires_grad=True)])
    assert opt.numa_placement is None
    opt.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs an affinity mask of >= 2 CPUs")
def test_close_restores_the_affinity_bind_numa_narrowed(tmp_path: Path) -> None:
    mask = frozenset(os.sched_getaffinity(0))
    keep = sorted(mask)[1:]  # node 1 holds all but one CPU of the mask
    _fake_nodes(tmp_path, {0: str(min(mask)), 1: ",".join(map(str, keep))})
    opt = CPUOffloadAdamW([torch.randn(100, requires_grad=True)],
                          settings=OffloadSettings(threads=1, bind_numa=True),
                          numa_binder=lambda device: bind_rank_numa_node(device, root=tmp_path))
    try:
        binding = opt.numa_placement.binding
        assert binding.bound and binding.cpus < mask  # narrowed to one node's CPUs
        assert frozenset(os.sched_getaffinity(0)) == binding.cpus
    finally:
        opt.close()
    assert frozenset(os.sched_getaffinity(0)) == mask
    opt.close()  # idempotent
    assert frozenset(os.sched_getaffinity(0)) == mask


def test_bind_numa_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="bind_numa=1: expected None or a bool"):
        OffloadSettings(bind_numa=1)  # type: ignore[arg-type]


def test_trainer_numa_flag_binds_and_keeps_the_math(tmp_path: Path, monkeypatch) -> None:
    """``bench.train --numa-bind``: the optimizer gets ``bind_numa=True``; same parameters."""
    import json

    from bench.train import _main as train

    import offload

    seen: list[bool] = []

    class Spy(CPUOffloadAdamW):  # the trainer's optimizer, with what its NUMA placement did
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            placement = self.numa_placement
            seen.append(placement is not None and placement.order[0] == "bind")

    monkeypatch.setattr(offload, "CPUOffloadAdamW", Spy)
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
