"""torch's own optimizer test inputs (``torch.testing._internal.common_optimizers.optim_db``, its
AdamW entry, CPU) against CPUOffloadAdamW: every construction input, with each of torch's
implementation flags, is stepped bitwise as ``torch.optim.AdamW(fused=True)`` or refused with a
``ValueError`` naming the option; every error input raises the error type torch raises; the
kinds of parameters torch's test_optim.py builds that we refuse raise ``ValueError`` at
construction. ``python -m bench.torch_optim_suite`` runs torch's test file itself."""

from __future__ import annotations

import copy
import importlib
import os
import pickle
import re
import warnings
from typing import Any

import pytest
import torch

from offload import CPUOffloadAdamW, OffloadSettings

_HELPERS = "torch.testing._internal.common_optimizers"  # imports expecttest, a test extra
# A venv installed before the extra listed expecttest skips here; CI (CI set) installs it and fails without it.
common_optimizers = (importlib.import_module(_HELPERS) if os.environ.get("CI") else pytest.importorskip(
    _HELPERS, reason="torch's test helpers need expecttest: pip install -c constraints.txt -e '.[test]'"))

INFO = next(i for i in common_optimizers.optim_db if i.optim_cls is torch.optim.AdamW)
#: torch AdamW options we refuse (docs/optimizer.md 'Refused', docs/integrations.md), and the refused value.
REFUSED = {"amsgrad": True, "maximize": True, "capturable": True, "differentiable": True,
           "foreach": True, "fused": False}
STEPS = 7


def _inputs() -> list[Any]:
    """Each CPU construction input, without a flag, and with each of torch's flags on and off."""
    out = list(INFO.optim_inputs_func(device="cpu"))
    out += common_optimizers._get_optim_inputs_including_global_cliquey_kwargs("cpu", torch.float32, INFO)
    return out


INPUTS = _inputs()


def _refused(kwargs: dict[str, Any]) -> str | None:
    return next((k for k, v in REFUSED.items() if kwargs.get(k) is v), None)


def _model() -> list[torch.nn.Parameter]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1), torch.nn.Sigmoid())
    scalar = torch.nn.Parameter(torch.randn(()))  # torch's derived-optimizer tests end with a 0-d parameter
    return [*model.parameters(), scalar]


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    """torch's fused-vs-forloop schedule: no gradients at step 2, the second layer frozen at 3-4."""
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]).reshape(3, 2)
    w1, b1, w2, b2, scalar = params
    for i in range(STEPS):
        opt.zero_grad()
        if i != 2:
            frozen = i in (3, 4)
            h = torch.sigmoid(x @ w1.t() + b1)
            out = torch.sigmoid(h @ (w2.detach() if frozen else w2).t() + (b2.detach() if frozen else b2))
            out.sum().backward()
            scalar.grad = torch.full_like(scalar, 0.25 * (i + 1))
        opt.step()


@pytest.mark.parametrize("kernel_name", ["torch", "fused-mp"])
@pytest.mark.parametrize("optim_input", INPUTS,
                         ids=lambda i: re.sub(r"\W+", "-", f"{i.desc}-{sorted(i.kwargs.items())}"))
def test_each_input_steps_as_torch_fused_or_is_refused(optim_input: Any, kernel_name: str,
                                                       request: pytest.FixtureRequest,
                                                       single_threaded_main: None) -> None:
    kwargs = copy.deepcopy(optim_input.kwargs)
    option = _refused(kwargs)
    if option is not None:
        with pytest.raises(ValueError, match=option):
            CPUOffloadAdamW(_model(), **kwargs)
        return
    if kernel_name == "fused-mp":
        request.getfixturevalue("kernel")  # skips without a C++ toolchain
    ref_params, ours_params = _model(), _model()
    ref = torch.optim.AdamW(ref_params, **{**kwargs, "fused": True, "foreach": False})
    settings = OffloadSettings(threads=1, chunk_numel=1024, kernel=kernel_name)
    ours = CPUOffloadAdamW(ours_params, **kwargs, settings=settings)
    _train(ref, ref_params)
    _train(ours, ours_params)
    for i, (a, e) in enumerate(zip(ours_params, ref_params)):
        assert torch.equal(a, e), f"parameter {i} differs from torch's fused AdamW"
    ref_state, ours_state = ref.state_dict()["state"], ours.state_dict()["state"]
    assert ref_state.keys() == ours_state.keys()
    for index, state in ref_state.items():
        for key, value in state.items():
            assert torch.equal(ours_state[index][key], value), f"state[{index}][{key!r}] differs"


