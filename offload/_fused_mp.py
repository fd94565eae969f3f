"""The single-pass mixed-precision AdamW CPU kernel ("fused-mp"): build, fallback, entry point.

The torch path of a bf16 model's offloaded step makes three passes over memory: upcast the bf16
gradient into an fp32 buffer (read 2 + write 4 bytes per parameter), torch's fused AdamW on the
fp32 master and moments (28 bytes), downcast the master into the bf16 parameter (read 4 + write 2),
about 40 bytes per parameter. :func:`fused_mp_adamw_` does it in one pass: it reads the bf16
gradient, updates the fp32 master and moments in place and writes the bf16 parameter, 28 bytes per
parameter (``offload/csrc/fused_mp_adamw.cpp``).

Build. The C++ source is compiled on first use with torch's extension tooling
(``torch.utils.cpp_extension.load``, which needs a C++ compiler and ``ninja``) into
``$TORCH_EXTENSIONS_DIR/<name>`` when that is set (torch's own convention for extension builds),
else ``<cache dir>/ext/<name>`` where ``<cache dir>`` is the folder of the tuning cache
(``$XDG_CACHE_HOME/offload-autotune`` by default), and ``<name>`` hashes the source, the torch and
Python versions, the compiler's ``--version`` and the flags, so a cached build is reused only where
it was made for exactly this combination. The flags are those torch compiles its own kernels with
for the CPU capability torch dispatches to at runtime (``torch.backends.cpu.get_cpu_capability()``:
AVX512, AVX2 or DEFAULT), never ``-march=native``: that would tie a cache shared over NFS to one CPU
model, and change the vector width and FMA use, and with them the rounding, away from torch's. An
``flock`` next to the build serialises ranks building at once (the OS drops it when a builder dies,
so a crashed build never leaves a lock behind) and torch's own ``FileBaton`` still guards the build
directory. When the compiler or ninja is missing or the build fails, :func:`fused_mp_available`
returns ``(False, reason)``, logs the reason once at WARNING, and callers keep the torch path.

Numerics. Per step, the kernel computes what the torch path computes: the gradient upcast is exact,
the scalar coefficients are computed in double and cast to float as torch does, each tensor is
split into the same vectorised body and scalar tail as torch splits it, and every multiply-add is
fused or not as in torch's own binary (see the C++ header comment: torch's GCC contracted some
expressions on its own, and this file is compiled with ``-ffp-contract=off`` and spells those FMAs
out). On the builds in :data:`BITWISE_VERIFIED` (the tests check the one they run on),
``params_lowp``, masters and moments are bitwise identical to the torch path, for any thread count.
On other torch builds (another version, another compiler) an expression their compiler fused
differently rounds once differently: at most 1 ulp on a moment, a few ulps through sqrt and division
on the master update, so :data:`STEP_RTOL` bounds one step's relative difference (plus
``STEP_RTOL * 10 * lr`` absolute on a master that cancels to near zero), and the low-precision
parameter differs by at most one bf16/fp16 ulp (the fp32 masters can straddle a rounding boundary).
:func:`bitwise_matches_torch` says which case holds; a tuner must only treat the kernel as a pure
speed knob where it returns True ("tuning never changes the math").

Speed. One parallel region per call over all its tensors on torch's OpenMP pool (the build uses
``-fopenmp`` and links the ``libgomp.so.1`` that torch has loaded; every load checks that
``torch.set_num_threads`` governs the kernel), vectorised with ATen's ``Vectorized``. Its threads
take blocks of 16 Ki elements from a shared counter instead of a fixed share each, so a thread
slowed by another process costs the call its share of the delay, not the whole delay (which a
fixed split pays once per call, i.e. once per chunk). Calls of at least 2 Mi elements write the
low-precision parameter with non-temporal stores, which saves the read-for-ownership of a
write-only stream (2 of 30 bytes per parameter). :func:`fused_mp_adamw_steps_` takes torch's step
tensors and does the step bookkeeping in C++, so a caller makes one call per chunk with no Python
work per tensor beyond building the lists.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import math
import numbers
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from autotune import knobs

__all__ = [
    "BITWISE_VERIFIED",
    "STEP_RTOL",
    "FusedMPUnavailable",
    "bitwise_matches_torch",
    "call_f32_unchecked",
    "call_steps_unchecked",
    "fused_mp_adamw_",
    "fused_mp_adamw_steps_",
    "fused_mp_available",
    "torch_mp_adamw_",
]

logger = logging.getLogger(__name__)

#: (torch major.minor, CPU capability) pairs on which the tests found the kernel bitwise identical
#: to the torch path, tails included (torch 2.13 x86-64 wheels; see the C++ header comment).
BITWISE_VERIFIED: frozenset[tuple[str, str]] = frozenset(
    {("2.13", "AVX512"), ("2.13", "AVX2"), ("2.13", "DEFAULT")}
)
#: Per-step relative difference to the torch path on a build outside BITWISE_VERIFIED: a few fp32
#: ulps (2**-23 each) from at most one differently fused multiply-add per moment, propagated
#: through sqrt and division into the master update (0 on a verified build).
STEP_RTOL = 8 * 2.0**-23

_SOURCE = Path(__file__).resolve().parent / "csrc" / "fused_mp_adamw.cpp"
_NAME_PREFIX = "offload_fused_mp"
#: Flags torch's CMake (cmake/Codegen.cmake) compiles its per-capability kernels with (plus
#: -mf16c for AVX2, which ATen's fp16 vector conversions need outside torch's own build; every
#: AVX2 CPU has F16C, and the conversions are exact or round to nearest-even either way).
_CAPABILITY_FLAGS: dict[str, tuple[str, ...]] = {
    "AVX512": (
        "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
        "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512",
    ),
    "AVX2": (
        "-mavx2", "-mfma", "-mf16c",
        "-mno-avx256-split-unaligned-load", "-mno-avx256-split-unaligned-store",
        "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2",
    ),
    "DEFAULT": (),
}
#: -ffp-contract=off: the source spells out every FMA torch's binary has; the compiler adds none.
#: -fopenmp: at::parallel_for is inline OpenMP in torch's headers; without it the kernel runs on
#: one thread. The library links libgomp.so.1, which the loader resolves to the copy torch already
#: loaded, so torch.set_num_threads governs the kernel (checked after every load).
_COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
#: How long a process waits for another one building the same extension.
_BUILD_WAIT_S = 900.0


class FusedMPUnavailable(RuntimeError):
    """The fused-mp kernel could not be built or loaded here; the message says why."""


@dataclass(frozen=True, slots=True)
class BuildSpec:
    """Everything that determines one build of the extension."""

    name: str
    """Python module name; unique per build key."""
    source: Path
    build_dir: Path
    cflags: tuple[str, ...]
    capability: str
    """torch's runtime CPU capability the flags target."""
    compiler: str


