"""fingerprint(): deterministic across processes, sensitive to everything that moves the optimum."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from autotune import Fingerprint, fingerprint
from autotune.cache._fingerprint import canonical_json, hardware_details, software_details

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = {"params": 1_234_567, "dtypes": ["torch.bfloat16", "torch.float32"]}
SPACE = {"threads": [1, 2, 4], "chunk_numel": [1 << 20, 1 << 22]}


class SpaceWithToDict:
    def to_dict(self) -> dict:
        return dict(SPACE)


def fp(**overrides) -> Fingerprint:
    kwargs = {"workload": WORKLOAD, "space": SPACE, "local_world_size": 2, **overrides}
    return fingerprint(**kwargs)


def test_same_inputs_same_key_and_details() -> None:
    a, b = fp(), fp()
    assert a.key == b.key and a == b and hash(a) == hash(b)
    assert len(a.key) == 64 and int(a.key, 16) >= 0
    assert a.details == b.details
    # details are plain JSON and the key is their SHA-256
    import hashlib

    assert hashlib.sha256(canonical_json(a.details).encode()).hexdigest() == a.key
    hw = a.details["hardware"]
    for field in ("cpu_model", "physical_cores", "logical_cores", "affinity_cpus", "numa_nodes", "memory_gib"):
        assert field in hw, field
    assert hw["logical_cores"] == psutil.cpu_count(logical=True)
    assert hw["affinity_cpus"] == len(os.sched_getaffinity(0))
    assert set(hw["accelerator"]) == {"name", "count"}  # accelerator name and count
    # (plus "environment" where OMP_*, KMP_*, GOMP_* or MALLOC_* are set, as conftest sets
    # OMP_WAIT_POLICY: test_step_environment_variables_split_the_key_and_none_keep_the_old_one)
    assert set(a.details["software"]) - {"environment"} == {"python", "torch", "optuna", "numpy", "package"}
    assert a.details["local_world_size"] == 2
    assert a.details["workload"] == WORKLOAD
    assert a.details["space"] == json.loads(json.dumps(SPACE))


def test_key_does_not_depend_on_mapping_order_or_container_type() -> None:
    reordered = {"dtypes": ("torch.bfloat16", "torch.float32"), "params": 1_234_567}
    assert fp(workload=reordered).key == fp().key
    assert fp(space=SpaceWithToDict()).key == fp().key


@pytest.mark.parametrize(
    "change",
    [
        {"local_world_size": 1},
        {"local_world_size": 8},
        {"workload": {**WORKLOAD, "params": 1_234_568}},
        {"workload": {**WORKLOAD, "dtypes": ["torch.float32"]}},
        {"space": {**SPACE, "threads": [1, 2]}},
        {"extra": {"tag": "experiment-7"}},
    ],
    ids=["lws1", "lws8", "params", "dtypes", "space", "extra"],
)
def test_workload_and_job_changes_change_the_key(change: dict) -> None:
    assert fp(**change).key != fp().key


@pytest.mark.parametrize(
    "field, value",
    [
        ("cpu_model", "Some Other CPU"),
        ("physical_cores", 96),
        ("logical_cores", 192),
        ("affinity_cpus", 12),
        ("numa_nodes", 4),
        ("memory_gib", 2048),
        ("accelerator", {"name": "NVIDIA H200", "count": 8}),
    ],
)
def test_every_hardware_field_is_in_the_key(field: str, value: object) -> None:
    base = fp().key
    real = hardware_details()
    assert fp(hardware={**real, field: value}).key != base


@pytest.mark.parametrize("field", ["python", "torch", "optuna", "numpy", "package"])
def test_every_software_version_is_in_the_key(field: str) -> None:
    base = fp().key
    real = software_details()
    assert fp(software={**real, field: "0.0.0-other"}).key != base


def test_memory_is_rounded_so_small_fluctuations_keep_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 1 << 30
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=64 * gib - 50 * (1 << 20)))
    a = fp()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=64 * gib + 70 * (1 << 20)))
    b = fp()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=128 * gib))
    c = fp()
    assert a.details["hardware"]["memory_gib"] == 64
    assert a.key == b.key != c.key


def test_numa_nodes_counted_from_sysfs(tmp_path: Path) -> None:
    for name in ("node0", "node1", "node3", "possible", "online", "has_cpu"):
        (tmp_path / name).mkdir()
    assert hardware_details(numa_root=tmp_path)["numa_nodes"] == 3
    assert hardware_details(numa_root=tmp_path / "absent")["numa_nodes"] == 1


def test_cpu_model_from_cpuinfo_with_fallback(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t: avx\n")
    assert hardware_details(cpuinfo=info)["cpu_model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert hardware_details(cpuinfo=tmp_path / "absent")["cpu_model"]  # platform fallback, never empty


def test_torch_dtypes_and_numpy_scalars_are_keyed() -> None:
    torch = pytest.importorskip("torch")
    import numpy as np

    a = fp(workload={"params": np.int64(1_234_567), "dtypes": [torch.bfloat16, torch.float32]})
    assert a.key == fp().key


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"local_world_size": 0}, ValueError),
        ({"local_world_size": True}, ValueError),
        ({"local_world_size": 2.0}, ValueError),
        ({"workload": [1, 2]}, TypeError),
        ({"workload": {"params": object()}}, TypeError),
        ({"workload": {"params": float("nan")}}, ValueError),
        ({"space": 42}, TypeError),
        ({"extra": "tag"}, TypeError),
        ({"hardware": "box"}, TypeError),
        ({"software": ["1.0"]}, TypeError),
    ],
)
def test_bad_arguments_raise_naming_the_value(kwargs: dict, error: type) -> None:
    with pytest.raises(error) as info:
        fp(**kwargs)
    name = next(iter(kwargs))
    assert name in str(info.value)


_CHILD = """
import json, sys
from autotune.cache._fingerprint import fingerprint
f = fingerprint(workload=json.loads(sys.argv[1]), space=json.loads(sys.argv[2]), local_world_size=2)
print(json.dumps({"key": f.key}))
"""


def test_key_is_identical_in_another_process_with_another_hash_seed() -> None:
    env = dict(os.environ, PYTHONHASHSEED="12345")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(WORKLOAD), json.dumps(SPACE)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
    )
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child["key"] == fp().key


def test_step_environment_variables_split_the_key_and_none_keep_the_old_one(monkeypatch) -> None:
    """OMP_*, KMP_*, GOMP_*, MALLOC_* change how a step runs: a setting tuned under one value is
    not reused under another. With none set, the software facts are those of earlier versions."""
    from autotune import fingerprint, knobs
    from autotune.cache._fingerprint import software_details

    for name in [k for k in os.environ if k.startswith(knobs.STEP_ENV_PREFIXES)]:
        monkeypatch.delenv(name)
    plain = software_details()
    assert "environment" not in plain
    args = {"workload": {"params": 10}, "space": {"threads": [1, 2]}, "local_world_size": 1, "hardware": {"cpu": "x"}}
    key0 = fingerprint(**args).key
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    details = software_details()
    assert details["environment"] == {"MALLOC_ARENA_MAX": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    key1 = fingerprint(**args).key
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert len({key0, key1, fingerprint(**args).key}) == 3


def test_the_masks_layout_and_the_kernel_source_are_in_the_offload_workload() -> None:
    from offload import plan_cpu_threads
    from offload.testing import CpuTopology
    from offload.tuning._glue import cache_facts

    topo = CpuTopology.from_cores([[i] for i in range(8)])
    shared = plan_cpu_threads(masks=[set(range(8))] * 2, local_rank=0, topology=topo, cpu_count=8)
    disjoint = plan_cpu_threads(masks=[set(range(4)), set(range(4, 8))], local_rank=0, topology=topo, cpu_count=8)
    assert cache_facts(shared, native=False) == {"masks": {"shared": True, "sizes": [8, 8]}}
    assert cache_facts(disjoint, native=False) == {"masks": {"shared": False, "sizes": [4, 4]}}
    digest = cache_facts(disjoint, native=True)["kernel_source"]
    assert isinstance(digest, str) and len(digest) == 16


def test_the_masks_per_numa_node_are_in_the_offload_workload() -> None:
    """Two ranks of 4 CPUs each, on a machine of two NUMA nodes of 4 CPUs: each rank inside its
    node, or both spread over the two nodes, are different optima and different keys; on one
    NUMA node the facts (and so the keys) stay what they were."""
    from offload import plan_cpu_threads
    from offload.testing import CpuTopology
    from offload.tuning._glue import cache_facts

    cores = [[i] for i in range(8)]
    two = CpuTopology.from_cores(cores, numa_nodes={0: range(4), 1: range(4, 8)})
    one = CpuTopology.from_cores(cores)
    inside = [set(range(4)), set(range(4, 8))]
    spread = [{0, 1, 4, 5}, {2, 3, 6, 7}]

    def facts(masks, topo):  # type: ignore[no-untyped-def]
        return cache_facts(plan_cpu_threads(masks=masks, local_rank=0, topology=topo, cpu_count=8), native=False)

    assert facts(inside, two)["masks"]["per_numa_node"] == [[4, 0], [0, 4]]
    assert facts(spread, two)["masks"]["per_numa_node"] == [[2, 2], [2, 2]]
    assert facts(inside, one) == facts(spread, one) == {"masks": {"shared": False, "sizes": [4, 4]}}
