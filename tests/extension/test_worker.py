"""The extension's worker side: what it reports about memory (the real engine loading
through it is in tests/e2e)."""

from __future__ import annotations

import torch

from vllm_reloader.extension.worker import DeviceMemory


def test_worker_reports_cpu_memory_as_rss_with_no_peak():
    memory = DeviceMemory(torch.device("cpu"))
    memory.reset_peak()
    assert memory.used() > 10_000_000 and memory.peak() is None
