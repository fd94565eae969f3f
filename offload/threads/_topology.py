"""CPU topology of this machine: physical cores and their SMT siblings, NUMA nodes, cgroup quota.

Read from Linux sysfs and the cgroup filesystem under an injectable ``root`` (tests pass a fake
tree in ``tmp_path``); when sysfs has no topology, psutil's physical/logical core counts give an
average "physical cores per logical CPU" instead. :class:`CpuTopology` can also be built directly.

Nothing here changes process state; ``offload.threads._plan`` turns a topology and the local ranks'
affinity masks into a thread budget, and ``offload.threads._numa`` binds to a NUMA node.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Iterable, Literal, Mapping

logger = logging.getLogger(__name__)

__all__ = [
    "CgroupCpuLimit",
    "CpuTopology",
    "TopologyError",
    "format_cpulist",
    "normalize_pci_bus_id",
    "parse_cpulist",
    "read_affinity",
    "read_cgroup_cpu_limit",
    "read_cpu_topology",
    "read_numa_nodes",
    "read_pci_numa_node",
]

TopologySource = Literal["sysfs", "psutil", "manual"]

_CPU_DIR = re.compile(r"^cpu(\d+)$")
_NODE_DIR = re.compile(r"^node(\d+)$")


class TopologyError(ValueError):
    """A topology file or argument holds a value this module cannot use."""


def parse_cpulist(text: str, *, what: str = "cpulist") -> frozenset[int]:
    """Parse a Linux cpulist such as ``"0-3,8,10-11"`` (also ``"0-7:2"`` strides); ``""`` is empty.

    Raises :class:`TopologyError` naming ``what`` and the bad text.
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        match = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part)
        if match is None:
            raise TopologyError(f"Unable to parse {what} {text!r}: expected ranges like '0-3,8'")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        stride = int(match.group(3)) if match.group(3) is not None else 1
        if last < first or stride < 1:
            raise TopologyError(f"Unable to parse {what} {text!r}: bad range {part!r}")
        cpus.update(range(first, last + 1, stride))
    return frozenset(cpus)


def read_affinity() -> frozenset[int]:
    """The CPUs the calling thread may run on (``os.sched_getaffinity(0)``)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))  # pragma: no cover - non-Linux


def format_cpulist(cpus: Iterable[int]) -> str:
    """The inverse of :func:`parse_cpulist`: ``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True, kw_only=True, slots=True)
class CgroupCpuLimit:
    """A CPU bandwidth quota of the cgroup this process runs in."""

    cpus: float
    """Quota / period: how many CPUs' worth of time the cgroup may use (e.g. 2.5)."""
    cgroup: str
    """Which cgroup: ``"v2:/path"`` or ``"v1:/path"``; local ranks in the same cgroup share it."""

    @property
    def thread_cap(self) -> int:
        """Threads that fit the quota without throttling: ``floor(cpus)``, at least 1."""
        return max(1, math.floor(self.cpus))


