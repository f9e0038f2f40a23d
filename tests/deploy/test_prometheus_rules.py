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


def exported_names() -> set[str]:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {
        family.name + suffix
        for family in Metrics().registry.collect()
        for suffix in suffixes.get(family.type, ("",))
    }


def test_alerting_rules_name_only_metrics_the_daemon_exports():
    named = set(re.findall(r"\bvllm_reloader_\w+", (RULES / "alerts.yml").read_text()))
    assert named and named <= exported_names(), f"not exported: {named - exported_names()}"


def test_grafana_dashboard_queries_only_metrics_the_daemon_exports_and_promtool_parses_them(tmp_path: Path):
    import json

    dashboard = json.loads((RULES.parent / "grafana" / "vllm-reloader.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    named = {name for expr in exprs for name in re.findall(r"\bvllm_reloader_\w+", expr)}
    assert named and named <= exported_names(), f"not exported: {named - exported_names()}"
    rules = tmp_path / "dashboard.yml"  # each query as a recording rule: promtool parses PromQL
    rules.write_text(
        "groups:\n  - name: dashboard\n    rules:\n"
        + "".join(
            f"      - record: dashboard:q{i}\n        expr: {json.dumps(e)}\n" for i, e in enumerate(exprs)
        )
    )
    done = subprocess.run(
        [promtool(), "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
