"""grad_stats: per-tensor norm terms and content checksums.

Checksums against the torch reference (bitwise) and against every small change of content; norm
terms against float64 (1e-6 relative, the clipping contract) and the reference (1e-12); both
bitwise identical across thread counts and splits of the tensor list.
"""

from __future__ import annotations

import math

import pytest
import torch

from offload.testing import KernelLoader, KernelSet
from offload.kernels._grad_stats import STATS_BLOCK, grad_stats_, grad_stats_reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Empty, below and around the 32 lanes, around the 16 Ki block, several blocks with a tail.
SIZES = (0, 1, 31, 32, 33, STATS_BLOCK - 1, STATS_BLOCK, STATS_BLOCK + 1, 3 * STATS_BLOCK + 77)


def _tensors(gen: torch.Generator) -> list[torch.Tensor]:
    out = []
    for i, n in enumerate(SIZES):
        dtype = DTYPES[i % 3]
        out.append((torch.randn(n, generator=gen) * 10 ** (4 * torch.rand(n, generator=gen) - 2))
                   .to(dtype))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _float64_term(t: torch.Tensor, p: float) -> float:
    x = t.double().abs()
    if t.numel() == 0:
        return 0.0
    return float(x.max()) if p == math.inf else float(x.pow(p).sum())


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_native_equals_the_reference_and_float64(kernel, norm_type) -> None:
    tensors = _tensors(torch.Generator().manual_seed(0))
    terms, sums = grad_stats_(tensors, norm_type=norm_type)
    ref_terms, ref_sums = grad_stats_reference(tensors, norm_type=norm_type)
    assert terms.dtype == torch.float64 and sums.dtype == torch.int64
    assert terms.shape == sums.shape == (len(tensors),)
    assert torch.equal(sums, ref_sums)
    for i, t in enumerate(tensors):
        want = _float64_term(t, norm_type)
        assert terms[i].item() == pytest.approx(want, rel=1e-6, abs=0), f"tensors[{i}] vs float64"
        assert terms[i].item() == pytest.approx(ref_terms[i].item(), rel=1e-12, abs=0)
        if t.numel() == 0:
            assert terms[i].item() == 0.0 and sums[i].item() == 0


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_identical_across_threads_and_list_splits(kernel, norm_type) -> None:
    gen = torch.Generator().manual_seed(1)
    tensors = _tensors(gen) + [torch.randn(5 * STATS_BLOCK + 3, generator=gen)]
    previous = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(grad_stats_(tensors, norm_type=norm_type))
            halves = [grad_stats_(part, norm_type=norm_type) for part in (tensors[:4], tensors[4:])]
            results.append(tuple(torch.cat(x) for x in zip(*halves)))
            singles = [grad_stats_([t], norm_type=norm_type) for t in tensors]
            results.append(tuple(torch.cat(x) for x in zip(*singles)))
    finally:
        torch.set_num_threads(previous)
    for terms, sums in results[1:]:
        assert torch.equal(terms.view(torch.int64), results[0][0].view(torch.int64))
        assert torch.equal(sums, results[0][1])


def _changed(t: torch.Tensor, how: str) -> torch.Tensor:
    u = t.clone()
    k = t.numel() // 2
    if how == "times 2":
        u.mul_(2)
    elif how == "times 0.5":
        u.mul_(0.5)
    elif how == "one ulp at one element":
        _bits(u)[k] += 1
    elif how == "one element to 0":
        u[k] = 0
    else:
        u[k] = float("nan")
    return u


