"""The native kernels' speculation outputs: an out-of-place update and gradient checksums in one pass.

An early chunk (``overlap_backward``) has its kernel read the committed state and write the new
one into the second generation (``into``), and checksum the gradient it reads (``checksums``),
in the same pass (``offload.kernels._adamw``, ``speculation_outputs``). Checked here: ``into``
receives exactly the bits of the update in place, the inputs are left as they were, the
checksums are ``checksums_``' (itself ``grad_stats_``' second result and the torch reference's),
for both entry points, 1 and 2 threads, sizes around the pieces the kernel works in, aligned and
unaligned outputs, a chunk mixing bf16 and fp16, and a call that updates nothing
(``found_inf``). Bad outputs are refused before anything is written. ``swap_storages_``, the
commit, exchanges two storages' memory under every view. And ``native_copy_``, which writes the
weights of committed speculations into the parameters: the bits of ``copy_``, aligned or not,
small or large enough for its non-temporal stores.
"""

from __future__ import annotations

import pytest
import torch

from offload.kernels._adamw import Hyper, mixed_precision_adamw_, native_adamw_f32_
from offload.kernels._outputs import native_copy_, swap_storages_
from offload.kernels._grad_stats import STATS_BLOCK, checksums_, checksums_reference, grad_stats_

SIZES = (1, 63, 64, 1000, STATS_BLOCK - 64, STATS_BLOCK + 1, 5 * STATS_BLOCK + 77)
HYPER = Hyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _state(sizes, grad_dtypes, seed: int = 1) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "master": [torch.randn(n, generator=gen) for n in sizes],
        "grad": [torch.randn(n, generator=gen).to(d) for n, d in zip(sizes, grad_dtypes)],
        "exp_avg": [torch.randn(n, generator=gen) for n in sizes],
        "exp_avg_sq": [torch.rand(n, generator=gen) for n in sizes],
        "step": [torch.tensor(float(3 + i % 2)) for i in range(len(sizes))],
        "lowp": [torch.zeros(n, dtype=d) for n, d in zip(sizes, grad_dtypes)],
    }


def _run(kind: str, st, hyper: Hyper, **spec) -> None:
    if kind == "f32":
        native_adamw_f32_(st["master"], st["grad"], st["exp_avg"], st["exp_avg_sq"], st["step"],
                          steps_to_increment=st["step"], hyper=hyper, **spec)
    else:
        mixed_precision_adamw_(st["lowp"], st["grad"], st["master"], st["exp_avg"], st["exp_avg_sq"],
                               st["step"], steps_to_increment=st["step"], hyper=hyper, **spec)


def _outputs(sizes, offset: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """NaN-filled ``into`` tensors (``offset``: elements off the 64-byte alignment, so the kernel
    cannot stream into them) and -1 checksums."""
    into = [torch.full((n + offset,), float("nan"))[offset:] for n in sizes for _ in range(3)]
    return into, torch.full((len(sizes),), -1, dtype=torch.int64)


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["f32", "bf16", "mixed"])
def test_into_holds_the_update_in_place_and_the_inputs_are_only_read(kernel, kind, threads, offset) -> None:
    dtypes = {"f32": [torch.float32] * len(SIZES), "bf16": [torch.bfloat16] * len(SIZES),
              "mixed": [torch.bfloat16 if i % 2 else torch.float16 for i in range(len(SIZES))]}[kind]
    entry = "f32" if kind == "f32" else "mp"
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plain, spec = _state(SIZES, dtypes), _state(SIZES, dtypes)
        old = {k: [t.clone() for t in spec[k]] for k in ("master", "exp_avg", "exp_avg_sq")}
        into, sums = _outputs(SIZES, offset)
        _run(entry, plain, HYPER)
        _run(entry, spec, HYPER, into=into, checksums=sums)
    finally:
        torch.set_num_threads(before)
    for key in ("step",) + (("lowp",) if entry == "mp" else ()):
        for i, (a, b) in enumerate(zip(spec[key], plain[key])):
            assert torch.equal(a, b), f"{key}[{i}] differs from the update in place"
    for i in range(len(SIZES)):
        for k, key in enumerate(("master", "exp_avg", "exp_avg_sq")):
            assert torch.equal(into[3 * i + k], plain[key][i]), f"into[{3 * i + k}] is not the new {key}[{i}]"
            assert torch.equal(spec[key][i], old[key][i]), f"{key}[{i}] was written"
    assert torch.equal(sums, checksums_(spec["grad"]))
    assert torch.equal(sums, checksums_reference(spec["grad"]))
    assert torch.equal(sums, grad_stats_(spec["grad"])[1])


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_a_skipped_step_puts_the_state_as_it_is_into_the_outputs(kernel, kind) -> None:
    dtype = torch.float32 if kind == "f32" else torch.bfloat16
    st = _state(SIZES[:3], [dtype] * 3)
    old = [t.clone() for k in ("master", "exp_avg", "exp_avg_sq") for t in st[k]]
    into, sums = _outputs(SIZES[:3])
    skip = Hyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, found_inf=torch.ones(()))
    _run("f32" if kind == "f32" else "mp", st, skip, into=into, checksums=sums)
    assert torch.equal(st["master"][0], old[0])  # nothing updated
    for i in range(3):
        assert torch.equal(into[3 * i], old[i]) and torch.equal(into[3 * i + 1], old[3 + i])
        assert torch.equal(into[3 * i + 2], old[6 + i])
    assert torch.equal(sums, checksums_reference(st["grad"]))


