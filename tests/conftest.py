"""Fixtures shared by every test folder live in `tests/support/` (fakes, real peers)."""

from __future__ import annotations

import importlib.util

import pytest

pytest_plugins = [
    "tests.support.checkpoints",
    "tests.support.daemon_fixtures",
    "tests.support.e2e_world",
    "tests.support.service_fixtures",
    "tests.support.store_fixtures",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`xla` tests need torch_xla, which pins its own torch and so lives in its own venv
    (scripts/test runs them there with `-m xla`): elsewhere they are deselected, and a run
    that selects nothing but them fails with "no tests ran"."""
    if importlib.util.find_spec("torch_xla") is not None:
        return
    xla = [item for item in items if item.get_closest_marker("xla")]
    if xla:
        config.hook.pytest_deselected(items=xla)
        items[:] = [item for item in items if not item.get_closest_marker("xla")]
