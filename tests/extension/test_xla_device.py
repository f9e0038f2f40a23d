"""The extension's accelerator path on a real XLA device: torch_xla's CPU device
(`PJRT_DEVICE=CPU`), in the separate venv scripts/test makes (torch_xla 2.9 pins its own
torch, not vLLM's). What it proves and what only a TPU would: docs/deployments.md, "TPU"."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from vllm_reloader.extension.worker import ReloadExtension

pytestmark = pytest.mark.xla

SHAPES = {
    "embed.weight": (512, 256),
    **{f"layers.{i}.weight": (256, 256) for i in range(12)},
    "head.weight": (512, 256),
}


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(512, 256)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(256, 256, bias=False) for _ in range(12))
        self.head = torch.nn.Linear(256, 512, bias=False)


class XlaWorker(ReloadExtension):
    """What the extension needs of vLLM's worker, on an XLA device; `reload_weights` loads as
    vLLM's default weight loader does: `param.data.copy_(loaded)`, converting the dtype."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(model="", model_weights="", revision=None)
        )
        self.device, self.rank, self.model = device, 0, model

    def reload_weights(self, weights_path: str | None = None, weights_iterator: Any = None) -> None:
        assert weights_iterator is not None, "the extension hands its own reads"
        params = dict(self.model.named_parameters())
        for name, tensor in weights_iterator:
            params[name].data.copy_(tensor)


def checkpoint(directory: Path, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in SHAPES.items()
    }
    directory.mkdir()
    save_file(tensors, directory / "model.safetensors")
    return tensors


def test_xla_extension_loads_onto_the_xla_device_accounts_memory_and_reuses_buffers(tmp_path: Path):
    assert os.environ.get("PJRT_DEVICE") == "CPU", "run under PJRT_DEVICE=CPU (scripts/test does)"
    import torch_xla

    device = torch_xla.device()
    model = Model().to(device)  # float32 parameters; the checkpoints are bfloat16
    worker = XlaWorker(model, device)
    a, b = checkpoint(tmp_path / "a", seed=1), checkpoint(tmp_path / "b", seed=2)

    reports = []
    for directory, expected in ((tmp_path / "a", a), (tmp_path / "b", b), (tmp_path / "a", a)):
        reports.append(worker.reloader_load_checkpoint(str(directory)))
        for name, param in model.named_parameters():
            assert param.device.type == "xla", name
            assert torch.equal(param.detach().cpu(), expected[name].float()), name

    first, second, third = reports
    assert first["device"].startswith("xla") and first["loader"] == "extension"
    assert first["tensors"] == len(SHAPES) and first["bytes"] == sum(t.nbytes for t in a.values())
    for report in reports:
        assert isinstance(report["memory_before"], int) and report["memory_before"] > 0
        assert isinstance(report["memory_after"], int) and report["memory_after"] > 0
    assert first["buffers_allocated"] > 0
    assert second["buffers_allocated"] == third["buffers_allocated"] == 0, "the host buffers are reused"
    assert second["buffer_bytes"] == first["buffer_bytes"]
