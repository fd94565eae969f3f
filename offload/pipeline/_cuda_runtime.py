"""The CUDA runtime calls behind ``TorchCudaOps``' pinned blocks, in one object a test replaces.

torch binds ``cudaHostRegister`` and ``cudaHostUnregister`` (``torch.cuda.cudart()``) and hands
back their error without clearing it (``C10_CUDA_ERROR_HANDLED`` is a no-op), and it binds no
``cudaGetLastError`` (torch 2.13's ``torch/csrc/cuda/shared/cudart.cpp``). So a failed
registration leaves the calling thread's last CUDA error set, and the next kernel that thread
launches fails in torch's launch check (``C10_CUDA_KERNEL_LAUNCH_CHECK`` reads
``cudaGetLastError``) with an error about host registration, after the fallback to torch's
pinned allocator worked. :meth:`CudaRuntime.get_last_error` calls ``cudaGetLastError`` in the
libcudart this process has loaded (torch's: the same per-thread error state), through ctypes,
which returns the error and clears it. ``TorchCudaOps`` calls it after every failed call here.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
from torch import Tensor

__all__ = ["CudaRuntime"]


@functools.lru_cache(maxsize=1)
def _loaded_cudart() -> Any:
    """The libcudart mapped into this process (torch's), as a ctypes library; ``OSError`` where
    none is (a CUDA runtime linked statically into torch cannot be reached from Python)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {parts[5].strip() for parts in (line.split(maxsplit=5) for line in maps) if len(parts) == 6}
    except OSError as exc:
        raise OSError(f"cannot read /proc/self/maps to find the loaded libcudart: {exc}") from exc
    loaded = sorted(p for p in paths if p.rsplit("/", 1)[-1].startswith("libcudart.so"))
    if not loaded:
        raise OSError("no libcudart.so is loaded in this process (torch's CUDA runtime linked statically?)")
    lib = ctypes.CDLL(loaded[0])  # already loaded: the same library, not a second runtime
    lib.cudaGetLastError.restype = ctypes.c_int
    lib.cudaGetLastError.argtypes = []
    return lib


class CudaRuntime:
    """The CUDA runtime calls ``TorchCudaOps`` makes for pinned host memory (``TorchCudaOps(runtime=)``;
    tests pass a subclass that records them and fails on demand). Errors are the
    ``torch.cuda.cudart()`` binding's values (``int(err) == 0``: success), except
    :meth:`get_last_error`'s, an int."""

    def host_register(self, ptr: int, nbytes: int) -> Any:
        """``cudaHostRegister(ptr, nbytes, 0)`` (portable with unified addressing)."""
        return torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)

    def host_unregister(self, ptr: int) -> Any:
        """``cudaHostUnregister(ptr)``."""
        return torch.cuda.cudart().cudaHostUnregister(ptr)

    def error_string(self, err: Any) -> str:
        """``cudaGetErrorString(err)`` for an error :meth:`host_register` or :meth:`host_unregister` returned."""
        return str(torch.cuda.cudart().cudaGetErrorString(err))

    def get_last_error(self) -> int:
        """``cudaGetLastError()``: the calling thread's last CUDA error, which it clears (0: none);
        ``OSError`` where the loaded runtime cannot be reached (see the module doc)."""
        return int(_loaded_cudart().cudaGetLastError())

    def pinned_empty(self, nbytes: int) -> Tensor:
        """``nbytes`` uint8 from torch's pinned allocator (the fallback where registration fails)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
