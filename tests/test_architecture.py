"""The layout's rules, checked: import direction and circles (import-linter's contracts in
pyproject.toml), the extension standing alone, the daemon without torch, module size."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_reloader

PACKAGE = Path(vllm_reloader.__file__).parent
PYPROJECT = PACKAGE.parents[1] / "pyproject.toml"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
MAX_LINES = 400
DAEMON_DEPENDENCIES = ("blake3", "httpx", "obstore", "prometheus_client", "pydantic", "structlog", "watchdog")


def lint_imports(package_parent: Path) -> subprocess.CompletedProcess[str]:
    """import-linter on the package found under `package_parent`, with the project's contracts."""
    return subprocess.run(
        [str(LINT_IMPORTS), str(PYPROJECT), "--no-cache"],
        cwd=package_parent,
        env={**os.environ, "PYTHONPATH": str(package_parent)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_contracts_hold():
    result = lint_imports(PACKAGE.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "wrong_import", "contract"),
    [
        ("checkpoint/gate.py", "from ..service import daemon", "Folders are the data flow"),
        ("sources/remote.py", "from ..engine import client", "Folders are the data flow"),
        ("extension/readers.py", "from ..checkpoint import manifest", "The extension runs inside vLLM"),
        ("extension/worker.py", "import pydantic", "The extension runs inside vLLM"),
        ("engine/client.py", "import torch", "The daemon never imports torch"),
        (
            "service/status.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .daemon import Daemon",
            "No import circles",
        ),
    ],
)
def test_import_contracts_fail_on_a_wrong_import(
    tmp_path: Path, module: str, wrong_import: str, contract: str
):
    copy = tmp_path / "vllm_reloader"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / module).open("a") as f:
        f.write(f"\n{wrong_import}\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken.replace("\n", " "), result.stdout


def test_extension_imports_with_only_torch_and_safetensors():
    """On an engine host the daemon's own dependencies may be missing: block them all."""
    code = f"""
import sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {DAEMON_DEPENDENCIES!r}:
            raise ImportError(name + " is not installed here")
sys.meta_path.insert(0, Missing())
from vllm_reloader.extension import ReloadExtension
assert callable(ReloadExtension.reloader_load_checkpoint)
print(sorted(m for m in sys.modules if m.startswith("vllm_reloader")))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(
        [
            "vllm_reloader",
            "vllm_reloader.checkpoint",
            "vllm_reloader.checkpoint.files",
            "vllm_reloader.checkpoint.staged",
            "vllm_reloader.errors",
            "vllm_reloader.extension",
            "vllm_reloader.extension.probe",
            "vllm_reloader.extension.readers",
            "vllm_reloader.extension.worker",
            "vllm_reloader.failpoints",
        ]
    )


def test_no_daemon_module_imports_torch_or_vllm():
    """The daemon talks HTTP; only the extension (inside the engine) and the demo's model
    writer may need torch. (Files, not pkgutil.walk_packages: that imports every package.)
    numpy is the non-finite scan's and the adapter gate's alone: the import contracts hold it there."""
    skip = ("vllm_reloader.extension", "vllm_reloader.tools.tinymodel", "vllm_reloader.__main__")
    names = sorted(
        ".".join(("vllm_reloader", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(
            ".__init__"
        )
        for path in PACKAGE.rglob("*.py")
    )
    daemon = [name for name in names if not name.startswith(skip)]
    assert len(daemon) > 30
    code = (
        "import importlib, sys\n"
        f"for name in {daemon!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(n for n in ('torch', 'vllm', 'transformers') if n in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout == "[]\n"


def test_no_module_is_past_the_size_where_it_is_two_things():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert len(sizes) > 30, "every module was looked at"
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
