"""A real S3 wire protocol on loopback: moto's server in a thread, one bucket per test.

Credentials and the endpoint go through the standard env vars (`AWS_ENDPOINT_URL`,
`AWS_ALLOW_HTTP`), as a user would set them, so daemons started as subprocesses see them too.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

_buckets = itertools.count()


@dataclass
class Bucket:
    name: str
    endpoint: str
    client: Any
    """A boto3 S3 client: the test's own hands on the bucket, independent of the daemon's."""

    @property
    def url(self) -> str:
        return f"s3://{self.name}/runs"

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.name, Key=f"runs/{key}", Body=data)

    def upload_dir(self, directory: Path, name: str, *, skip: tuple[str, ...] = ()) -> None:
        for path in sorted(directory.rglob("*")):
            relative = path.relative_to(directory).as_posix()
            if path.is_file() and relative not in skip:
                self.put(f"{name}/{relative}", path.read_bytes())

    def listed(self) -> list[str]:
        listed = self.client.list_objects_v2(Bucket=self.name, Prefix="runs/")
        return [item["Key"].removeprefix("runs/") for item in listed.get("Contents", [])]


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_env(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": moto_endpoint,
        "AWS_ALLOW_HTTP": "true",
    }.items():
        monkeypatch.setenv(key, value)
    return moto_endpoint


def new_bucket(endpoint: str, *, create: bool = True) -> Bucket:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    bucket = Bucket(f"ckpts-{next(_buckets)}", endpoint, client)
    if create:
        client.create_bucket(Bucket=bucket.name)
    return bucket


@pytest.fixture
def bucket(s3_env: str) -> Bucket:
    return new_bucket(s3_env)


@pytest.fixture
def s3_auth_enforced() -> Iterator[None]:
    """moto accepts any key by default; this makes it check them (the first 0 calls free)."""
    from moto import settings

    before = settings.INITIAL_NO_AUTH_ACTION_COUNT
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    try:
        yield
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = before
