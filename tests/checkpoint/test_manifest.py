"""The manifest schema's bounds: what a writer may put there without hurting the daemon."""

from __future__ import annotations

import json

import pytest

from vllm_reloader.checkpoint.manifest import MAX_STEP, parse
from vllm_reloader.errors import ManifestInvalid

FILES = [{"path": "model.safetensors", "size": 1}]


def manifest(**fields: object) -> bytes:
    return json.dumps({"format_version": 1, "files": FILES, **fields}).encode()


@pytest.mark.parametrize(
    "version", ["x\nWATCHDOG=trigger", "a\rb", "tab\there", "bell\x07", "nul\x00", "c1\x85"]
)
def test_manifest_refuses_control_characters_in_the_version(version: str):
    """It reaches systemd's STATUS= line and the engine's weight version."""
    with pytest.raises(ManifestInvalid, match="version"):
        parse(manifest(version=version))


def test_manifest_accepts_unicode_versions_without_control_characters():
    assert parse(manifest(version="schritt-Ⅻ-ü")).version == "schritt-Ⅻ-ü"


@pytest.mark.parametrize("step", [MAX_STEP + 1, -MAX_STEP - 1, 10**400])
def test_manifest_refuses_a_step_a_float_metric_cannot_hold(step: int):
    with pytest.raises(ManifestInvalid, match="step"):
        parse(manifest(step=step))
    assert parse(manifest(step=MAX_STEP)).step == MAX_STEP


def test_manifest_nested_past_the_parser_is_invalid_not_pending():
    with pytest.raises(ManifestInvalid, match="nested too deeply"):
        parse(b'{"format_version": 1, "files": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