def _compiler_identity(compiler: str) -> str:
    try:
        out = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{compiler}: {exc}"
    return out.stdout.splitlines()[0] if out.stdout else compiler


def build_spec(source: Path = _SOURCE, cache_root: Path | None = None) -> BuildSpec:
    """The build this process would use: flags for torch's CPU capability, a keyed directory."""
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    arch_flags = _CAPABILITY_FLAGS.get(capability, ())
    cflags = (*_COMMON_FLAGS, *arch_flags)
    compiler = cpp_extension.get_cxx_compiler()
    key = hashlib.sha256()
    for part in (
        source.read_bytes(),
        torch.__version__.encode(),
        str(torch.compiled_with_cxx11_abi()).encode(),
        sys.version.encode(),
        platform.machine().encode(),
        _compiler_identity(compiler).encode(),
        " ".join((*cflags, *_LDFLAGS)).encode(),
        capability.encode(),
    ):
        key.update(part)
        key.update(b"\0")
    name = f"{_NAME_PREFIX}_{key.hexdigest()[:16]}"
    if cache_root is not None:
        build_dir = cache_root / "ext" / name
    else:
        extensions = knobs.torch_extensions_dir()
        build_dir = extensions / name if extensions is not None else knobs.cache_path().parent / "ext" / name
    return BuildSpec(
        name=name,
        source=source,
        build_dir=build_dir,
        cflags=cflags,
        capability=capability,
        compiler=compiler,
    )


