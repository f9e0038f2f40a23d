"""The shipped alerting rules load in Prometheus, each alert fires from synthetic series
(`promtool test rules`), and every metric they name is one the daemon exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from vllm_reloader.service.metrics import Metrics

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is missing: scripts/test installs it (apt-get install prometheus)")
    return found


@pytest.mark.parametrize("command", [["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]])
def test_promtool_passes_the_alerting_rules(command: list[str]):
    done = subprocess.run([promtool(), *command], cwd=RULES, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_alerting_rules_name_only_metrics_the_daemon_exports():
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    exported = {
        family.name + suffix
        for family in Metrics().registry.collect()
        for suffix in suffixes.get(family.type, ("",))
    }
    named = set(re.findall(r"\bvllm_reloader_\w+", (RULES / "alerts.yml").read_text()))
    assert named and named <= exported, f"not exported: {named - exported}"
