"""Fixtures shared by every test folder live in `tests/support/` (fakes, real peers)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest
import structlog

pytest_plugins = [
    "tests.support.checkpoints",
    "tests.support.daemon_fixtures",
    "tests.support.e2e_world",
    "tests.support.service_fixtures",
    "tests.support.store_fixtures",
]


@pytest.fixture(autouse=True)
def logging_as_it_was() -> Iterator[None]:
    """A test that configures logging (`cli.main run` does) leaves it as it found it: loggers of
    later tests would write to that test's closed capture stream."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


LONGEST = ("test_bench.py", "test_e2e_engines.py", "test_e2e_deployments.py")
"""About four minutes each on 2 cores, one worker each: handed out first."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Real-engine tests first (`scripts/test` hands out whole files to its pytest-xdist
    workers, `--dist loadfile`: a module's shared engine starts once).

    `xla` tests need torch_xla, which pins its own torch and so lives in its own venv
    (scripts/test runs them there with `-m xla`): elsewhere they are deselected, and a run
    that selects nothing but them fails with "no tests ran"."""
    # The real-engine tests first, the longest files before them (a stable sort): the long ones
    # spread over the workers, not left for one worker at the end while the others idle.
    # Only on xdist's workers: one process keeps the files' order (test_e2e.py's first test sees
    # the session's `world` before any other module moved it).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda i: (i.path.name not in LONGEST, i.get_closest_marker("engine") is None))
    if importlib.util.find_spec("torch_xla") is not None:
        return
    xla = [item for item in items if item.get_closest_marker("xla")]
    if xla:
        config.hook.pytest_deselected(items=xla)
        items[:] = [item for item in items if not item.get_closest_marker("xla")]
