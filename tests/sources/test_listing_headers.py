"""Shard headers read from the object store (two small ranged GETs): a header no safetensors
file can have (its prefix declares more than `files.MAX_HEADER_BYTES`) is refused from its
8-byte prefix, never fetched (moto on loopback)."""

from __future__ import annotations

import json
import struct

import pytest

from tests.support.store_fixtures import STORES, Bucket
from vllm_reloader.checkpoint.files import MAX_HEADER_BYTES, TooManyTensors
from vllm_reloader.errors import LayoutUnreadable
from vllm_reloader.sources.filestore import open_store
from vllm_reloader.sources.listing import HeaderSizes

pytestmark = pytest.mark.stores(*STORES)


def test_remote_header_longer_than_any_safetensors_header_is_refused_from_its_prefix(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch
):
    body = json.dumps({"t": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}).encode()
    bucket.put("run/model.safetensors", struct.pack("<Q", MAX_HEADER_BYTES + 1) + body)
    store = open_store(bucket.url)
    ranges: list[tuple[int, int]] = []
    real = store.get_range

    def spy(key: str, start: int, end: int, etag: str | None) -> memoryview:
        ranges.append((start, end))
        return real(key, start, end, etag)

    monkeypatch.setattr(store, "get_range", spy)
    objects = {k.removeprefix("run/"): o for k, o in store.list_under("run").items()}
    listing = HeaderSizes(store).listing("run", objects, {})
    with pytest.raises(LayoutUnreadable, match=r"model\.safetensors: safetensors header too large"):
        listing.shard_size("model.safetensors")
    assert ranges == [(0, 8)], "only the prefix fetched"


def test_remote_header_listing_more_tensors_than_the_gate_allows_is_refused(bucket: Bucket):
    """A legal header of many zero-size tensors: refused by `[gate] max_tensors` as the local
    gate does, not parsed whole on the object-store thread."""
    tensors = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(50)}
    body = json.dumps(tensors).encode()
    bucket.put("run/model.safetensors", struct.pack("<Q", len(body)) + body)
    store = open_store(bucket.url)
    objects = {k.removeprefix("run/"): o for k, o in store.list_under("run").items()}
    assert HeaderSizes(store, max_tensors=50).listing("run", objects, {}).shard_size(
        "model.safetensors"
    ) == 8 + len(body)
    with pytest.raises(TooManyTensors, match=r"model\.safetensors: more than 49 tensors"):
        HeaderSizes(store, max_tensors=49).listing("run", objects, {}).shard_size("model.safetensors")