@pytest.mark.parametrize("how", ["times 2", "times 0.5", "one ulp at one element",
                                 "one element to 0", "one element to nan"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_checksum_sees_every_change(kernel, dtype, how) -> None:
    gen = torch.Generator().manual_seed(2)
    t = (torch.randn(3 * STATS_BLOCK + 5, generator=gen) + 0.1).to(dtype)
    u = _changed(t, how)
    assert not torch.equal(_bits(t), _bits(u))
    (_, before), (_, after) = grad_stats_([t]), grad_stats_([u])
    assert before.item() != after.item(), f"{dtype} {how}: checksum unchanged"
    assert after.item() == grad_stats_reference([u])[1].item()


def test_nan_and_inf_reach_the_terms(kernel) -> None:
    t = torch.ones(100)
    t[7] = float("inf")
    u = torch.ones(100)
    u[70] = float("nan")
    for p in (2.0, 1.0, math.inf):
        terms, _ = grad_stats_([t, u], norm_type=p)
        ref, _ = grad_stats_reference([t, u], norm_type=p)
        assert math.isinf(terms[0].item()) and math.isinf(ref[0].item())
        assert math.isnan(terms[1].item()) and math.isnan(ref[1].item())


def test_permuted_tensors_are_handled_and_strided_ones_refused(kernel) -> None:
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(300, 70, generator=gen)
    permuted = base.t()  # dense, not contiguous: the same elements in memory
    assert not permuted.is_contiguous()
    for fn in (grad_stats_, grad_stats_reference):
        assert torch.equal(fn([permuted])[1], fn([base])[1])
        assert fn([permuted])[0].item() == pytest.approx(fn([base])[0].item(), rel=1e-12)
    for fn in (grad_stats_, grad_stats_reference):
        with pytest.raises(ValueError, match=r"tensors\[1\] \(shape \(300, 35\), strides \(70, 2\)\)"
                                             " does not cover one dense block of memory"):
            fn([base, base[:, ::2]])


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (torch.ones(3, dtype=torch.float64), TypeError, r"tensors\[0\] has dtype torch.float64"),
        (torch.ones(3, dtype=torch.int32), TypeError, r"tensors\[0\] has dtype torch.int32"),
    ],
)
def test_bad_tensors_name_the_index(kernel, value, error, message) -> None:
    for fn in (grad_stats_, grad_stats_reference):
        with pytest.raises(error, match=message):
            fn([value])


@pytest.mark.parametrize("norm_type", [0.0, -1.0, float("nan"), "2", True])
def test_bad_norm_types_are_refused(norm_type) -> None:
    with pytest.raises((TypeError, ValueError), match="norm_type="):
        grad_stats_([torch.ones(2)], norm_type=norm_type)


def test_other_norm_types_and_no_extension_use_the_reference(tmp_path) -> None:
    gen = torch.Generator().manual_seed(6)
    tensors = [torch.randn(1000, generator=gen), torch.randn(77, generator=gen).bfloat16()]
    terms, sums = grad_stats_(tensors, norm_type=3.0)
    for i, t in enumerate(tensors):
        assert terms[i].item() == pytest.approx(float(t.double().abs().pow(3).sum()), rel=1e-12)
    missing = KernelLoader(tmp_path / "missing.cpp", tmp_path / "cache")
    kernels = KernelSet(loader=missing)
    t_ref, s_ref = grad_stats_reference(tensors)
    t_got, s_got = kernels.grad_stats(tensors)
    assert torch.equal(s_got, s_ref) and torch.equal(t_got, t_ref)
    assert torch.equal(s_got, sums)


def test_the_reference_is_deterministic_across_threads() -> None:
    x = torch.randn(4 * STATS_BLOCK + 9, generator=torch.Generator().manual_seed(8))
    previous = torch.get_num_threads()
    try:
        got = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got.append(grad_stats_reference([x])[0])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(got[0].view(torch.int64), got[1].view(torch.int64))


def test_empty_list() -> None:
    for fn in (grad_stats_, grad_stats_reference):
        terms, sums = fn([])
        assert terms.shape == sums.shape == (0,)
        assert terms.dtype == torch.float64 and sums.dtype == torch.int64


def test_checksum_sees_a_balanced_tensor_negated_and_neighbours_swapped() -> None:
    """A plain sum of words missed both (a sign bit moves a word by 2**31): the lanes' weights."""
    from offload.kernels._grad_stats import grad_stats_, grad_stats_reference

    g = torch.tensor([1.0, -3.0, 0.5, -0.25] * 8)
    for fn in (grad_stats_, grad_stats_reference):
        base = fn([g])[1]
        assert not torch.equal(fn([-g])[1], base)
        assert not torch.equal(fn([g[[1, 0] + list(range(2, 32))]])[1], base)
        for dtype in (torch.bfloat16, torch.float16):
            h = g.to(dtype)
            assert not torch.equal(fn([-h])[1], fn([h])[1])


def test_the_reference_works_in_blocks_and_equals_the_native_pass(kernel) -> None:
    """The torch-ops path (the one CUDA gradients take) holds O(block) temporaries: a tensor longer
    than a block (and not a multiple of it or of the 32 lanes) has the native pass's checksum."""
    from offload.kernels._grad_stats import TORCH_BLOCK

    assert TORCH_BLOCK % 32 == 0 and TORCH_BLOCK % STATS_BLOCK == 0
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(TORCH_BLOCK + 1000 + 7, generator=g).to(dtype)
        assert torch.equal(grad_stats_reference([t])[1], grad_stats_([t])[1]), dtype


