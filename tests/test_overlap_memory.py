"""Host memory of each overlap mode: the committed slabs and the second generation, per parameter.

The figures the README's overlap section gives (counted bytes, not RSS: the same on every run)."""

from __future__ import annotations

import pytest
import torch

from offload import CPUOffloadAdamW, OffloadSettings

pytestmark = pytest.mark.usefixtures("single_threaded_main")


def _bytes_per_param(dtype: torch.dtype, **kw) -> tuple[float, float, int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).to(dtype)
    n = sum(p.numel() for p in model.parameters())
    if kw.get("speculation_limit") == "quarter":
        kw["speculation_limit"] = n // 4
    opt = CPUOffloadAdamW(model.parameters(), settings=OffloadSettings(threads=1, chunk_numel=8192), **kw)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 256, dtype=dtype)).float().square().mean().backward()
        opt.step()
    second = opt._layout.slabs.next_nbytes
    speculated = opt.last_stats.speculated_chunks
    opt.close()
    return opt._layout.slabs.nbytes / n, second / n, speculated


@pytest.mark.parametrize(("dtype", "plain"), [(torch.float32, 8.0), (torch.bfloat16, 12.0)])
def test_bytes_per_parameter_of_each_mode(dtype: torch.dtype, plain: float) -> None:
    assert _bytes_per_param(dtype) == (plain, 0.0, 0)
    # The committed state as without overlap (an fp32 parameter is its own master), plus the
    # second generation: master (fp32: a scratch place for the new weights) and moments.
    slabs, second, speculated = _bytes_per_param(dtype, overlap_backward=True)
    assert (slabs, second) == (plain, 12.0) and speculated == 65  # every chunk speculated
    # A quarter: the last two Linear(256, 256) (2 x 65,792 elements, exactly a quarter: their
    # 131,584 elements in 17 chunks of at most 8,192); the rest of the model has no second
    # generation and runs in step().
    slabs, second, speculated = _bytes_per_param(dtype, overlap_backward=True, speculation_limit="quarter")
    assert slabs == plain and second == 3.0 and speculated == 17


def test_speculation_limit_zero_starts_nothing_and_bad_limits_raise() -> None:
    assert _bytes_per_param(torch.float32, overlap_backward=True, speculation_limit=0)[1:] == (0.0, 0)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"speculation_limit=-1: expected None or an int >= 0"):
        CPUOffloadAdamW(model.parameters(), overlap_backward=True, speculation_limit=-1)
    with pytest.raises(ValueError, match="without overlap_backward=True"):
        CPUOffloadAdamW(model.parameters(), speculation_limit=10)
