"""Prometheus metrics scraped over HTTP from a running daemon subprocess."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from pathlib import Path

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


def scrape_until(url: str, done: Callable[[dict[str, float]], bool]) -> dict[str, float]:
    deadline = time.monotonic() + 10
    while not done(values := scrape(url)):
        assert time.monotonic() < deadline, values
        time.sleep(0.05)
    return values


def with_metrics(config: Path) -> tuple[str, str]:
    """Turns metrics on; returns their URL and the engine's label as the scrape shows it."""
    port = free_port()
    config.write_text(config.read_text() + f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
    engine = 'engine="' + re.search(r'url = "([^"]+)"', config.read_text())[1] + '"'  # type: ignore[index]
    return f"http://127.0.0.1:{port}/metrics", engine


def test_metrics_count_reloads_rejections_and_engine_state(service, make_checkpoint):
    start, _engine, notify, config, root = service
    url, engine = with_metrics(config)
    daemon = start()
    notify.wait_for("READY=1")
    make_checkpoint("step-2", step=2, root=root)
    daemon.wait_for("reload.succeeded", version="step-2")
    make_checkpoint("step-3", step=3, root=root, shapes={**TENSORS, "lm_head.weight": (17, 8)})
    daemon.wait_for("checkpoint.rejected", name="step-3")
    values = scrape_until(url, lambda v: v.get('vllm_reloader_rejected_total{check="layout"}') == 1.0)
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


def test_metrics_time_a_checkpoint_waiting_for_its_files_and_the_engine_behind_it_until_it_loads(
    service, make_checkpoint, tmp_path
):
    start, _engine, notify, config, root = service
    url, engine = with_metrics(config)
    daemon = start()
    notify.wait_for("READY=1")
    staged = make_checkpoint("step-2", step=2, root=tmp_path / "staging")
    held = tmp_path / "held.safetensors"
    (staged / "model.safetensors").rename(held)  # its manifest names a file not there yet
    before = time.time()
    staged.rename(root / "step-2")
    daemon.wait_for("checkpoint.pending", name="step-2")
    pending = 'vllm_reloader_pending_since_timestamp_seconds{waiting_for="files"}'
    newer = "vllm_reloader_newer_since_timestamp_seconds{" + engine + "}"
    values = scrape_until(url, lambda v: pending in v and newer in v)
    assert before <= values[pending] <= time.time()
    assert before <= values[newer] <= values[pending], "known as newer from when it was seen"
    assert 'vllm_reloader_pending_since_timestamp_seconds{waiting_for="canary_hosts"}' not in values
    held.rename(root / "step-2" / "model.safetensors")
    daemon.wait_for("reload.succeeded", version="step-2")
    scrape_until(url, lambda v: pending not in v and newer not in v)
    assert daemon.stop() == 0
