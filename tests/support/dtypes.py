"""A checkpoint's float tensors saved in another dtype, as a trainer that keeps float32 (HF
`Trainer`) or one that saves float16 would write them. Needs torch: engine tests only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def converted(source: Path, target: Path, dtype: str) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target, ignore=shutil.ignore_patterns("manifest.json"))
    for shard in sorted(target.glob("*.safetensors")):
        tensors = load_file(shard)
        as_dtype = {k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}
        save_file(as_dtype, shard, metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = dtype
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
