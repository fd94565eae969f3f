"""What `bench.torch_optim_suite` runs PyTorch's ``test/test_optim.py`` AdamW cases with: an
``AdamW`` class that is :class:`offload.CPUOffloadAdamW` under torch's name and signature, the
OptimizerInfo that describes it, and the filter of what it refuses by design, written down here
and nowhere else.

The filter has three parts, each with where the refusal is documented:

* :data:`REFUSED_OPTIONS`: constructor options. An ``optim_inputs_func`` / ``optim_error_inputs_func``
  input that sets one is dropped (:func:`offload_optim_info`); a test that sets one itself is
  skipped by :class:`AdamW` at construction.
* :data:`REFUSED_PARAMS`: kinds of parameters (complex, float64, meta, strided slices). A test
  that builds the optimizer on one is skipped by :class:`AdamW` at construction.
* :data:`FILTERED_TESTS`: tests skipped by name (whole-object copies; a test that builds torch's
  own optimizers; a parameter in two groups), and :data:`REFUSED_ERROR_INPUTS`: error inputs torch
  only warns about and ours refuses (a parameter listed twice), dropped.

A skip is a claim that ``CPUOffloadAdamW`` refuses the input: :class:`AdamW` first builds
``CPUOffloadAdamW`` on the same arguments and skips only if that raises ``ValueError`` or
``TypeError``; if it is accepted, the test fails with :class:`FilterMismatch`.

``optim_db``'s AdamW entry is described by :func:`offload_optim_info`: ``supported_impls=()`` (one
implementation, torch's fused arithmetic; no foreach, for-loop or differentiable variant to
compare) and ``supports_complex=False``, so the tests parametrized over those are not
instantiated for it; the runner lists them with that reason.
"""

from __future__ import annotations

import copy
import unittest
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from offload import CPUOffloadAdamW

__all__ = ["FILTERED_TESTS", "REFUSED_ERROR_INPUTS", "REFUSED_OPTIONS", "REFUSED_PARAMS", "AdamW", "FilterMismatch", "make_adamw",
           "not_instantiated_reason", "offload_optim_info", "refused_option"]

_OPTIONS_DOC = "docs/optimizer.md 'Refused'"
_IMPL_DOC = "docs/integrations.md: the foreach and for-loop implementations (fused=False) are refused"