@dataclass(frozen=True, kw_only=True, slots=True)
class CpuTopology:
    """Physical cores, SMT siblings and NUMA nodes of a machine.

    Tests build one directly: ``CpuTopology.from_cores([[0, 4], [1, 5]])`` is two physical cores
    with two hardware threads each.
    """

    cores: tuple[frozenset[int], ...] = ()
    """One entry per physical core: the logical CPUs (SMT siblings) that share it."""
    numa_nodes: tuple[tuple[int, frozenset[int]], ...] = ()
    """``(node id, cpus)`` per NUMA node, CPU-less nodes included with an empty set."""
    physical_per_logical: Fraction = Fraction(1)
    """For CPUs not listed in ``cores`` (no sysfs topology): physical cores per logical CPU,
    e.g. 1/2 with 2-way SMT (from psutil's counts). 1 when unknown or when SMT is off."""
    cgroup_limit: CgroupCpuLimit | None = None
    """The cgroup CPU quota, or None when there is none."""
    source: TopologySource = "manual"
    """Where the core list came from."""

    def __post_init__(self) -> None:
        seen: set[int] = set()
        for core in self.cores:
            if not core:
                raise TopologyError("CpuTopology.cores: expected non-empty sets of CPU ids")
            if seen & core:
                raise TopologyError(
                    f"CpuTopology.cores: CPUs {sorted(seen & core)} are listed in two cores; "
                    "expected each logical CPU in exactly one core"
                )
            seen |= core
        if not 0 < self.physical_per_logical <= 1:
            raise TopologyError(
                f"CpuTopology.physical_per_logical={self.physical_per_logical}: expected 0 < x <= 1"
            )

    @classmethod
    def from_cores(
        cls,
        cores: Iterable[Iterable[int]],
        *,
        numa_nodes: Mapping[int, Iterable[int]] | None = None,
        cgroup_cpus: float | None = None,
        cgroup: str = "v2:/",
    ) -> CpuTopology:
        """Build a topology from sibling lists, e.g. ``[[0, 4], [1, 5]]``."""
        limit = None if cgroup_cpus is None else CgroupCpuLimit(cpus=float(cgroup_cpus), cgroup=cgroup)
        nodes = tuple(sorted((int(n), frozenset(c)) for n, c in (numa_nodes or {}).items()))
        return cls(
            cores=tuple(sorted((frozenset(c) for c in cores), key=min)),
            numa_nodes=nodes,
            cgroup_limit=limit,
        )

    @property
    def smt(self) -> bool:
        """Whether some physical core has more than one logical CPU (or psutil says so)."""
        return any(len(c) > 1 for c in self.cores) or self.physical_per_logical < 1

    def core_of(self, cpu: int) -> frozenset[int] | None:
        """The sibling set containing ``cpu``, or None when the topology does not list it."""
        for core in self.cores:
            if cpu in core:
                return core
        return None

    def core_map(self) -> dict[int, frozenset[int]]:
        """``{cpu: its sibling set}`` for every listed CPU."""
        return {cpu: core for core in self.cores for cpu in core}

    def numa_nodes_of(self, cpus: Iterable[int]) -> tuple[int, ...]:
        """Ids of the NUMA nodes that contain at least one of ``cpus``."""
        wanted = frozenset(cpus)
        return tuple(node for node, node_cpus in self.numa_nodes if node_cpus & wanted)

    def node_cpus(self, node: int) -> frozenset[int] | None:
        """CPUs of NUMA node ``node`` (empty for a CPU-less node), None when the node is unknown."""
        for node_id, node_cpus in self.numa_nodes:
            if node_id == node:
                return node_cpus
        return None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError, PermissionError, IsADirectoryError):
        return None
    except OSError as exc:  # e.g. EIO on a half-offline CPU
        logger.debug("cannot read %s: %s", path, exc)
        return None


def _read_cores(root: Path) -> tuple[frozenset[int], ...]:
    cpu_root = root / "sys" / "devices" / "system" / "cpu"
    try:
        entries = sorted(os.listdir(cpu_root))
    except OSError:
        return ()
    cores: dict[frozenset[int], None] = {}
    for entry in entries:
        match = _CPU_DIR.match(entry)
        if match is None:
            continue
        topo = cpu_root / entry / "topology"
        # core_cpus_list is the modern name (Linux 5.6); thread_siblings_list the older one.
        text = _read_text(topo / "core_cpus_list")
        if text is None:
            text = _read_text(topo / "thread_siblings_list")
        if text is None:
            continue  # offline CPUs have no topology directory
        siblings = parse_cpulist(text, what=str(topo / "core_cpus_list"))
        siblings |= {int(match.group(1))}
        cores[siblings] = None
    # Merge overlapping sibling sets (a broken or half-offline tree) so cores partition the CPUs.
    merged: list[set[int]] = []
    for core in cores:
        touching = [m for m in merged if m & core]
        union = set(core).union(*touching)
        merged = [m for m in merged if not m & core] + [union]
    return tuple(sorted((frozenset(m) for m in merged), key=min))


def read_numa_nodes(root: Path | str = "/") -> tuple[tuple[int, frozenset[int]], ...]:
    """``(node id, cpus)`` for every NUMA node in ``root/sys/devices/system/node``."""
    node_root = Path(root) / "sys" / "devices" / "system" / "node"
    try:
        entries = os.listdir(node_root)
    except OSError:
        return ()
    nodes: list[tuple[int, frozenset[int]]] = []
    for entry in entries:
        match = _NODE_DIR.match(entry)
        if match is None:
            continue
        text = _read_text(node_root / entry / "cpulist")
        if text is None:
            continue
        nodes.append((int(match.group(1)), parse_cpulist(text, what=str(node_root / entry / "cpulist"))))
    return tuple(sorted(nodes))


def _cgroup_paths(root: Path) -> dict[str, str]:
    """``{"v2": path}`` and/or ``{"v1": path}`` (of the cpu controller) from /proc/self/cgroup."""
    text = _read_text(root / "proc" / "self" / "cgroup") or ""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hierarchy, controllers, path = fields
        if hierarchy == "0" and controllers == "":
            paths["v2"] = path
        elif "cpu" in controllers.split(","):
            paths["v1"] = path
    return paths


def _walk_up(base: Path, path: str) -> list[Path]:
    """``base/path``, its parents, up to ``base``; just ``[base]`` if ``base/path`` is not visible
    (a cgroup namespace shows the container's own cgroup as the mount root)."""
    rel = Path(path.lstrip("/"))
    start = base / rel
    if not start.is_dir():
        return [base]
    dirs = [start]
    while rel != Path("."):
        rel = rel.parent
        dirs.append(base / rel)
    return dirs


