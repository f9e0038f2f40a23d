"""Every store on its own wire: what a user sets in the store's environment stays in force, and
each failure is one stable line that names its cause."""

from __future__ import annotations

import os
import re

import pytest

from tests.support.ports import unused_port
from tests.support.store_fixtures import AZURITE_ACCOUNT, AZURITE_KEY, STORES, WRITABLE, Bucket
from vllm_reloader.errors import ConfigError, SourceError
from vllm_reloader.sources.filestore import open_store
from vllm_reloader.sources.objstore import CLIENT_KEYS, Store, client_options


def failure(store: Store, times: int = 2) -> SourceError:
    """The error of listing `times` times, asserting each said the same."""
    said = set()
    for _ in range(times):
        with pytest.raises(SourceError) as caught:
            store.list()
        said.add(str(caught.value))
    assert len(said) == 1, f"a new line at every retry: {said}"
    return caught.value


@pytest.mark.stores(*STORES)
def test_objstore_lists_heads_and_reads_ranges_on_every_store(bucket: Bucket):
    bucket.put("v1/a.bin", b"0123456789")
    store = open_store(bucket.url)
    listing, _ = store.list()
    assert list(listing) == ["v1/a.bin"] and listing["v1/a.bin"].size == 10
    head = store.head("v1/a.bin")
    assert head is not None and head.etag == listing["v1/a.bin"].etag, "one object, one ETag"
    assert bytes(store.get_range("v1/a.bin", 2, 5, head.etag)) == b"234"
    assert store.get("v1/a.bin") == (b"0123456789", head.etag)
    assert store.head("v1/none.bin") is None


@pytest.mark.stores(*WRITABLE)
def test_objstore_create_never_overwrites_and_delete_is_idempotent_on_every_writable_store(bucket: Bucket):
    store = open_store(bucket.url)
    assert store.create("v/r.json", b"first") and not store.create("v/r.json", b"second")
    assert bucket.read("v/r.json") == b"first"
    store.delete(["v/r.json", "v/never-there.json"])
    assert bucket.listed() == []


def test_objstore_client_options_are_the_stores_own_variables_and_the_config_adds_its_timeouts():
    environ = {
        "AZURE_ALLOW_HTTP": "true",
        "AZURE_PROXY_URL": "http://proxy.internal:3128",
        "AZURE_TIMEOUT": "90s",
        "AWS_PROXY_URL": "http://another-stores-proxy:1",
    }
    assert client_options("az://c/p", None, 30, environ) == {
        "allow_http": "true",
        "proxy_url": "http://proxy.internal:3128",
        "timeout": "90s",
        "connect_timeout": "5s",
    }
    assert client_options("gs://b/p", "http://emulator:4443", 30, {}) == {
        "timeout": "30s",
        "connect_timeout": "5s",
        "allow_http": True,
    }


def test_objstore_azure_account_key_and_http_endpoint_from_the_environment_work(
    azurite_endpoint: str, monkeypatch
):
    """The issue's failing case: AZURE_ALLOW_HTTP was dropped, and an http endpoint failed with
    "builder error"."""
    from azure.storage.blob import ContainerClient

    account = f"{azurite_endpoint}/{AZURITE_ACCOUNT}"
    credential = {"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY}
    with ContainerClient(account, "by-key", credential=credential) as container:
        if not container.exists():
            container.create_container()
        container.upload_blob("runs/v1/a.bin", b"x", overwrite=True)
    monkeypatch.delenv("AZURE_STORAGE_USE_EMULATOR", raising=False)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", AZURITE_ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", AZURITE_KEY)
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", account)
    monkeypatch.setenv("AZURE_ALLOW_HTTP", "true")
    assert list(Store("az://by-key/runs").list()[0]) == ["v1/a.bin"]


def test_objstore_gcs_service_account_with_an_http_base_url_works_with_google_allow_http(
    gcs_env: str, monkeypatch
):
    bucket_url = "gs://no-bucket-yet/runs"
    assert "builder error" not in str(failure(Store(bucket_url), times=1))
    monkeypatch.delenv("GOOGLE_ALLOW_HTTP")
    assert "builder error" in failure(Store(bucket_url), times=1).detail, "http needs the user's allow"


def test_objstore_proxy_set_for_the_store_is_used_and_named_without_its_password(bucket: Bucket, monkeypatch):
    bucket.put("v1/a.bin", b"x")
    assert list(open_store(bucket.url).list()[0]) == ["v1/a.bin"]
    port = unused_port()
    monkeypatch.setenv("AWS_PROXY_URL", f"http://alice:s3cret@127.0.0.1:{port}")
    error = failure(Store(bucket.url, timeout=2))
    assert str(error) == f"LIST {bucket.url}: connection refused by the proxy http://127.0.0.1:{port}"
    assert "s3cret" not in str(error)


