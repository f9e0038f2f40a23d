"""A checkpoint's float tensors saved in another dtype, as a trainer that keeps float32 (HF
`Trainer`) or one that saves float16 would write them. Needs torch: engine tests only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def converted(source: Path, target: Path, dtype: str, *, exact: bool = False) -> Path:
    """`exact`: first zero the values float16 cannot hold as normal numbers (|x| < 2**-14),
    so the bfloat16, float16 and float32 copies of the result all hold the same numbers."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target, ignore=shutil.ignore_patterns("manifest.json"))
    for shard in sorted(target.glob("*.safetensors")):
        tensors = load_file(shard)
        if exact:
            tensors = {k: torch.where(v.abs() < 2**-14, torch.zeros_like(v), v) for k, v in tensors.items()}
        as_dtype = {k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}
        save_file(as_dtype, shard, metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = dtype
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