def _quota_v2(directory: Path) -> float | None:
    text = _read_text(directory / "cpu.max")
    if text is None:
        return None
    fields = text.split()
    if len(fields) < 1 or fields[0] == "max":
        return None
    try:
        quota = int(fields[0])
        period = int(fields[1]) if len(fields) > 1 else 100_000
    except ValueError:
        logger.warning("ignoring malformed %s: %r", directory / "cpu.max", text)
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def _quota_v1(directory: Path) -> float | None:
    quota_text = _read_text(directory / "cpu.cfs_quota_us")
    period_text = _read_text(directory / "cpu.cfs_period_us")
    if quota_text is None or period_text is None:
        return None
    try:
        quota, period = int(quota_text), int(period_text)
    except ValueError:
        logger.warning("ignoring malformed cgroup v1 quota in %s", directory)
        return None
    if quota <= 0 or period <= 0:  # -1 means "no quota"
        return None
    return quota / period


def read_cgroup_cpu_limit(root: Path | str = "/") -> CgroupCpuLimit | None:
    """The tightest CPU quota over this process's cgroup and its ancestors, or None.

    cgroup v2: ``cpu.max`` ("max 100000" or "250000 100000") under ``root/sys/fs/cgroup``;
    cgroup v1: ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` under ``root/sys/fs/cgroup/cpu``.
    The cgroup path comes from ``root/proc/self/cgroup``.
    """
    root = Path(root)
    base = root / "sys" / "fs" / "cgroup"
    paths = _cgroup_paths(root)
    best: CgroupCpuLimit | None = None

    def consider(cpus: float | None, key: str) -> None:
        nonlocal best
        if cpus is not None and (best is None or cpus < best.cpus):
            best = CgroupCpuLimit(cpus=cpus, cgroup=key)

    if "v2" in paths and (base / "cgroup.controllers").is_file():
        for directory in _walk_up(base, paths["v2"]):
            consider(_quota_v2(directory), f"v2:{paths['v2']}")
    if "v1" in paths:
        for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
            if (base / mount).is_dir():
                for directory in _walk_up(base / mount, paths["v1"]):
                    consider(_quota_v1(directory), f"v1:{paths['v1']}")
                break
    return best


def _psutil_physical_per_logical() -> Fraction:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        return Fraction(1)
    logical = psutil.cpu_count(logical=True)
    physical = psutil.cpu_count(logical=False)
    if not logical or not physical or physical >= logical:
        return Fraction(1)
    return Fraction(physical, logical)


def read_cpu_topology(root: Path | str = "/") -> CpuTopology:
    """Read this machine's topology from ``root`` (``"/"``; tests pass a fake tree).

    Cores come from ``sys/devices/system/cpu/cpu*/topology/core_cpus_list`` (or
    ``thread_siblings_list``); without them, psutil's physical/logical counts give an average
    ``physical_per_logical``. NUMA nodes from ``sys/devices/system/node/node*/cpulist``; the cgroup
    quota from :func:`read_cgroup_cpu_limit`.
    """
    root = Path(root)
    cores = _read_cores(root)
    ratio = Fraction(1)
    source: TopologySource = "sysfs"
    if not cores:
        ratio = _psutil_physical_per_logical()
        source = "psutil"
    return CpuTopology(
        cores=cores,
        numa_nodes=read_numa_nodes(root),
        physical_per_logical=ratio,
        cgroup_limit=read_cgroup_cpu_limit(root),
        source=source,
    )


def normalize_pci_bus_id(bus_id: str) -> str:
    """sysfs spelling of a PCI address: ``"00000000:3B:00.0"`` -> ``"0000:3b:00.0"``."""
    text = bus_id.strip().lower()
    match = re.fullmatch(r"([0-9a-f]{1,8}):([0-9a-f]{1,2}):([0-9a-f]{1,2})\.([0-7])", text)
    if match is None:
        raise TopologyError(f"Unable to use PCI bus id {bus_id!r}: expected 'dddd:bb:dd.f'")
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{function}"


def read_pci_numa_node(bus_id: str, root: Path | str = "/") -> int | None:
    """NUMA node of a PCI device from ``root/sys/bus/pci/devices/<bus id>/numa_node``.

    None when the file is missing or says -1 (the platform reports no NUMA locality).
    """
    path = Path(root) / "sys" / "bus" / "pci" / "devices" / normalize_pci_bus_id(bus_id) / "numa_node"
    text = _read_text(path)
    if text is None:
        return None
    try:
        node = int(text.strip())
    except ValueError:
        logger.warning("ignoring malformed %s: %r", path, text)
        return None
    return node if node >= 0 else None