def test_device_tensors_never_load_the_extension_and_reuse_the_lane_weights() -> None:
    """No build inside a backward hook for device gradients (``meta`` stands in for a GPU here),
    and the lane weights are made once per device (a ``torch.tensor(..., device=)`` per call is a
    blocking copy: a sync per hook on CUDA)."""
    from offload.kernels._grad_stats import _lane_weights

    class Refuse:
        def get(self):  # an ExtensionLoader that must not be asked
            raise AssertionError("the extension was loaded for device tensors")

    t = torch.empty(100, device="meta")
    terms, sums = grad_stats_([t, t], loader=Refuse())
    assert terms.device.type == sums.device.type == "meta" and tuple(sums.shape) == (2,)
    assert _lane_weights(torch.device("meta")) is _lane_weights(torch.device("meta"))


class _Allocations(torch.overrides.TorchFunctionMode):
    """The largest tensor a torch call on this thread made (views of other tensors not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.uploads = 0  # host tensors copied to a device (a blocking copy: a sync on CUDA)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if (isinstance(out, torch.Tensor) and out.device.type != "cpu" and args
                and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"):
            self.uploads += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not t._is_view():
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_terms_and_checksums_make_no_temporary_larger_than_a_block(norm_type, dtype) -> None:
    """On a device (``meta`` stands in for a GPU) the norm terms and checksums hold temporaries
    of O(block) elements, never O(tensor) (issue 24: 16 B per element of a 525M-element gradient
    at peak, during backward and every clip); the inf norm too (a whole-tensor ``abs()`` before),
    and no host value is copied up (an empty shard's term was a host 0.0: a blocking copy)."""
    import offload.kernels._grad_stats as gs

    block = gs.TORCH_BLOCK
    t = torch.empty(10 * block + 7, dtype=dtype, device="meta")  # (meta tensors hold no memory)
    with _Allocations() as allocations:
        terms, sums = gs.grad_stats_reference([t, t[:100], t[:0]], norm_type=norm_type)
        gs.checksums_reference([t])
    assert terms.device.type == sums.device.type == "meta" and tuple(terms.shape) == (3,)
    assert allocations.largest <= block + 32, allocations.largest
    assert allocations.uploads == 0  # (an empty tensor's term was a host 0.0 copied up)


def test_the_device_inf_norm_is_the_largest_block_s() -> None:
    """The inf norm on a device, block by block, is the whole tensor's (NaN propagates); checked
    with the device branch on CPU tensors."""
    import offload.kernels._grad_stats as gs

    g = torch.Generator().manual_seed(3)
    t = torch.randn(3 * gs.TORCH_BLOCK + 5, generator=g)
    t[2 * gs.TORCH_BLOCK + 1] = -40.0
    assert float(gs._term_on_device(t, math.inf)) == 40.0
    t[7] = float("nan")
    assert math.isnan(float(gs._term_on_device(t, math.inf)))


def test_bench_read_bound_floor_from_the_read_speeds():
    """bench.membus.grad_stats states the clipped/unclipped floor of a read-bound step: a norm pass and a
    step reading at the same speed give 1 + 4/16; a slower norm pass raises it."""
    from bench.membus.grad_stats import read_bound_floor, render_markdown

    rows = {"grad_stats": {"read_gb_s": 20.0}, "step": {"read_gb_s": 20.0}}
    assert read_bound_floor(rows) == 1.25
    rows["grad_stats"]["read_gb_s"] = 10.0
    assert read_bound_floor(rows) == 1.5
    variants = {k: {"median_s": 0.01, "iqr_s": 0.0, "gb_s": 20.0, "best_gb_s": 21.0, "read_gb_s": 20.0}
                for k in ("grad_stats", "step", "fill")}
    text = render_markdown({"numel": 10, "threads": 2, "rounds": 1, "variants": variants,
                            "ratios": {}, "read_bound_floor": read_bound_floor(variants),
                            "load_before": (0, 0, 0), "load_after": (0, 0, 0)})
    assert "at least 1.250" in text and "| step | 10.00 | 0.00 | 20.0 | 21.0 | 20.0 |" in text
