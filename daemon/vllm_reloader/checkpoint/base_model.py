"""Whether a LoRA adapter's `base_model_name_or_path` positively names another model than
the one served: by what the model is (config.json's architecture and sizes), never by the
path string PEFT recorded."""

from __future__ import annotations

import os
from pathlib import Path

from .files import parse_json, read_small

MAX_CONFIG_BYTES = 1 << 20

MODEL_KEYS = (
    "architectures", "model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
    "num_attention_heads", "num_key_value_heads", "vocab_size",
)  # fmt: skip
"""What makes two config.json files the same model to an adapter (its weights' shapes)."""


def other_model(base_model: str, served_model: str) -> str | None:
    """Why the adapter's `base_model_name_or_path` positively names another model than the one
    served, or None. Names are not compared: the engine serves a published copy (`.../step-0`)
    while PEFT recorded the path or hub id the trainer loaded. Where it names a directory beside
    the served one (`_beside`), both config.json's architecture and sizes are; otherwise the
    weight shapes decide (checked next, against the served model's own)."""
    if not _beside(base_model, served_model):
        return None
    mine, served = _model_config(base_model), _model_config(served_model)
    if mine is None or served is None:
        return None
    for key in MODEL_KEYS:
        if key in mine and key in served and mine[key] != served[key]:
            return (
                f"trained on {base_model[:200]!r}, whose {key} is {repr(mine[key])[:100]}, where the "
                f"served model's ({served_model[:200]!r}) is {repr(served[key])[:100]}: train it on the "
                "served model, or serve the model it was trained on"
            )
    return None


def _beside(base_model: str, served_model: str) -> bool:
    """Whether the adapter names a directory beside the served model (in the same root): only
    those are opened. Another absolute path is a writer's to choose (an automounted share, a
    hung NFS mount) and may hold another model on the trainer's host than on this one."""
    root = os.path.dirname(os.path.normpath(served_model))
    named = os.path.normpath(base_model)
    return root not in ("", "/") and os.path.dirname(named) == root


def _model_config(name: str) -> dict[str, object] | None:
    """The config.json of a model named by an absolute local path (a hub id or a relative path,
    relative to some trainer's directory, names nothing here)."""
    if not Path(name).is_absolute():
        return None
    try:
        found = parse_json(read_small(Path(name) / "config.json", MAX_CONFIG_BYTES))
    except (OSError, ValueError):  # not there, not readable, not JSON, a NUL in the name
        return None
    return found if isinstance(found, dict) else None
