"""A Hugging Face hub cache laid out as huggingface_hub writes it, built offline by the tests:
blobs named by hash, snapshot files as relative symlinks to them, refs naming commits."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_model(
    cache: Path, model_id: str, source: Path, *, commit: str = COMMIT, ref: str | None = "main"
) -> Path:
    """Put `source`'s files into `cache` as `model_id` at `commit`; returns the snapshot directory."""
    repository = cache / ("models--" + model_id.replace("/", "--"))
    snapshot = repository / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repository / "blobs").mkdir(exist_ok=True)
    for path in sorted(p for p in source.iterdir() if p.is_file()):
        blob = repository / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", blob.name))
    if ref is not None:
        (repository / "refs").mkdir(exist_ok=True)
        (repository / "refs" / ref).write_text(commit)
    return snapshot