@contextlib.contextmanager
def _build_lock(build_dir: Path, timeout_s: float) -> Iterator[None]:
    """An exclusive flock beside the build; released by the OS if this process dies."""
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on torch's FileBaton alone
        yield
        return
    lock_path = build_dir / "build.flock"
    with open(lock_path, "a+") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"waited {timeout_s:.0f} s for another process building {build_dir}"
                    ) from None
                time.sleep(0.2)
        try:
            # Every builder holds this flock first, so a FileBaton lock left here is stale (its
            # process died mid-build) and would make torch wait on it forever.
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _first_error_line(text: str) -> str:
    """The compiler's first diagnostic ("...: error: ...") in a failed build's output."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for marker in ("error:", "error"):
        for line in lines:
            if marker in line.lower() and not line.startswith(("FAILED", "Error building")):
                return line[:300]
    return (lines[-1] if lines else text)[:300]


def load_extension(spec: BuildSpec) -> ModuleType:
    """Build (or reuse) and import the extension; raises FusedMPUnavailable with the reason."""
    from torch.utils import cpp_extension

    if shutil.which(spec.compiler) is None:
        raise FusedMPUnavailable(
            f"no C++ compiler: {spec.compiler!r} is not on PATH (install g++ or set CXX)"
        )
    with _pip_ninja_on_path():
        return _build_and_import(spec)


@contextlib.contextmanager
def _pip_ninja_on_path() -> Iterator[None]:
    """During the build, put the pip ``ninja`` package's binary on PATH if no ninja is on it.

    torch runs ``ninja`` from PATH; an unactivated virtual environment has the pip package but
    not its ``bin`` folder on PATH. PATH is restored afterwards.
    """
    if shutil.which("ninja") is not None:
        yield
        return
    try:
        import ninja  # the PyPI package that ships the binary

        bin_dir = str(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        yield
        return
    previous = os.environ.get("PATH", "")
    os.environ["PATH"] = bin_dir + os.pathsep + previous
    try:
        yield
    finally:
        os.environ["PATH"] = previous


def _build_and_import(spec: BuildSpec) -> ModuleType:
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise FusedMPUnavailable(
            "ninja is not installed (pip install ninja, or the distribution's ninja-build)"
        )
    if not spec.source.is_file():
        raise FusedMPUnavailable(f"kernel source {spec.source} is missing")
    try:
        spec.build_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FusedMPUnavailable(f"cannot create build directory {spec.build_dir}: {exc}") from exc
    start = time.perf_counter()
    try:
        with _build_lock(spec.build_dir, _BUILD_WAIT_S):
            module = cpp_extension.load(
                name=spec.name,
                sources=[str(spec.source)],
                extra_cflags=list(spec.cflags),
                extra_ldflags=list(_LDFLAGS),
                build_directory=str(spec.build_dir),
                with_cuda=False,
                verbose=False,
            )
    except TimeoutError as exc:
        raise FusedMPUnavailable(str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - any build or import failure means "fall back"
        logger.debug("fused-mp build output:\n%s", exc)
        raise FusedMPUnavailable(
            f"build of {spec.source.name} failed in {spec.build_dir}: {_first_error_line(str(exc))}"
        ) from exc
    expected = spec.capability if spec.capability in _CAPABILITY_FLAGS else "DEFAULT"
    if module.capability() != expected:
        raise FusedMPUnavailable(
            f"built for CPU capability {module.capability()}, expected {expected} "
            f"(torch runs {spec.capability})"
        )
    _check_thread_pool(module)
    logger.info(
        "fused-mp kernel ready (%s, %.1f s, %s)", spec.capability,
        time.perf_counter() - start, spec.build_dir,
    )
    return module


def _check_thread_pool(module: ModuleType) -> None:
    """Raise FusedMPUnavailable unless the kernel's parallel regions follow torch's thread count."""
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        used = module.threads_used(64)
    finally:
        torch.set_num_threads(previous)
    if used != 2:
        raise FusedMPUnavailable(
            f"the kernel ran {used} thread(s) where torch.set_num_threads(2) asks for 2: it is not "
            "on torch's OpenMP runtime, so the thread knob would not govern it"
        )


class _Loader:
    """Builds once per process (thread-safe) and remembers the outcome and its reason."""

    def __init__(self, source: Path = _SOURCE, cache_root: Path | None = None) -> None:
        self._source = source
        self._cache_root = cache_root
        self._lock = threading.Lock()
        self._done = False
        self._module: ModuleType | None = None
        self._reason = ""

    def get(self) -> tuple[ModuleType | None, str]:
        if self._done:  # set last, under the lock, after _module and _reason
            return self._module, self._reason
        with self._lock:
            if not self._done:
                try:
                    spec = build_spec(self._source, self._cache_root)
                    self._module = load_extension(spec)
                    self._reason = f"built for {spec.capability} in {spec.build_dir}"
                except FusedMPUnavailable as exc:
                    self._reason = str(exc)
                except Exception as exc:  # noqa: BLE001 - e.g. a bad cache path knob
                    self._reason = f"{type(exc).__name__}: {exc}"
                if self._module is None:
                    logger.warning(
                        "fused-mp AdamW kernel unavailable, using the torch path: %s", self._reason
                    )
                self._done = True
            return self._module, self._reason


_LOADER = _Loader()


def fused_mp_available() -> tuple[bool, str]:
    """Whether the fused-mp kernel can run here, and why (or why not).

    The first call builds the extension (seconds to a minute; later processes reuse the cached
    build) and logs a failure once at WARNING; later calls return the remembered outcome.
    """
    module, reason = _LOADER.get()
    return module is not None, reason


def bitwise_matches_torch() -> bool:
    """True where this torch build and CPU capability are in :data:`BITWISE_VERIFIED`."""
    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return (major_minor, torch.backends.cpu.get_cpu_capability()) in BITWISE_VERIFIED


def _check_lists(**lists: Sequence[Tensor]) -> None:
    for name, value in lists.items():
        if not isinstance(value, (list, tuple)):
            raise TypeError(
                f"fused_mp_adamw_: {name} is a {type(value).__name__}: expected a list of tensors"
            )
        for i, item in enumerate(value):
            if not isinstance(item, Tensor):
                raise TypeError(
                    f"fused_mp_adamw_: {name}[{i}] is a {type(item).__name__}: expected a Tensor"
                )


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"fused_mp_adamw_: step={step!r}: expected an int >= 1")


def _check_hyper(lr: float, beta1: float, beta2: float, eps: float, wd: float) -> None:
    for name, value, low, high in (
        ("lr", lr, 0.0, math.inf),
        ("beta1", beta1, 0.0, 1.0),
        ("beta2", beta2, 0.0, 1.0),
        ("eps", eps, 0.0, math.inf),
        ("weight_decay", wd, 0.0, math.inf),
    ):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"fused_mp_adamw_: {name}={value!r}: expected a float")
        if not (math.isfinite(value) and low <= value and (value < high or high == math.inf)):
            bound = f"in [{low}, {high})" if high != math.inf else f"finite and >= {low}"
            raise ValueError(f"fused_mp_adamw_: {name}={value!r}: expected {bound}")


def fused_mp_adamw_(
    params_lowp: Sequence[Tensor],
    grads_lowp: Sequence[Tensor],
    masters: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step over lists of CPU tensors in a single pass, in place.

    For each ``i``: reads ``grads_lowp[i]`` (bf16 or fp16), updates ``masters[i]``,
    ``exp_avgs[i]``, ``exp_avg_sqs[i]`` (fp32) like ``torch._fused_adamw_`` on the upcast
    gradient, and writes the master rounded to nearest-even into ``params_lowp[i]`` (bf16 or fp16).
    All tensors of an index hold the same number of elements and are contiguous CPU tensors
    (typically 1-D slab views); each list has one dtype. ``step`` is the step number after this
    update (1 on the first step), as in ``torch.optim.AdamW``.

    Every input is checked before any memory is written: TypeError for a wrong type or dtype,
    ValueError for lengths, sizes, devices, layouts, non-contiguous or aliased tensors and
    hyper-parameters, each naming the argument and index. Raises :class:`FusedMPUnavailable` when
    the kernel could not be built (check :func:`fused_mp_available` first). Runs on torch's
    intra-op thread pool (``torch.set_num_threads``) and releases the GIL while it runs.
    """
    _check_lists(
        params_lowp=params_lowp, grads_lowp=grads_lowp, masters=masters, exp_avgs=exp_avgs,
        exp_avg_sqs=exp_avg_sqs,
    )
    _check_step(step)
    _check_hyper(lr, beta1, beta2, eps, weight_decay)
    module, reason = _LOADER.get()
    if module is None:
        raise FusedMPUnavailable(f"fused-mp AdamW kernel unavailable: {reason}")
    module.fused_mp_adamw_(
        list(params_lowp), list(grads_lowp), list(masters), list(exp_avgs), list(exp_avg_sqs),
        step=int(step), lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(eps),
        weight_decay=float(weight_decay),
    )


