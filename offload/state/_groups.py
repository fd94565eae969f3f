"""A param group's hyper-parameters and options, checked (at construction, ``add_param_group``,
a group appended to ``param_groups`` directly and ``load_state_dict``), and read at each chunk
launch (:func:`hyper_of`, after an lr scheduler may have changed them).

Every check names the bad value and where it came from (``where``: "", " in param group 2",
" in loaded param group 0").
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from offload.kernels._adamw import Hyper

__all__ = ["UNSUPPORTED", "check_hyper", "check_options", "check_param_group", "hyper_of", "scalar"]


#: Options of torch.optim.AdamW this optimizer does not implement, with the only accepted values.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "amsgrad": (False,),
    "maximize": (False,),
    "capturable": (False,),
    "differentiable": (False,),
    "foreach": (None, False),
    "fused": (None, True),
    "decoupled_weight_decay": (True,),
}


def check_options(where: str, options: dict[str, Any]) -> None:
    """``ValueError`` for an option of :data:`UNSUPPORTED` set to a value this optimizer lacks."""
    for name, accepted in UNSUPPORTED.items():
        if name not in options:
            continue
        value = options[name]
        if value not in accepted:
            raise ValueError(
                f"CPUOffloadAdamW does not support {name}={value!r}{where}: expected one of "
                f"{accepted} (neither of the step's kernels, the native fused-mp one and torch's fused CPU "
                "AdamW, implements anything else)"
            )


def scalar(name: str, value: Any) -> float:
    """``value`` (a number or a 1-element tensor) as a float; ``ValueError`` naming ``name``."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            kind = "Tensor lr must be 1-element" if name == "lr" else f"Tensor {name} must be 1-element"
            raise ValueError(f"{kind}: {name}={value!r}: expected a float or a 1-element tensor")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r}: expected a float")
    return float(value)


def check_hyper(where: str, group: dict[str, Any]) -> None:
    """``ValueError`` unless the group's lr, betas, eps and weight_decay are valid AdamW values."""
    lr = scalar("lr", group["lr"])
    if not (math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"Invalid learning rate: {group['lr']} "
                         f"(lr={group['lr']!r}{where}: expected a finite float >= 0)")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas={betas!r}{where}: expected a pair (beta1, beta2)")
    for i, b in enumerate(betas):
        v = scalar(f"betas[{i}]", b)
        if not 0.0 <= v < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b} "
                             f"(betas[{i}]={b!r}{where}: expected 0 <= beta < 1)")
    eps = scalar("eps", group["eps"])
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"Invalid epsilon value: {group['eps']} "
                         f"(eps={group['eps']!r}{where}: expected a finite float >= 0)")
    wd = scalar("weight_decay", group["weight_decay"])
    if not (math.isfinite(wd) and wd >= 0.0):
        raise ValueError(
            f"Invalid weight_decay value: {group['weight_decay']} "
            f"(weight_decay={group['weight_decay']!r}{where}: expected a finite float >= 0)"
        )


def check_param_group(where: str, param_group: dict[str, Any], defaults: dict[str, Any]
                      ) -> tuple[dict[str, Any], list[Any], list[Tensor]]:
    """A group for ``add_param_group`` checked: (the group, betas as floats; its ``params`` as a
    list, (name, tensor) pairs kept; its tensors). ``ValueError`` for a bad option or
    hyper-parameter, or a parameter listed twice."""
    check_options(where, param_group)
    check_hyper(where, {**defaults, **param_group})
    if isinstance(param_group.get("betas"), (tuple, list)) and len(param_group["betas"]) == 2:
        param_group = dict(param_group)
        param_group["betas"] = tuple(scalar("betas", b) for b in param_group["betas"])
    params = param_group["params"]
    plist = [params] if isinstance(params, Tensor) else list(params)
    tensors = [p[1] if isinstance(p, tuple) else p for p in plist]
    if len({id(p) for p in tensors}) != len(tensors):
        raise ValueError(f"a parameter appears twice{where}")
    return param_group, plist, tensors


def hyper_of(group: dict[str, Any], *, lr_into: Tensor | None = None) -> Hyper:
    """The group's hyper-parameters now (an lr scheduler may have changed them since the last step).

    A tensor lr is copied to the host: a CPU one is cloned; a device one is copied without waiting
    into ``lr_into`` (a pinned 0-d host tensor of its dtype, on the current stream: the caller
    records after this the event the worker waits for before it reads the value, so no host-device
    sync) or, without ``lr_into``, with a blocking copy (one sync: call it once per group and step,
    not per chunk)."""
    lr = group["lr"]
    if isinstance(lr, Tensor):
        lr = _lr_on_host(lr.detach().reshape(()), lr_into)
    beta1, beta2 = (scalar("betas", b) for b in group["betas"])
    return Hyper(
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=scalar("weight_decay", group["weight_decay"]),
        eps=scalar("eps", group["eps"]),
    )


def _lr_on_host(lr: Tensor, into: Tensor | None) -> Tensor:
    if lr.device.type == "cpu":
        return lr.clone()
    if into is None or into.dtype != lr.dtype:
        return lr.to("cpu")
    into.copy_(lr, non_blocking=True)
    return into
