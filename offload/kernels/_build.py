"""Build and load of the fused-mp extension (its source: ``csrc/module.cpp`` of this package and the
headers it includes, one per concern, each beside the Python module it serves).

The C++ source is compiled on first use with torch's extension tooling
(``torch.utils.cpp_extension.load``, which needs a C++ compiler and ``ninja``) into
``$TORCH_EXTENSIONS_DIR/<name>`` when that is set (torch's own convention for extension builds),
else ``$XDG_CACHE_HOME/offload-autotune/ext/<name>`` (``offload._settings.extensions_dir``; never
beside the tuning cache, whose path may be ``/dev/null`` or a bare ``c.json``), and ``<name>``
hashes the source, every header it includes (:func:`source_files`) and their paths, the torch and Python versions, the compiler's ``--version`` and the flags, so
a cached build is reused only where it was made for exactly this combination. The flags are those torch compiles its own kernels with
for the CPU capability torch dispatches to at runtime (``torch.backends.cpu.get_cpu_capability()``:
AVX512, AVX2 or DEFAULT), never ``-march=native``: that would tie a cache shared over NFS to one CPU
model, and change the vector width and FMA use, and with them the rounding, away from torch's. An
``flock`` next to the build serialises ranks building at once (the OS drops it when a builder dies,
so a crashed build never leaves a lock behind) and torch's own ``FileBaton`` still guards the build
directory. The build uses ``-fopenmp`` and links the ``libgomp.so.1`` that torch has loaded; every
load checks that ``torch.set_num_threads`` governs the kernel. When the compiler or ninja is
missing or the build fails, :meth:`KernelLoader.get` returns ``(None, reason)`` and logs the reason
once at WARNING, and callers keep the torch path.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Protocol

import torch

from offload._settings import extensions_dir

__all__ = [
    "SOURCE",
    "BuildSpec",
    "ExtensionLoader",
    "FusedMPUnavailable",
    "KernelLoader",
    "build_spec",
    "load_extension",
    "needs_build",
    "pip_ninja_on_path",
    "source_digest",
    "source_files",
]

logger = logging.getLogger(__name__)

#: The kernel's C++ source: one translation unit (each extra one that includes torch's headers
#: costs 15-25 s of compile on a 2-core machine) that includes the headers beside it.
SOURCE = Path(__file__).resolve().parent / "csrc" / "module.cpp"
#: A quoted include (``#include "x.h"``): a file of the kernel's own, resolved beside its includer.
_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)
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


def source_files(source: Path = SOURCE) -> tuple[Path, ...]:
    """Every file the build of ``source`` reads besides torch's and the system's headers:
    ``source`` and, transitively, each file a quoted ``#include`` names (resolved beside the file
    that includes it, as the compiler does), each once, in the order first met. A quoted include
    of a file that does not exist is left to the compiler (its name is still in the includer's
    bytes); one inside an ``#if`` counts whatever the condition (a key that changes too often
    costs a build, one that changes too rarely reuses a stale one)."""
    seen: dict[Path, None] = {}
    pending = [source.resolve()]
    while pending:
        path = pending.pop(0)
        if path in seen or not path.is_file():
            continue
        seen[path] = None
        for name in _LOCAL_INCLUDE.findall(path.read_bytes()):
            pending.append((path.parent / name.decode()).resolve())
    return tuple(seen)


def _sources_digest(source: Path) -> bytes:
    """sha256 over the name (relative to ``source``'s folder) and bytes of every file of
    :func:`source_files`: the same for two checkouts of one commit."""
    digest = hashlib.sha256()
    files = source_files(source)
    root = source.resolve().parent
    for path in files or (source,):  # (a missing source: read_bytes raises, as before)
        digest.update(os.path.relpath(path, root).encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.digest()


def source_digest(source: Path = SOURCE) -> str:
    """A short hash of the native kernel's source and the headers it includes (part of a tuned
    setting's cache key: a kernel changed in a source checkout, whose package version stays
    "source", may move the optimum)."""
    return _sources_digest(source).hex()[:16]


def build_spec(source: Path = SOURCE, cache_root: Path | None = None) -> BuildSpec:
    """The build this process would use: flags for torch's CPU capability, a keyed directory."""
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    arch_flags = _CAPABILITY_FLAGS.get(capability, ())
    cflags = (*_COMMON_FLAGS, *arch_flags)
    compiler = cpp_extension.get_cxx_compiler()
    key = hashlib.sha256()
    for part in (
        # Every file of ours the compiler reads (the source and its headers: an edited header
        # must not reuse a stale build).
        _sources_digest(source),
        # torch's build.ninja names the source by its path: two checkouts sharing one directory
        # would rebuild each other's build (about 25 s) on every first use.
        str(source.resolve()).encode(),
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
        build_dir = extensions_dir() / name
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
    if shutil.which(spec.compiler) is None:
        raise FusedMPUnavailable(
            f"no C++ compiler: {spec.compiler!r} is not on PATH (install g++ or set CXX)"
        )
    with pip_ninja_on_path():
        return _build_and_import(spec)


@contextlib.contextmanager
def pip_ninja_on_path() -> Iterator[None]:
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
            if needs_build(spec):
                # A warning, so that a script that configured no logging says it too (through
                # logging's last-resort handler): otherwise the first use looks hung for ~30 s.
                logger.warning("building the native AdamW kernel (first use on this machine, about 30 s; "
                               "later runs reuse it) in %s ...", spec.build_dir)
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


def needs_build(spec: BuildSpec) -> bool:
    """Whether loading ``spec`` compiles: no built library in its (keyed) directory yet."""
    return not (spec.build_dir / f"{spec.name}.so").is_file()


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


class ExtensionLoader(Protocol):
    """What the kernels need of a loader: the extension module, or None and why not."""

    def get(self) -> tuple[ModuleType | None, str]:
        """The loaded module (None when it cannot be had here) and the reason or the outcome."""
        ...


class KernelLoader:
    """Builds the extension of ``source`` once (thread-safe) and remembers the outcome and why.

    ``cache_root``: the build goes to ``<cache_root>/ext/<name>`` (default: see the module doc).
    The first :meth:`get` builds or loads the cached build and logs a failure once at WARNING.
    The entry points and kernels take a loader (``loader=``); tests pass one with a broken or
    missing source instead of patching this module.
    """

    def __init__(self, source: Path = SOURCE, cache_root: Path | None = None) -> None:
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
