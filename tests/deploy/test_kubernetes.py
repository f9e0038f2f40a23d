"""The Kubernetes manifests pass the Kubernetes schemas offline, hold together (the probe
reads the daemon's readiness port, dev routes stay on the pod's loopback, the daemon's config
parses), and the daemon's image builds from what its Containerfile copies, without torch."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from vllm_reloader import config

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))


def resources() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def find(kind: str) -> dict:
    (found,) = [doc for doc in resources() if doc["kind"] == kind]
    return found


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_kubernetes_manifest_passes_the_schemas_strictly(path: Path):
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, "1.37.0", strict=True)


def test_kubernetes_probe_reads_the_daemons_readiness_and_dev_routes_stay_in_the_pod(tmp_path: Path):
    key = tmp_path / "key"  # the Secret's file, as mounted
    key.write_text("a-long-enough-key")
    key.chmod(0o600)
    text = find("ConfigMap")["data"]["config.toml"].replace("/run/secrets/vllm-api-key/key", str(key))
    daemon_config = config.parse(text, environ={})
    containers = {c["name"]: c for c in find("Deployment")["spec"]["template"]["spec"]["containers"]}
    port = int(daemon_config.readiness.listen.rpartition(":")[2])
    probe = containers["vllm"]["readinessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/ready/0", port)
    assert "--host=127.0.0.1" in containers["vllm"]["args"], "dev routes never on the pod's address"
    assert daemon_config.engine.url.startswith("http://127.0.0.1:")
    front = find("ConfigMap")["data"]["haproxy.cfg"]
    assert re.search(r"http-request deny .* unless \{ path_beg /v1/ \}", front)
    service = find("Service")["spec"]["ports"][0]
    assert service["targetPort"] == "http" and containers["front"]["ports"][0]["name"] == "http"


def test_containerfile_copies_what_builds_the_daemon_and_no_torch(tmp_path: Path):
    copied = re.findall(r"^COPY (.+) /src/", (REPO / "deploy" / "Containerfile").read_text(), re.M)
    src = tmp_path / "src"
    src.mkdir()
    for line in copied:
        for name in line.split():
            source = REPO / name
            target = src / name
            shutil.copytree(source, target) if source.is_dir() else shutil.copy(source, target)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            tmp_path,
            src,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("vllm_reloader-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith("/METADATA"))
        requires = [
            line for line in archive.read(metadata).decode().splitlines() if line.startswith("Requires-Dist:")
        ]
    daemon_deps = [line for line in requires if "extra ==" not in line]
    assert daemon_deps and not [line for line in daemon_deps if re.search(r"\b(torch|vllm)\b", line)]