ERROR_INPUTS = INFO.optim_error_inputs_func(device="cpu", dtype=torch.float32)
#: Error inputs torch only warns about and ours refuses (docs/optimizer.md, "Refused"): a
#: parameter listed twice would be stepped twice per step by torch's AdamW.
REFUSED_ERRORS = {"a param group cannot have duplicate parameters": "appears twice"}


def _raised(cls: type, params: Any, kwargs: dict[str, Any]) -> type:
    """What constructing ``cls`` does: the exception type, UserWarning, or type(None)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        try:
            cls(params, **kwargs)
        except Exception as exc:  # noqa: BLE001 (the type is what is compared)
            return type(exc)
    return type(None)


@pytest.mark.parametrize("error_input", ERROR_INPUTS, ids=lambda e: re.sub(r"\W+", "-", e.optimizer_error_input.desc))
def test_each_error_input_raises_what_torch_raises(error_input: Any) -> None:
    """The error type torch raises, and the message torch's test matches; where torch only
    warns, ours refuses with a ValueError saying why."""
    assert error_input.error_on == common_optimizers.OptimizerErrorEnum.CONSTRUCTION_ERROR
    i = error_input.optimizer_error_input
    params = [torch.nn.Parameter(torch.randn(1, 1))] if i.params is None else i.params
    expected = _raised(torch.optim.AdamW, params, copy.deepcopy(i.kwargs))
    assert issubclass(expected, error_input.error_type), f"torch itself: {expected}"
    if i.desc in REFUSED_ERRORS:
        with pytest.raises(ValueError, match=REFUSED_ERRORS[i.desc]):
            CPUOffloadAdamW(params, **copy.deepcopy(i.kwargs))
        return
    assert _raised(CPUOffloadAdamW, params, copy.deepcopy(i.kwargs)) is expected
    if expected is not type(None) and error_input.error_regex and "foreach" not in i.kwargs:
        with pytest.raises(expected, match=error_input.error_regex):
            CPUOffloadAdamW(params, **copy.deepcopy(i.kwargs))


#: Parameters torch's test_optim.py builds that ours refuses at construction (docs/optimizer.md).
REFUSED_PARAMS = {
    "complex (test_complex)": lambda: torch.randn(10, 5, dtype=torch.complex64, requires_grad=True),
    "float64 (test_foreach_matches_forloop)": lambda: torch.randn(2, 3, dtype=torch.float64, requires_grad=True),
    "strided slice (test_forloop_goes_right_direction, contiguous=False)":
        lambda: torch.nn.Parameter(torch.randn(10, 5, 2)[..., 0]),
    "meta (test_fused_error_on_params_on_meta)": lambda: torch.nn.Parameter(torch.empty(2, 3, device="meta")),
}


@pytest.mark.parametrize("what", REFUSED_PARAMS)
def test_refused_parameters_raise_value_error(what: str) -> None:
    with pytest.raises(ValueError, match="parameter"):
        CPUOffloadAdamW([REFUSED_PARAMS[what]()])


@pytest.mark.parametrize("copy_fn", [copy.copy, copy.deepcopy, pickle.dumps], ids=["copy", "deepcopy", "pickle"])
def test_whole_object_copies_raise_type_error(copy_fn: Any) -> None:
    """test_deepcopy_copies_all_public_attrs's deepcopy: refused, saying how to checkpoint."""
    opt = CPUOffloadAdamW([torch.nn.Parameter(torch.randn(2, 3))])
    with pytest.raises(TypeError, match="state_dict"):
        copy_fn(opt)


def test_a_repeated_group_is_refused_naming_the_repetition() -> None:
    """test_state_dict_deterministic's last check (torch issue 36831) extends ``param_groups``
    with itself: every parameter is then in two groups, which torch's AdamW would step twice per
    step; ours refuses at its next call (docs/optimizer.md, "Refused")."""
    opt = CPUOffloadAdamW([torch.nn.Parameter(torch.randn(2, 3))])
    opt.param_groups.extend(opt.param_groups)
    with pytest.raises(ValueError, match="appears twice in the optimizer's param_groups"):
        opt.state_dict()
    opt.close()