#: torch.optim.AdamW keyword -> (the value CPUOffloadAdamW refuses, where that is documented).
REFUSED_OPTIONS: dict[str, tuple[bool, str]] = {
    "amsgrad": (True, _OPTIONS_DOC),
    "maximize": (True, _OPTIONS_DOC),
    "capturable": (True, _OPTIONS_DOC),
    "differentiable": (True, _OPTIONS_DOC),
    "foreach": (True, _IMPL_DOC),
    "fused": (False, _IMPL_DOC),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamRefusal:
    """A kind of parameter CPUOffloadAdamW refuses at construction."""

    what: str
    """How the table names it."""
    doc: str
    """Where the refusal is documented."""
    applies: Callable[[torch.Tensor], bool]
    """Whether a parameter is of this kind."""


def _dense(p: torch.Tensor) -> bool:
    """Whether ``p`` covers one dense block (contiguous in some dimension order)."""
    if p.numel() <= 1:
        return True
    order = sorted(range(p.dim()), key=lambda d: p.stride(d))
    expected = 1
    for d in order:
        if p.size(d) != 1 and p.stride(d) != expected:
            return False
        expected *= p.size(d)
    return True


_DTYPE_DOC = "docs/optimizer.md 'Refused': any dtype but float32, bfloat16 and float16"

#: Kinds of parameters CPUOffloadAdamW refuses, in the order they are checked.
REFUSED_PARAMS: tuple[ParamRefusal, ...] = (
    ParamRefusal(what="meta parameters", doc="refused at construction: build after model.to_empty()",
                 applies=lambda p: p.device.type == "meta"),
    ParamRefusal(what="complex parameters", doc=_DTYPE_DOC, applies=lambda p: p.is_complex()),
    ParamRefusal(what="float64 parameters", doc=_DTYPE_DOC, applies=lambda p: p.dtype == torch.float64),
    ParamRefusal(what="strided-slice parameters", doc="docs/optimizer.md: a strided slice is refused at construction",
                 applies=lambda p: p.device.type != "meta" and not _dense(p)),
)

#: Test method names (as test_optim.py spells them) skipped, with the reason.
FILTERED_TESTS: dict[str, str] = {
    "test_deepcopy_copies_all_public_attrs": "whole-object copies are refused (copy.deepcopy/pickle raise TypeError; "
                                             "checkpoint opt.state_dict()): docs/optimizer.md 'Checkpoints'",
    "test_adamw_serialization": "not ours: it builds torch.optim.AdamW and torch.optim.Adam directly",
    "test_state_dict_deterministic": "a parameter in two groups (its last check extends param_groups with "
                                     "itself) is refused: docs/optimizer.md 'Refused'",
}

#: Error inputs (by ``desc``) where torch only warns and ours refuses, with where that is documented.
REFUSED_ERROR_INPUTS: dict[str, str] = {
    "a param group cannot have duplicate parameters": "a parameter listed twice is refused (ValueError): "
                                                      "docs/optimizer.md 'Refused'",
}


class FilterMismatch(AssertionError):
    """The filter says CPUOffloadAdamW refuses an input, and it accepted it."""


def refused_option(kwargs: dict[str, Any]) -> str | None:
    """``"name=value (doc)"`` for the first refused option ``kwargs`` sets, else None."""
    for name, (value, doc) in REFUSED_OPTIONS.items():
        given = kwargs.get(name)
        if isinstance(given, bool) and given == value:
            return f"{name}={value} ({doc})"
    return None


def _tensors(params: Any) -> list[torch.Tensor]:
    """The tensors of a materialised ``params`` argument (tensors, (name, tensor) pairs, groups)."""
    out: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            group = item.get("params", [])
            out.extend(_tensors([group] if isinstance(group, torch.Tensor) else group))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            out.append(item[1])
        elif isinstance(item, torch.Tensor):
            out.append(item)
    return out


def _refused_param(params: Any) -> str | None:
    tensors = _tensors(params)
    for refusal in REFUSED_PARAMS:
        if any(refusal.applies(p) for p in tensors):
            return f"{refusal.what} ({refusal.doc})"
    return None


def _skip_if_refused(params: Any, kwargs: dict[str, Any]) -> None:
    """Skip the running test where the filter says the input is refused, after checking that
    CPUOffloadAdamW does refuse it."""
    reason = refused_option(kwargs) or _refused_param(params)
    if reason is None:
        return
    try:
        CPUOffloadAdamW(params, **kwargs)
    except (ValueError, TypeError) as exc:
        raise unittest.SkipTest(f"filtered: {reason}; CPUOffloadAdamW: {exc}") from exc
    raise FilterMismatch(f"the filter says {reason} is refused, but CPUOffloadAdamW accepted it")


def make_adamw(base: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """A class named ``AdamW`` (test_optim.py branches on ``optim_cls.__name__``) with
    torch.optim.AdamW's signature, that skips filtered inputs and builds ``base`` on the rest.
    ``base`` is CPUOffloadAdamW, or torch.optim.AdamW to check that the filter alone fails nothing."""

    class AdamW(base):  # type: ignore[valid-type, misc]
        def __init__(self, params: Any, lr: Any = 1e-3, betas: Any = (0.9, 0.999), eps: float = 1e-8,
                     weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                     foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                     fused: bool | None = None) -> None:
            if isinstance(params, Iterator):
                params = list(params)  # a generator is read twice (the check, then the optimizer)
            kwargs = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad,
                      "maximize": maximize, "foreach": foreach, "capturable": capturable,
                      "differentiable": differentiable, "fused": fused}
            if isinstance(params, (list, tuple)):  # test_errors also passes None, a tensor, a dict
                _skip_if_refused(params, kwargs)
            super().__init__(params, **kwargs)

    AdamW.__qualname__ = "AdamW"
    AdamW.__doc__ = f"{base.__name__} under torch.optim.AdamW's name, filtered (bench.torch_optim_suite._filter)."
    return AdamW


#: CPUOffloadAdamW as test_optim.py sees it.
AdamW = make_adamw(CPUOffloadAdamW)


def _drop_refused(inputs: Iterable[Any], kwargs_of: Callable[[Any], dict[str, Any]]) -> list[Any]:
    return [i for i in inputs if refused_option(kwargs_of(i)) is None]


def offload_optim_info(info: Any, optim_cls: type[torch.optim.Optimizer] = AdamW) -> Any:
    """A copy of torch's AdamW ``OptimizerInfo`` for ``optim_cls``: inputs with a refused option
    dropped (construction and error inputs), ``supported_impls=()``, ``supports_complex=False``,
    ``supports_fused_on=()``; its decorators, schedulers and ``not_og_supported_flags`` as torch's."""
    ours = copy.copy(info)
    inputs_func, error_func = info.optim_inputs_func, info.optim_error_inputs_func

    def optim_inputs_func(device: Any, dtype: Any = None) -> list[Any]:
        return _drop_refused(inputs_func(device, dtype), lambda i: i.kwargs)

    def optim_error_inputs_func(device: Any, dtype: Any) -> list[Any]:
        kept = _drop_refused(error_func(device, dtype), lambda e: e.optimizer_error_input.kwargs)
        return [e for e in kept if e.optimizer_error_input.desc not in REFUSED_ERROR_INPUTS]

    ours.optim_cls = optim_cls
    ours.optim_inputs_func = optim_inputs_func
    ours.optim_error_inputs_func = optim_error_inputs_func
    ours.supported_impls = ()
    ours.supports_complex = False
    ours.supports_fused_on = ()
    return ours


def not_instantiated_reason(test: str) -> str:
    """Why a test torch instantiates for its AdamW is not instantiated for :func:`offload_optim_info`'s."""
    if "complex" in test:
        return "filtered: supports_complex=False (complex parameters: " + _DTYPE_DOC + ")"
    if "foreach" in test:
        return "filtered: supported_impls=() (foreach=True: " + _IMPL_DOC + ")"
    if "fused" in test or "cpu_load_state_dict" in test:
        return ("filtered: supported_impls=() (the test compares or sets fused=True/False: " + _IMPL_DOC
                + "; meta parameters are refused at construction)")
    return "filtered: supported_impls=() / supports_complex=False"
