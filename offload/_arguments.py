"""The constructor's own arguments, checked: ``autotune``, ``settings`` and ``plan``, the
defaults (lr, betas, eps, weight_decay), ``speculation_limit``. A param group's checks are
``offload.state._groups``'s (they also run at ``add_param_group`` and ``load_state_dict``)."""

from __future__ import annotations

from typing import Any

import torch

from autotune import AutotuneConfig
from offload._settings import OffloadSettings
from offload.state._groups import check_hyper, scalar
from offload.threads._plan import ThreadPlan

__all__ = ["adamw_defaults", "check_arguments", "check_limit", "check_state_dtype"]


def check_arguments(*, autotune: Any, settings: Any, plan: Any) -> AutotuneConfig | None:
    """The constructor's ``autotune`` as a config (None: not tuned); ``TypeError`` for a wrong
    type, ``ValueError`` for ``plan`` with ``settings.threads``."""
    if autotune is True:
        autotune = AutotuneConfig()
    if autotune is not False and autotune is not None and not isinstance(autotune, AutotuneConfig):
        raise TypeError(f"autotune={autotune!r}: expected a bool or an autotune.AutotuneConfig")
    if settings is not None and not isinstance(settings, OffloadSettings):
        raise TypeError(f"settings={settings!r}: expected an OffloadSettings or None")
    if plan is not None and not isinstance(plan, ThreadPlan):
        raise TypeError(f"plan={plan!r}: expected an offload.ThreadPlan or None")
    if plan is not None and settings is not None and settings.threads is not None:
        raise ValueError(f"settings.threads={settings.threads!r} and plan=...: pass one of them")
    return autotune or None


def adamw_defaults(*, lr: Any, betas: Any, eps: Any, weight_decay: Any) -> dict[str, Any]:
    """The optimizer's defaults (torch AdamW's keys; betas as floats), checked."""
    if isinstance(betas, (tuple, list)) and len(betas) == 2:
        if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
            # torch.optim.AdamW's rule (and message): a float and a Tensor are never mixed.
            raise ValueError(f"betas={betas!r}: betas must be either both floats or both Tensors")
        betas = (scalar("betas[0]", betas[0]), scalar("betas[1]", betas[1]))
    defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    defaults.update({"amsgrad": False, "maximize": False, "foreach": None})
    defaults.update({"capturable": False, "differentiable": False, "fused": None})
    check_hyper("", defaults)
    return defaults


def check_state_dtype(state_dtype: Any, rounding: Any = "nearest", seed: Any = 0) -> int | None:
    """``state_dtype``: torch.float32 or torch.bfloat16; ``rounding``: "nearest", or "stochastic"
    with bf16 moments and an int ``seed`` in [0, 2**63). Returns the seed of stochastic rounding,
    or None."""
    if state_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"state_dtype={state_dtype!r}: expected torch.float32 or torch.bfloat16 (the moments' "
                         "dtype in host memory)")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"state_rounding={rounding!r}: expected 'nearest' or 'stochastic'")
    if rounding == "nearest":
        return None
    if state_dtype != torch.bfloat16:
        raise ValueError("state_rounding='stochastic' rounds bf16 moments: expected state_dtype=torch.bfloat16, "
                         f"got {state_dtype}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63:
        raise ValueError(f"state_rounding_seed={seed!r}: expected an int in [0, 2**63)")
    return seed


def check_limit(limit: Any, overlap_backward: bool) -> int | None:
    """``speculation_limit``: None or an int >= 0, and only with ``overlap_backward``."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"speculation_limit={limit!r}: expected None or an int >= 0 (elements)")
    if not overlap_backward:
        raise ValueError(f"speculation_limit={limit!r} without overlap_backward=True: nothing speculates")
    return limit
