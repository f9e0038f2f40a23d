"""The daemon as a user other than the trainer, in-process: opening a file under `root` that is
not world-readable fails with EACCES, as it would for a daemon outside the trainer's user and
group (the tests run as one user, often root, which reads everything)."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

OWNER = pwd.getpwuid(os.geteuid()).pw_name
"""Who owns the files the tests write."""


def as_another_user(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    real_open = os.open

    def opened(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        target = Path(path)
        if target.is_relative_to(root) and target.is_file() and not os.stat(target).st_mode & 0o004:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", opened)
