"""The shipped units: they verify with systemd's own tool, and the daemon's scores ≤ 2.0."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_reloader.engine.client import EXTENSION

UNITS = Path(__file__).parents[2] / "systemd"


@pytest.fixture
def units(tmp_path: Path) -> Path:
    """The units with their ExecStart binaries pointed at ones that exist here."""
    reloader = shutil.which("vllm-reloader") or str(Path(sys.executable).parent / "vllm-reloader")
    for unit in ("vllm-reloader.service", "vllm.service"):
        text = (UNITS / unit).read_text()
        text = text.replace("/opt/vllm-reloader/.venv/bin/vllm-reloader", reloader)
        text = text.replace("/opt/vllm/.venv/bin/python", sys.executable)
        (tmp_path / unit).write_text(text)
    return tmp_path


def analyze(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("systemd-analyze")
    assert tool, "systemd-analyze is missing: .ci/run installs the systemd package"
    return subprocess.run([tool, *args], capture_output=True, text=True, cwd=cwd, timeout=60)


def test_systemd_units_verify(units: Path):
    result = analyze("verify", "--man=no", "vllm-reloader.service", "vllm.service", cwd=units)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr


def test_systemd_reloader_unit_exposure_is_at_most_2(units: Path):
    result = analyze("security", "--offline=true", "--no-pager", "vllm-reloader.service", cwd=units)
    match = re.search(r"Overall exposure level for vllm-reloader\.service: ([0-9.]+)", result.stdout)
    assert match, result.stdout[-2000:] + result.stderr
    assert float(match.group(1)) <= 2.0


def test_systemd_reloader_unit_has_what_operators_rely_on():
    text = (UNITS / "vllm-reloader.service").read_text()
    for line in (
        "Type=notify",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "Restart=on-failure",
        "SyslogIdentifier=vllm-reloader",
        "Environment=PYTHONUNBUFFERED=1",
        "StateDirectory=vllm-reloader",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
        "SystemCallFilter=@system-service",
        "PartOf=vllm.service",
    ):
        assert line in text.splitlines(), line
    assert re.search(r"^WatchdogSec=\d+", text, re.M)
    assert "--log-priority-prefix" in text
    assert not re.search(r"^PrivateNetwork=", text, re.M), "it must reach the engine"


def test_systemd_engine_unit_binds_dev_endpoints_to_loopback():
    text = (UNITS / "vllm.service").read_text()
    assert "Environment=VLLM_SERVER_DEV_MODE=1" in text
    exec_start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    assert "--host 127.0.0.1" in exec_start or "--uds" in exec_start


def test_systemd_engine_unit_loads_through_the_extension():
    """Only the extension reads exactly the verified bytes and never maps a writer's file."""
    text = (UNITS / "vllm.service").read_text()
    exec_start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    assert f"--worker-extension-cls {EXTENSION}" in exec_start


def test_systemd_reloader_unit_does_not_restart_a_setup_error():
    """Exit 2 means "the engine or config is not set up": restarting would loop forever."""
    text = (UNITS / "vllm-reloader.service").read_text()
    assert "RestartPreventExitStatus=2" in text.splitlines()


def test_systemd_units_share_a_hub_cache_the_sandboxed_daemon_can_read():
    """ProtectHome=yes hides /home: the engine's hub cache must be elsewhere, and the same for both."""

    def cache(unit: str) -> str:
        text = (UNITS / unit).read_text()
        [found] = re.findall(r"^Environment=HF_HUB_CACHE=(\S+)$", text, re.M)
        return found

    assert cache("vllm-reloader.service") == cache("vllm.service")
    assert not cache("vllm.service").startswith(("/home", "/root", "/run/user", "/tmp"))
    assert "ProtectHome=yes" in (UNITS / "vllm-reloader.service").read_text().splitlines()


def test_systemd_reloader_unit_bounds_its_memory_and_says_why():
    """A runaway daemon is killed and restarted, not the engine; the comment above the line
    says what the daemon holds and why the number."""
    text = (UNITS / "vllm-reloader.service").read_text()
    [limit] = re.findall(r"^MemoryMax=(\d+)G$", text, re.M)
    assert int(limit) >= 2, "above the ~1.3 GB measured at the [gate] bounds"
    comment = text.split("\nMemoryMax=")[0].rsplit("\n\n", 1)[-1].split("# Memory:", 1)[1]
    for reason in ("download_concurrency x part_size", "digest_threads", "[gate] bounds", "Page cache"):
        assert reason in comment.replace("\n# ", " "), reason
    assert "Restart=on-failure" in text.splitlines()  # restarts after an OOM kill (on-abort would not)


def test_the_units_paths_and_user_are_the_ones_the_readme_install_makes():
    """A person following the README's production install gets what the units start."""
    readme = (UNITS.parent / "README.md").read_text()
    (install,) = [b for b in re.findall(r"```sh\n(.*?)```", readme, flags=re.S) if "useradd" in b]
    for unit in ("vllm-reloader.service", "vllm.service"):
        text = (UNITS / unit).read_text()
        lines = [line for line in text.splitlines() if line.startswith(("ExecStart=", "ReadOnlyPaths="))]
        paths = re.findall(r"(/(?:opt|etc|srv)/[^\s]+)", "\n".join(lines))
        assert paths, unit
        for path in paths:
            parts = Path(path).parts  # ("/", "opt", "vllm", ".venv", "bin", "python")
            made = [Path(*parts[:n]) for n in range(len(parts), 2, -1) if str(Path(*parts[:n])) in install]
            assert made, f"{unit}: {path}: nothing in the README's install makes it"
            rest = parts[len(made[0].parts) :]
            venv_bin = rest in (("bin", "python"), ("bin", "vllm-reloader")) and made[0].name == ".venv"
            assert not rest or venv_bin or (len(rest) == 1 and rest[0] in install), (unit, path)
        (user,) = re.findall(r"^User=(\S+)$", text, flags=re.M)
        assert re.search(rf"useradd .*\b{user}$", install, flags=re.M), (unit, user)
