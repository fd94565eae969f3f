"""torch.distributed plumbing for the reference trainer: setup, gradient averaging, gathers.

Why a manual all-reduce and not ``DistributedDataParallel``: the offloaded optimizer can start a
chunk's update during backward (``--overlap-backward``) from its own gradient hooks. Under DDP
those hooks would see each rank's local, not yet averaged gradients. Averaging all gradients in
one flat bucket after backward keeps "every rank's optimizer sees identical gradients" true by
construction, keeps communication out of the optimizer's measured step, and costs only the
overlap of communication with backward, which this benchmark trainer does not need.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist

from autotune import knobs

logger = logging.getLogger(__name__)

__all__ = ["DistInfo", "setup", "teardown", "average_gradients", "average_scalar", "gather_objects",
           "param_checksum"]

#: Generous: a tiny CPU run on a loaded 2-core machine can leave one rank far behind.
_TIMEOUT = _dt.timedelta(minutes=10)


@dataclass(frozen=True, kw_only=True, slots=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str | None
    """None when running as a single process without torch.distributed."""

    @property
    def enabled(self) -> bool:
        return self.backend is not None


def setup(device: torch.device, *, group: bool = False) -> DistInfo:
    """Join the process group when launched by torchrun (``LOCAL_WORLD_SIZE`` set), else single process.

    The backend is gloo on CPU and nccl on CUDA; on CUDA each rank uses device ``LOCAL_RANK``.
    ``group``: a single process still gets a default group (world size 1, in-process store),
    which FSDP2's ``fully_shard`` needs.
    """
    local_world = knobs.local_world_size()
    if local_world is None:
        if not group:
            return DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, backend=None)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1)
        return DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1,
                        backend=dist.get_backend())
    local_rank = knobs.local_rank() or 0
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=_TIMEOUT)
    return DistInfo(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
        local_world_size=local_world, backend=dist.get_backend(),
    )


def teardown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def average_gradients(params: Iterable[torch.nn.Parameter], world_size: int) -> None:
    """All-reduce every ``.grad`` as one flat bucket per dtype and divide by ``world_size``.

    Ranks reduce the same bytes in the same order, so every rank gets bitwise identical gradients.
    """
    if world_size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(world_size)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n


def average_scalar(value: float, info: DistInfo, device: torch.device) -> float:
    if not info.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / info.world_size


def gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """``all_gather_object`` (every rank gets every rank's object); ``[obj]`` without a group."""
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def param_checksum(params: Iterable[torch.Tensor]) -> str:
    """SHA-256 over the raw bytes of every tensor (a DTensor's local shard), in order: equal iff bitwise equal."""
    h = hashlib.sha256()
    for p in params:
        t = p.detach()
        if hasattr(t, "to_local"):  # DTensor (FSDP2): this rank's shard
            t = t.to_local()
        t = t.reshape(-1).contiguous().cpu()
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
