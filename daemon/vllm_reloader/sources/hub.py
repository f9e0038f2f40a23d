"""The Hugging Face cache: where an engine started from a hub model id keeps that model's files.

`vllm serve Qwen/Qwen3-8B` is the usual first start of a continuous-training loop. Some vLLM
releases report the resolved snapshot directory in `/server_info`, others the id itself; from
an id the daemon finds the snapshot the way `huggingface_hub` lays it out —
`<cache>/models--ORG--NAME/refs/<revision>` names a commit, `snapshots/<commit>/` holds its
files — so the startup model can be the layout baseline and the last rollback target.
Reading a directory needs no `huggingface_hub`, and nothing is ever downloaded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from ..checkpoint.files import read_small

COMMIT = re.compile(r"[0-9a-f]{40}")
MODEL_ID = re.compile(r"[\w.-]+(?:/[\w.-]+)?")
"""`org/name` or a bare `name`: what `--model` takes for a hub repository."""


def cache_dir(environ: Mapping[str, str]) -> Path:
    """`HF_HUB_CACHE`, else `HF_HOME/hub`, else `XDG_CACHE_HOME/huggingface/hub`, else
    `~/.cache/huggingface/hub`: huggingface_hub's own order."""
    if hub_cache := environ.get("HF_HUB_CACHE"):
        return Path(hub_cache).expanduser()
    if hf_home := environ.get("HF_HOME"):
        return Path(hf_home).expanduser() / "hub"
    xdg = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or "~", ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def is_model_id(model: str) -> bool:
    """Not a directory here, and shaped like a hub id (`org/name`)."""
    return MODEL_ID.fullmatch(model) is not None and not Path(model).is_dir()


def snapshot(model_id: str, revision: str | None, environ: Mapping[str, str]) -> Path | None:
    """The cached snapshot of `model_id` at `revision` (a branch, tag or commit; default main),
    or None where the cache does not hold it (or cannot be read)."""
    if not MODEL_ID.fullmatch(model_id) or ".." in model_id:
        return None
    repository = cache_dir(environ) / ("models--" + model_id.replace("/", "--"))
    wanted = revision or "main"
    if COMMIT.fullmatch(wanted):
        commit = wanted
    else:
        try:
            commit = read_small(repository / "refs" / wanted, limit=128).decode().strip()
        except (OSError, UnicodeDecodeError, ValueError):
            return None
        if not COMMIT.fullmatch(commit):
            return None
    found = repository / "snapshots" / commit
    return found if found.is_dir() else None
