"""Fixtures shared by every test folder live in `tests/support/` (fakes, real peers)."""

pytest_plugins = [
    "tests.support.checkpoints",
    "tests.support.daemon_fixtures",
    "tests.support.e2e_world",
    "tests.support.service_fixtures",
    "tests.support.store_fixtures",
]
