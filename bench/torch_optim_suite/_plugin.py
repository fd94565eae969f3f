"""The pytest plugin `bench.torch_optim_suite` runs PyTorch's ``test/test_optim.py`` with
(``-p bench.torch_optim_suite._plugin``): before the test file is imported it puts the optimizer under
test in ``optim_db``'s AdamW entry, skips :data:`bench.torch_optim_suite._filter.FILTERED_TESTS` by
name, and writes every test's outcome to a JSON file.

``--optim-suite-optimizer``: ``offload`` (CPUOffloadAdamW through the filter), ``torch-filtered``
(torch.optim.AdamW through the same filter: what the filter alone skips) or ``torch`` (optim_db
unchanged). ``--optim-suite-report PATH``: where the outcomes go, a list of ``{"test", "outcome",
"reason"}`` with outcome ``passed``, ``failed``, ``skipped`` or ``collected`` (``--collect-only``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

__all__ = ["OPTIMIZERS", "pytest_addoption", "pytest_collection_modifyitems", "pytest_configure"]

#: What ``--optim-suite-optimizer`` accepts.
OPTIMIZERS = ("torch", "torch-filtered", "offload")

_OUTCOMES: dict[str, dict[str, str]] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("torch_optim_suite")
    group.addoption("--optim-suite-optimizer", choices=OPTIMIZERS, default="offload",
                    help="the optimizer in optim_db's AdamW entry")
    group.addoption("--optim-suite-report", type=Path, default=None, help="write the outcomes here (JSON)")


def pytest_configure(config: pytest.Config) -> None:
    which = config.getoption("--optim-suite-optimizer")
    if which == "torch":
        return
    from torch.testing._internal import common_optimizers  # noqa: PLC0415 (needs expecttest)

    from bench.torch_optim_suite._filter import AdamW, make_adamw, offload_optim_info  # noqa: PLC0415

    optim_cls = AdamW if which == "offload" else make_adamw(torch.optim.AdamW)
    db = common_optimizers.optim_db
    index = next(i for i, info in enumerate(db) if info.optim_cls is torch.optim.AdamW)
    db[index] = offload_optim_info(db[index], optim_cls)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--optim-suite-optimizer") == "torch":
        return
    from bench.torch_optim_suite._filter import FILTERED_TESTS  # noqa: PLC0415

    for item in items:
        for name, reason in FILTERED_TESTS.items():
            if item.name == name or item.name.startswith(f"{name}_"):
                item.add_marker(pytest.mark.skip(reason=f"filtered: {reason}"))


def _reason(report: pytest.TestReport) -> str:
    longrepr: Any = report.longrepr
    if report.skipped and isinstance(longrepr, tuple):
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message)
    return str(longrepr or "")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    name = report.nodeid.rpartition("::")[2]
    if report.when == "call" or report.outcome != "passed":
        if name in _OUTCOMES and _OUTCOMES[name]["outcome"] != "passed":
            return  # a teardown after a failed call keeps the call's reason
        _OUTCOMES[name] = {"test": name, "outcome": report.outcome, "reason": "" if report.passed else _reason(report)}


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.getoption("collectonly"):
        for item in session.items:
            _OUTCOMES[item.name] = {"test": item.name, "outcome": "collected", "reason": ""}


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--optim-suite-report")
    if path is not None:
        Path(path).write_text(json.dumps(sorted(_OUTCOMES.values(), key=lambda o: o["test"]), indent=1))
