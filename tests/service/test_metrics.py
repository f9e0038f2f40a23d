"""Prometheus metrics scraped over HTTP from a running daemon subprocess."""

from __future__ import annotations

import hashlib
import re
import time

import httpx

from tests.support.checkpoints import TENSORS
from tests.support.engine_fixtures import free_port


def scrape(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_metrics_count_reloads_rejections_and_engine_state(service, make_checkpoint):
    start, _engine, notify, config, root = service
    port = free_port()
    config.write_text(config.read_text() + f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
    daemon = start()
    notify.wait_for("READY=1")
    make_checkpoint("step-2", step=2, root=root)
    daemon.wait_for("reload.succeeded", version="step-2")
    make_checkpoint("step-3", step=3, root=root, shapes={**TENSORS, "lm_head.weight": (17, 8)})
    daemon.wait_for("checkpoint.rejected", name="step-3")
    url = f"http://127.0.0.1:{port}/metrics"
    engine = 'engine="' + re.search(r'url = "([^"]+)"', config.read_text())[1] + '"'  # type: ignore[index]
    deadline = time.monotonic() + 5
    while (values := scrape(url)).get('vllm_reloader_rejected_total{check="layout"}') != 1.0:
        assert time.monotonic() < deadline, values
        time.sleep(0.05)
    assert values["vllm_reloader_reloads_total{" + engine + ',result="succeeded"}'] == 1.0
    assert values["vllm_reloader_serving_step{" + engine + "}"] == 2.0
    fingerprint = hashlib.sha256((root / "step-2" / "manifest.json").read_bytes()).hexdigest()
    info = [k for k in values if k.startswith("vllm_reloader_serving_info{")]
    assert info == [
        "vllm_reloader_serving_info{" + engine + f',fingerprint="{fingerprint}",version="step-2"' + "}"
    ], "one series per engine: what it serves now, by name and content"
    assert values["vllm_reloader_engine_up{" + engine + "}"] == 1.0
    assert values["vllm_reloader_reloaded_bytes_total{" + engine + "}"] > 0
    assert values["vllm_reloader_reload_duration_seconds_count{" + engine + "}"] == 1.0
    assert values["vllm_reloader_detection_lag_seconds_count"] == 1.0
    assert daemon.stop() == 0
