"""The obstore edge: configuration from the env or the config, errors in one line."""

from __future__ import annotations

import os

import pytest

from tests.support.store_fixtures import Bucket
from vllm_reloader import config
from vllm_reloader.errors import ConfigError, SourceError
from vllm_reloader.sources.objstore import Store


def test_objstore_endpoint_url_overrides_the_env(bucket: Bucket, monkeypatch):
    bucket.put("a/manifest.json", b"{}")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(SourceError):
        Store(bucket.url, timeout=2).list()
    assert list(Store(bucket.url, endpoint_url=bucket.endpoint).list()[0]) == ["a/manifest.json"]


def test_objstore_errors_are_one_line_with_the_store_code(s3_env):
    with pytest.raises(SourceError) as caught:
        Store("s3://no-such-bucket-here/x").get("a/manifest.json")
    message = str(caught.value)
    assert message.startswith("GET s3://no-such-bucket-here/x/a/manifest.json: ")
    assert "NoSuchBucket" in message and "\n" not in message


def test_objstore_other_stores_are_built_from_their_urls(monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "account")
    Store("gs://bucket/prefix")
    Store("az://container/prefix")


def test_objstore_a_url_obstore_cannot_use_is_a_config_error(monkeypatch):
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
    with pytest.raises(ConfigError, match=r"source\.path 'az://container/prefix'"):
        Store("az://container/prefix")


def test_config_accepts_object_store_urls_and_refuses_other_schemes(tmp_path):
    for url in ("s3://b/p", "gs://b/p", "az://c/p"):
        cfg = config.Config(
            source=config.SourceConfig(path=url),
            engine=config.EngineConfig(url="http://127.0.0.1:1"),
            state=config.StateConfig(dir=tmp_path),
        )
        assert cfg.source.remote and cfg.source.interval == 10.0
        assert cfg.checkpoint_root == tmp_path / "cache" / "checkpoints"
    with pytest.raises(ConfigError, match=r"source\.path: .*unsupported scheme"):
        config.parse('[source]\npath = "http://x/y"\n[engine]\nurl = "http://e"\n[state]\ndir = "/s"\n')


def test_objstore_create_is_one_conditional_put_even_above_the_multipart_threshold(
    bucket: Bucket, tmp_path, monkeypatch
):
    """obstore uploads a file larger than its chunk size in parts, with no condition; with
    `mode="create"` it sends one PUT with `If-None-Match: *` instead (the whole file in memory).
    The chunk size is lowered here so that a small file is over the threshold."""
    import hashlib

    import obstore

    real_put = obstore.put
    chunk = 64 << 10

    def small_chunks(*args, **kwargs):  # type: ignore[no-untyped-def]
        return real_put(*args, **kwargs, chunk_size=chunk)

    monkeypatch.setattr(obstore, "put", small_chunks)
    data = os.urandom(3 * chunk + 1)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    store = Store(bucket.url)
    assert store.create("v1/big.bin", path) is True
    head = bucket.client.head_object(Bucket=bucket.name, Key="runs/v1/big.bin")
    assert head["ETag"].strip('"') == hashlib.md5(data).hexdigest(), "one PUT, not a multipart upload"
    path.write_bytes(b"other bytes")
    assert store.create("v1/big.bin", path) is False
    assert store.create("v1/big.bin", b"other bytes") is False
    assert bucket.client.get_object(Bucket=bucket.name, Key="runs/v1/big.bin")["Body"].read() == data


def test_objstore_delete_removes_the_keys_given_and_no_other(bucket: Bucket):
    for key in ("v1/a", "v1/b", "v1/c"):
        bucket.put(key, b"x")
    store = Store(bucket.url)
    store.delete(["v1/a", "v1/c"])
    store.delete([])
    assert bucket.listed() == ["v1/b"]


def test_objstore_put_streams_a_file_larger_than_part_size_in_parts(bucket: Bucket, tmp_path):
    """Overwriting, a `Path` or an open file longer than `part_size` goes up as a multipart
    upload in parts of that size (moto takes 5 MiB and more); a shorter one in one PUT."""
    data = os.urandom((10 << 20) + 1)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    store = Store(bucket.url)
    store.put("v1/from-path.bin", path, part_size=5 << 20)
    with path.open("rb") as f:
        store.put("v1/from-file.bin", f, part_size=6 << 20)
    store.put("v1/one-put.bin", path, part_size=11 << 20)
    for key, parts in (("from-path.bin", "-3"), ("from-file.bin", "-2")):
        got = bucket.client.get_object(Bucket=bucket.name, Key=f"runs/v1/{key}")
        assert got["ETag"].strip('"').endswith(parts) and got["Body"].read() == data
    head = bucket.client.head_object(Bucket=bucket.name, Key="runs/v1/one-put.bin")
    assert "-" not in head["ETag"] and head["ContentLength"] == len(data)