def test_objstore_client_keys_are_every_option_obstore_takes():
    import ast
    from pathlib import Path

    import obstore

    typed = Path(obstore.__file__).parent / "_store" / "_client.pyi"
    (config,) = [n for n in ast.parse(typed.read_text()).body if getattr(n, "name", "") == "ClientConfig"]
    keys = {
        n.target.id for n in config.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    assert keys - {"default_headers"} <= set(CLIENT_KEYS), "a map cannot come from one variable"


def test_objstore_empty_variable_is_unset_and_a_bad_one_is_named(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_PROXY_URL", "")  # a templated EnvironmentFile's blank line
    monkeypatch.setenv("AWS_TIMEOUT", "")
    assert "proxy_url" not in client_options("s3://b/p", None, 30, dict(os.environ))
    Store("s3://b/runs")
    monkeypatch.setenv("AWS_TIMEOUT", "30")
    with pytest.raises(
        ConfigError, match=r"^source\.path 's3://b/runs': AWS_TIMEOUT='30' is refused: .*Duration"
    ):
        Store("s3://b/runs")


def test_objstore_http_endpoint_without_its_allow_says_which_variable_to_set(s3_env, monkeypatch):
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    reason = str(failure(Store("s3://b/runs")))
    assert (
        reason
        == f"LIST s3://b/runs: http:// is not allowed for {s3_env}: set AWS_ALLOW_HTTP=true, or endpoint_url"
    )


def test_objstore_names_in_the_url_are_never_taken_for_a_cause(s3_env, monkeypatch):
    odd = "s3://certificate-timedout-connectionreset/runs"
    assert str(failure(Store(odd))) == f"LIST {odd}: NoSuchBucket (404 Not Found)"
    endpoint = f"http://127.0.0.1:{unused_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    assert str(failure(Store(odd, timeout=2))) == f"LIST {odd}: connection refused by {endpoint}"


def test_objstore_s3_without_credentials_says_so_not_forbidden(monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    reason = str(failure(Store("s3://some-bucket/runs", timeout=2)))
    assert reason.startswith("LIST s3://some-bucket/runs: no credentials: the token request to ")


def test_objstore_unreachable_endpoint_is_one_stable_line_with_the_cause(s3_env, monkeypatch):
    endpoint = f"http://127.0.0.1:{unused_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    error = failure(Store("s3://b/runs", timeout=2))
    assert str(error) == f"LIST s3://b/runs: connection refused by {endpoint}"
    assert "cause: Connection refused" in error.detail and not re.search(r" in [\d.]+\S?s\b", error.detail)


def test_objstore_unknown_host_is_a_dns_failure(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://no-such-host.invalid:9000")
    error = failure(Store("s3://b/runs", timeout=2))
    assert str(error) == "LIST s3://b/runs: DNS lookup of http://no-such-host.invalid:9000 failed"
    assert "lookup" in error.detail


def test_objstore_https_to_a_plain_http_server_is_a_tls_failure(s3_env, monkeypatch):
    tls_endpoint = s3_env.replace("http://", "https://")
    monkeypatch.setenv("AWS_ENDPOINT_URL", tls_endpoint)
    error = failure(Store("s3://b/runs", timeout=2))
    assert (
        str(error)
        == f"LIST s3://b/runs: TLS handshake with {tls_endpoint} failed (is it a plain http:// endpoint?)"
    )


def test_objstore_gcs_without_credentials_says_so_not_forbidden(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no developer's gcloud login
    for name in ("GOOGLE_SERVICE_ACCOUNT", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_SERVICE_ACCOUNT_KEY"):
        monkeypatch.delenv(name, raising=False)
    reason = str(failure(Store("gs://some-bucket/runs", timeout=2)))
    assert reason.startswith("LIST gs://some-bucket/runs: no credentials: the token request to ")
    assert "Forbidden" not in reason.split("(")[0]


def test_objstore_azure_wrong_key_is_forbidden_with_the_stores_code(azurite_endpoint: str, monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", AZURITE_ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "d3Jvbmcta2V5")
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", f"{azurite_endpoint}/{AZURITE_ACCOUNT}")
    monkeypatch.setenv("AZURE_ALLOW_HTTP", "true")
    error = failure(Store("az://any/runs"))
    assert str(error) == "LIST az://any/runs: AuthorizationFailure (403 Forbidden)"
    assert "Server failed to authenticate the request" in error.detail


@pytest.mark.stores(*STORES)
def test_objstore_missing_bucket_is_not_found_in_the_stores_words(bucket: Bucket, store_kind: str):
    url = bucket.url.replace(bucket.name, "no-such-bucket")
    expected = {
        "s3": "NoSuchBucket (404 Not Found)",
        "azure": "ContainerNotFound (404 Not Found)",
        "gcs": "500 Internal Server Error",  # fake-gcs-server's; its message goes to status only
        "file": "No such file or directory",
    }
    error = failure(open_store(url))
    assert str(error) == f"LIST {url}: {expected[store_kind]}"
    assert store_kind != "gcs" or "no bucket named no-such-bucket" in error.detail