@pytest.mark.parametrize("bad, message", [
    ("count", "into has 2 tensors: expected 0 or 3"),
    ("size", "into[1] has 5 elements"),
    ("alias", "into[0] and exp_avgs[0] share memory"),
    ("checksums", "checksums must be a contiguous torch.int64 CPU tensor of 1 elements"),
])
def test_bad_outputs_are_refused_before_any_write(kernel, bad, message) -> None:
    st = _state([64], [torch.float32])
    into, sums = _outputs([64])
    if bad == "count":
        into = into[:2]
    elif bad == "size":
        into[1] = torch.zeros(5)
    elif bad == "alias":
        into[0] = st["exp_avg"][0]
    else:
        sums = torch.zeros(2, dtype=torch.int64)
    before = [t.clone() for k in ("master", "exp_avg", "step") for t in st[k]]
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _run("f32", st, HYPER, into=into, checksums=sums)
    after = [t for k in ("master", "exp_avg", "step") for t in st[k]]
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_swap_storages_exchanges_memory_under_every_view(kernel) -> None:
    a, b = torch.arange(8, dtype=torch.float32), torch.arange(8, 16, dtype=torch.float32)
    view_a, view_b = a[2:5], b.view(2, 4)
    version = a._version
    swap_storages_([a], [b])
    assert torch.equal(a, torch.arange(8, 16, dtype=torch.float32)) and torch.equal(view_a, a[2:5])
    assert torch.equal(view_b.reshape(-1), torch.arange(8, dtype=torch.float32))
    assert a._version > version
    with pytest.raises(ValueError, match="different sizes"):
        swap_storages_([a], [torch.zeros(9)])
    with pytest.raises(ValueError, match="over the whole of its storage"):
        swap_storages_([a[1:]], [torch.zeros(7)])
    with pytest.raises(ValueError, match="share one storage"):
        swap_storages_([a], [a.view(2, 4)])
    assert torch.equal(a, torch.arange(8, 16, dtype=torch.float32))  # nothing swapped by a refused call


def test_checksums_alone_equal_grad_stats_and_skip_the_norm(kernel) -> None:
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(n, generator=gen).to(d) for n, d in
               zip(SIZES, (torch.float32, torch.bfloat16, torch.float16) * 3)]
    assert torch.equal(checksums_(tensors), grad_stats_(tensors)[1])
    assert torch.equal(checksums_(tensors), checksums_reference(tensors))
    assert checksums_([]).shape == (0,)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_copy_is_copy(kernel, dtype, threads) -> None:
    gen = torch.Generator().manual_seed(4)
    sizes = (1, 77, 4096, 3 << 20)  # the last call is large enough for non-temporal stores
    srcs = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    base = torch.zeros(sum(sizes) + 1, dtype=dtype)
    dsts, at = [], 1  # offset by one element: destinations off the vector alignment too
    for n in sizes:
        dsts.append(base[at:at + n])
        at += n
    aligned = [torch.zeros(n, dtype=dtype) for n in sizes]
    versions = [t._version for t in aligned]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        native_copy_(dsts, srcs)
        native_copy_(aligned, srcs)
    finally:
        torch.set_num_threads(before)
    for i, src in enumerate(srcs):
        assert torch.equal(dsts[i].view(torch.int16 if src.element_size() == 2 else torch.int32),
                           src.view(torch.int16 if src.element_size() == 2 else torch.int32)), i
        assert torch.equal(aligned[i], src), i
    assert base[0].item() == 0  # nothing written outside the destinations
    assert all(t._version > v for t, v in zip(aligned, versions))


@pytest.mark.parametrize("bad, error, message", [
    ("dtype", TypeError, "srcs[0] has dtype torch.bfloat16: expected torch.float32"),
    ("size", ValueError, "srcs[0] has 3 elements"),
    ("count", ValueError, "srcs has 0 tensors: expected 1 like dsts"),
    ("alias", ValueError, "dsts[0] and srcs[0] share memory"),
    ("widths", TypeError, "mixes element sizes"),
])
def test_native_copy_refuses_bad_pairs(kernel, bad, error, message) -> None:
    dst, src = torch.zeros(4), torch.ones(4)
    dsts, srcs = [dst], [src]
    if bad == "dtype":
        srcs = [src.bfloat16()]
    elif bad == "size":
        srcs = [torch.ones(3)]
    elif bad == "count":
        srcs = []
    elif bad == "alias":
        srcs = [dst]
    else:
        dsts, srcs = [dst, torch.zeros(4, dtype=torch.bfloat16)], [src, torch.ones(4, dtype=torch.bfloat16)]
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        native_copy_(dsts, srcs)
    assert torch.equal(dst, torch.zeros(4))


def test_checksums_of_device_tensors_never_load_the_extension() -> None:
    """A device gradient (here on ``meta``) is checksummed with torch ops where it is: asking the
    loader (a build of up to a minute) from a backward hook or ``step()`` would stall them."""

    class Refusing:
        def get(self):  # pragma: no cover - the test fails if it is called
            raise AssertionError("the extension was asked for")

    sums = checksums_([torch.empty(100, device="meta"), torch.empty(7, dtype=torch.bfloat16, device="meta")],
                      loader=Refusing())
    assert sums.device.type == "meta" and sums.shape == (2,) and sums.dtype == torch.int64
