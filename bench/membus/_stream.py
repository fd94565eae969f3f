"""Memory-bandwidth probes that move the same streams as an AdamW step, independent of any AdamW kernel.

An AdamW step over n fp32 elements reads four arrays (param, grad, exp_avg, exp_avg_sq) and
writes three of them back in place: 16 B read + 12 B written = 28 B per element. The probes run
the same read-4/write-3 in-place access pattern over buffers as large as the optimizer's slabs,
with trivial arithmetic, and report GB/s from the bytes they really move:

``c_4r3w``
    One pass of a C loop (compiled here with the system C compiler, threads with pthreads, no
    OpenMP runtime that could spin against torch's): per element it loads p, g, m, v and stores
    p, m, v. 28 B per element. Threads take 16 Ki-element blocks from a shared counter, like the
    fused-mp kernel's threads: with a fixed 1/threads share each, one thread delayed by another
    process on a shared machine held up the whole pass, and the probe then understated the
    bandwidth a kernel could reach.
    Skipped, with the reason recorded, if no C compiler works.
``torch_3pass``
    The cheapest torch expression of the same update, three in-place streaming ops over the
    whole buffers: ``m.lerp_(g)`` (reads m, g; writes m: 12 B), ``v.addcmul_(g, g)`` (reads v, g
    once per element, both operands are the same address; writes v: 12 B), ``p.addcmul_(m, v)``
    (reads p, m, v; writes p: 16 B). 40 B per element; every pass streams from DRAM because the
    buffers are far larger than the caches.

All writes are in place, so no write-allocate reads are hidden in the counts. Neither probe
touches torch's fused Adam kernel.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)

__all__ = ["PROBE_BYTES_PER_ELEMENT", "ProbeBuffers", "ProbeSample", "c_kernel_status"]

#: Bytes each probe really moves per element (see the module docstring).
PROBE_BYTES_PER_ELEMENT: dict[str, int] = {"c_4r3w": 28, "torch_3pass": 40}

_C_SOURCE = r"""
#include <pthread.h>
#include <stddef.h>

/* Elements a thread takes at a time, the block size of the fused-mp kernel's threads too. */
enum { BLOCK = 16384 };

typedef struct { float *p; const float *g; float *m; float *v; long n; long next; } job_t;

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
    float *restrict p = j->p; const float *restrict g = j->g;
    float *restrict m = j->m; float *restrict v = j->v;
    for (;;) {
        long lo = __atomic_fetch_add(&j->next, BLOCK, __ATOMIC_RELAXED);
        if (lo >= j->n) break;
        long hi = lo + BLOCK < j->n ? lo + BLOCK : j->n;
        for (long i = lo; i < hi; i++) {
            float gi = g[i];
            float mi = m[i] + 0.1f * (gi - m[i]);
            float vi = v[i] + 1e-3f * gi * gi;
            m[i] = mi;
            v[i] = vi;
            p[i] -= 1e-6f * mi * vi;
        }
    }
    return NULL;
}

/* Runs [0, n) on the calling thread and `threads - 1` fresh pthreads, which take blocks of
   BLOCK elements from a shared counter: a thread slowed by another process takes fewer blocks
   instead of holding up the whole pass. Returns 0, or -1 if a thread failed to start (the
   threads that did start, and the calling thread, still finish the pass). */
int stream_4r3w(float *p, const float *g, float *m, float *v, long n, int threads) {
    enum { MAXT = 1024 };
    pthread_t tid[MAXT];
    job_t job = {p, g, m, v, n, 0};
    if (threads < 1) threads = 1;
    if (threads > MAXT) threads = MAXT;
    int started = 0, rc = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tid[t], NULL, run, &job) != 0) { rc = -1; break; }
        started = t;
    }
    run(&job);
    for (int t = 1; t <= started; t++) pthread_join(tid[t], NULL);
    return rc;
}
"""


@functools.lru_cache(maxsize=1)
def _c_kernel() -> tuple[Callable[..., int] | None, str]:
    """(function, status); compiles once per process into a private temporary folder."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None, "no C compiler (cc, gcc, clang) on PATH"
    folder = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    src, lib = folder / "stream.c", folder / "libstream.so"
    src.write_text(_C_SOURCE, encoding="utf-8")
    cmd = [cc, "-O3", "-march=native", "-shared", "-fPIC", "-pthread", str(src), "-o", str(lib)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return None, f"compiling the C probe failed ({' '.join(cmd)}): {detail.strip()[:300]}"
    fn = ctypes.CDLL(str(lib)).stream_4r3w
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long, ctypes.c_int]
    return fn, f"compiled with {' '.join(cmd[:6])}; threads take 16 Ki-element blocks"


def c_kernel_status() -> str:
    """How the C probe was built, or why it is unavailable."""
    return _c_kernel()[1]


@dataclass(frozen=True, slots=True)
class ProbeSample:
    probe: str
    threads: int
    seconds: float
    bytes_moved: int

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.seconds / 1e9


class ProbeBuffers:
    """Four fp32 buffers of ``numel`` elements (p, g, m, v) and the probes that stream over them."""

    def __init__(self, numel: int, *, seed: int = 0) -> None:
        if numel < 1:
            raise ValueError(f"numel={numel!r}: expected an int >= 1")
        gen = torch.Generator().manual_seed(seed)
        self.numel = numel
        # Values keep every pass far from denormals and overflow for thousands of passes.
        self.p = torch.randn(numel, generator=gen)
        self.g = torch.randn(numel, generator=gen)
        self.m = torch.randn(numel, generator=gen)
        self.v = torch.rand(numel, generator=gen) + 0.5

    @property
    def probes(self) -> tuple[str, ...]:
        """Probe names available on this machine."""
        return tuple(n for n in PROBE_BYTES_PER_ELEMENT if n != "c_4r3w" or _c_kernel()[0] is not None)

    def run(self, probe: str, threads: int) -> ProbeSample:
        """One timed pass of ``probe`` on ``threads`` threads."""
        if probe == "c_4r3w":
            fn = _c_kernel()[0]
            if fn is None:
                raise RuntimeError(f"probe 'c_4r3w' is unavailable: {c_kernel_status()}")
            t0 = time.perf_counter()
            rc = fn(self.p.data_ptr(), self.g.data_ptr(), self.m.data_ptr(), self.v.data_ptr(),
                    self.numel, threads)
            seconds = time.perf_counter() - t0
            if rc != 0:
                logger.warning("c_4r3w: a pthread failed to start; its range ran on the caller")
        elif probe == "torch_3pass":
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                t0 = time.perf_counter()
                self.m.lerp_(self.g, 0.1)
                self.v.addcmul_(self.g, self.g, value=1e-3)
                self.p.addcmul_(self.m, self.v, value=-1e-6)
                seconds = time.perf_counter() - t0
            finally:
                torch.set_num_threads(previous)
        else:
            raise ValueError(f"probe {probe!r} is not known: expected one of {sorted(PROBE_BYTES_PER_ELEMENT)}")
        return ProbeSample(probe, threads, seconds, PROBE_BYTES_PER_ELEMENT[probe] * self.numel)
