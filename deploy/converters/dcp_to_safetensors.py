#!/usr/bin/env python3
"""A `[source] converter` for torch DCP checkpoints (`FileSystemWriter`: `*.distcp` and
`.metadata`), run by the daemon as

    converter = ["/opt/venv/bin/python", "/opt/vllm-reloader/deploy/converters/dcp_to_safetensors.py",
                 "{input}", "{output}"]

It reads every tensor of INPUT on the CPU (no process group), writes OUTPUT/model.safetensors,
and copies INPUT's small `*.json` files (config, tokenizer) beside it. The tensors' names must
be those the served model loads (HF names): a trainer that saves other names (Megatron's)
needs its own converter. Exits non-zero with one line on stderr when it cannot; the daemon
rejects that checkpoint with it. Needs torch and safetensors, not the daemon's environment.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path


def _flat(state: dict, prefix: str = "") -> dict:
    """Nested state dicts (`{"model": {...}}`) by dotted names; non-tensor entries dropped."""
    import torch

    found = {}
    for key, value in state.items():
        if isinstance(value, dict):
            found.update(_flat(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            found[f"{prefix}{key}"] = value.contiguous()
    return found


def main(source: str, output: str) -> int:
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    into = Path(output)
    into.mkdir(parents=True)
    with tempfile.TemporaryDirectory(dir=into.parent) as scratch:
        whole = Path(scratch) / "state.pt"
        dcp_to_torch_save(source, whole)
        tensors = _flat(torch.load(whole, map_location="cpu", weights_only=True))
    if not tensors:
        print(f"{source}: no tensors in this DCP checkpoint", file=sys.stderr)
        return 1
    save_file(tensors, into / "model.safetensors", metadata={"format": "pt"})
    for small in Path(source).glob("*.json"):
        shutil.copyfile(small, into / small.name)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: dcp_to_safetensors.py INPUT OUTPUT")
    sys.exit(main(sys.argv[1], sys.argv[2]))