def fused_mp_adamw_steps_(
    params_lowp: Sequence[Tensor],
    grads_lowp: Sequence[Tensor],
    masters: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    state_steps: Sequence[Tensor],
    *,
    steps_to_increment: Sequence[Tensor] = (),
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """:func:`fused_mp_adamw_` with torch's step bookkeeping: each tensor's own step tensor.

    ``state_steps[i]`` is the fp32 one-element step tensor of the parameter ``masters[i]``
    belongs to (several entries may share one). First each of ``steps_to_increment`` is
    incremented by one (as ``torch._foreach_add_(steps, 1)`` before torch's fused AdamW), then
    every tensor is updated with the step its step tensor then holds, read as a float as torch
    reads it. One call does the work of a ``_foreach_add_``, a ``.item()`` per tensor and one
    kernel call per distinct step: the offload pipeline's per-chunk Python time, which on a
    memory-bound step leaves the memory bus idle, no longer grows with the number of parameters.

    Same checks as :func:`fused_mp_adamw_` (all before the first write, the step increments
    included), plus: every step tensor is a one-element fp32 CPU tensor, and every step is finite
    and >= 1 after the increments.
    """
    _check_lists(
        params_lowp=params_lowp, grads_lowp=grads_lowp, masters=masters, exp_avgs=exp_avgs,
        exp_avg_sqs=exp_avg_sqs, state_steps=state_steps, steps_to_increment=steps_to_increment,
    )
    _check_hyper(lr, beta1, beta2, eps, weight_decay)
    call_steps_unchecked(
        list(params_lowp), list(grads_lowp), list(masters), list(exp_avgs), list(exp_avg_sqs),
        list(state_steps), steps_to_increment=list(steps_to_increment), lr=float(lr),
        beta1=float(beta1), beta2=float(beta2), eps=float(eps), weight_decay=float(weight_decay),
    )


def call_steps_unchecked(
    params_lowp: list[Tensor],
    grads_lowp: list[Tensor],
    masters: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    *,
    steps_to_increment: list[Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """:func:`fused_mp_adamw_steps_` without its Python-side checks, for the offload pipeline.

    The C++ side still checks every tensor before writing; what is skipped is the per-element
    ``isinstance`` walk (pybind rejects a non-tensor with a less precise TypeError) and the
    hyper-parameter checks (the optimizer validated them when the param group was set). The
    pipeline calls this once per chunk while the memory bus waits, so it stays lean.
    """
    module, reason = _LOADER.get()
    if module is None:
        raise FusedMPUnavailable(f"fused-mp AdamW kernel unavailable: {reason}")
    module.fused_mp_adamw_steps_(
        params_lowp, grads_lowp, masters, exp_avgs, exp_avg_sqs, state_steps,
        steps_to_increment=steps_to_increment, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay,
    )


def call_f32_unchecked(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    *,
    outs: list[Tensor],
    steps_to_increment: list[Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """The fp32 entry point (each parameter its own master, fp32 gradients; ``outs`` empty or a
    copy target per parameter), with the step bookkeeping of :func:`fused_mp_adamw_steps_`.
    Bitwise equal to ``torch._fused_adamw_`` on the builds of :data:`BITWISE_VERIFIED` (the
    same lane arithmetic as the mixed-precision master update). Checks as :func:`call_steps_unchecked`."""
    module, reason = _LOADER.get()
    if module is None:
        raise FusedMPUnavailable(f"fused-mp AdamW kernel unavailable: {reason}")
    module.adamw_f32_steps_(
        params, grads, exp_avgs, exp_avg_sqs, state_steps, outs=outs,
        steps_to_increment=steps_to_increment, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay,
    )


@torch.no_grad()
def torch_mp_adamw_(
    params_lowp: Sequence[Tensor],
    grads_lowp: Sequence[Tensor],
    masters: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_buffers: Sequence[Tensor] | None = None,
) -> None:
    """The torch path with :func:`fused_mp_adamw_`'s signature: the reference and the fallback.

    Upcasts each gradient into an fp32 buffer (``grad_buffers`` when given, else new tensors),
    runs ``torch._fused_adamw_`` on the fp32 masters and moments, and copies the masters into the
    low-precision parameters. Three passes, about 40 bytes per parameter.
    """
    _check_lists(
        params_lowp=params_lowp, grads_lowp=grads_lowp, masters=masters, exp_avgs=exp_avgs,
        exp_avg_sqs=exp_avg_sqs,
    )
    _check_step(step)
    _check_hyper(lr, beta1, beta2, eps, weight_decay)
    if not masters:
        return
    if grad_buffers is None:
        grads32 = [g.to(torch.float32) for g in grads_lowp]
    else:
        grads32 = list(grad_buffers)
        torch._foreach_copy_(grads32, list(grads_lowp))
    from offload._kernels import Hyper, fused_adamw_  # the one caller of torch._fused_adamw_

    steps = [torch.tensor(float(step))] * len(masters)
    fused_adamw_(
        list(masters), grads32, list(exp_avgs), list(exp_avg_sqs), steps, steps_to_increment=(),
        hyper=Hyper(lr=float(lr), beta1=float(beta1), beta2=float(beta2),
                    weight_decay=float(weight_decay), eps=float(eps)),
    )
    torch._foreach_copy_(list(params_lowp), list(masters))
