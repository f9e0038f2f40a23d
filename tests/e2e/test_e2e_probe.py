"""No client sees broken weights, even with no balancer: clients send requests straight to
real CPU engines, without pause, while checkpoints that pass every check of the gate but
break the forward pass are published. The probe inside the pause finds each one and loads
the last good weights back before the resume: no request fails, none is answered by them."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.support import background
from tests.support.checkpoints import write_manifest
from tests.support.engine_fixtures import (
    API_KEY,
    DaemonProcess,
    Engine,
    daemon_config,
    rewritten,
    start_engine,
)
from tests.support.rolling_updates import text_of, two_engines
from vllm_reloader.tools.publish import publish

pytestmark = pytest.mark.engine

CLIENTS_PER_ENGINE = 2


def huge_lm_head(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """±3e38 in the output layer: finite on disk (bfloat16 tops out at 3.39e38), inf logits."""
    return torch.sign(tensor.float()) * 3e38 if name == "lm_head.weight" else tensor.float()


def overflowing_mlp(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """One MLP's output times 1e30: finite, in range, and the next norm overflows."""
    return tensor.float() * 1e30 if name == "model.layers.0.mlp.down_proj.weight" else tensor.float()


def nan_in_an_unused_row(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """One NaN in the embedding of the vocabulary's last token, which no prompt holds: no
    forward pass on the prompts reaches it; only a scan of the parameters finds it."""
    tensor = tensor.float()
    if name == "model.embed_tokens.weight":
        tensor[-1, 0] = float("nan")
    return tensor


Answer = tuple[float, str, int, str]
"""When it was sent (monotonic), to which engine, its status and its text."""


def clients(engines: list[Engine], stop: threading.Event, answers: list[Answer]) -> list:
    body = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 4, "temperature": 0}

    def send(engine: Engine) -> None:
        with httpx.Client(
            base_url=engine.url, timeout=300, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as http:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    response = http.post("/v1/completions", json=body)
                except httpx.HTTPError as exc:
                    answers.append((sent, engine.url, 0, repr(exc)))
                    continue
                ok = response.status_code == 200
                text = response.json()["choices"][0]["text"] if ok else response.text[:200]
                answers.append((sent, engine.url, response.status_code, text))

    return [
        threading.Thread(target=send, args=(e,), daemon=True)
        for e in engines
        for _ in range(CLIENTS_PER_ENGINE)
    ]


@pytest.mark.parametrize("count", [1, 2], ids=["one-engine-scan-engine", "two-engines-scan-auto"])
def test_e2e_probe_loads_back_weights_that_break_the_forward_pass_before_any_client_request_reaches_them(
    tmp_path: Path, count: int
):
    """One engine with `[gate] scan = "engine"`: the gate only hashes, and a NaN no forward
    pass reaches is found by the engine's scan inside the pause. Two engines with `auto`: a CPU
    engine leaves the scan to the host (the gate rejects that NaN, check `finite`)."""
    from vllm_reloader.tools.tinymodel import write_checkpoint

    root = tmp_path / "root"
    seeds = [write_checkpoint(tmp_path / f"seed-{i}", seed=i) for i in (1, 2)]
    publish(seeds[0], root, step=1)
    if count == 1:
        engines = [start_engine(root / "step-1", tmp_path / "engine.log")]
    else:
        engines = two_engines(root / "step-1", tmp_path)
    answers: list[Answer] = []
    stop = threading.Event()
    try:
        config = daemon_config(
            tmp_path / "daemon.toml",
            root=root,
            engine_url=[e.url for e in engines],
            state_dir=tmp_path / "state",
            engine_extra='[gate]\nscan = "engine"\n' if count == 1 else "",
        )
        daemon = DaemonProcess(config)
        try:
            for engine in engines:
                daemon.wait_for("engine.reconciled", engine=engine.url, timeout=120)
            good = {text_of(engines[0])}
            with background.running(clients(engines, stop, answers), stop, join_s=300):
                publish(seeds[1], root, step=2)
                daemon.wait_for("reload.succeeded", engine=engines[-1].url, version="step-2", timeout=300)
                good.add(text_of(engines[-1]))
                broken_from = time.monotonic()  # earlier ones may mix the two good versions (keep)
                for step, change in ((3, huge_lm_head), (4, overflowing_mlp)):
                    staged = rewritten(seeds[1], tmp_path / "staged" / f"step-{step}", change)
                    write_manifest(staged, step=step, overrides={"version": f"step-{step}"})
                    staged.rename(root / f"step-{step}")
                    rolled = daemon.wait_for("reload.rolled_back", version=f"step-{step}", timeout=300)
                    assert rolled["cause"] == "probe" and rolled["to_version"] == "step-2", rolled
                    daemon.wait_for("checkpoint.rejected", name=f"step-{step}", timeout=60)
                staged = rewritten(seeds[1], tmp_path / "staged" / "step-5", nan_in_an_unused_row)
                write_manifest(staged, step=5, overrides={"version": "step-5"})
                staged.rename(root / "step-5")
                rejected = daemon.wait_for("checkpoint.rejected", name="step-5", timeout=300)
                if count == 1:
                    assert rejected["check"] == "probe", rejected
                    assert "model.embed_tokens.weight holds NaN or Inf" in rejected["reason"], rejected
                    assert daemon.wait_for("reload.rolled_back", version="step-5")["cause"] == "probe"
                else:
                    assert rejected["check"] == "finite", "a CPU engine: the host scanned"
                threading.Event().wait(1.0)
        finally:
            assert daemon.stop() == 0, "".join(daemon.raw[-20:])
    finally:
        for engine in engines:
            engine.stop()

    assert len(good) == 2, "each good version answers its own way"
    assert len(answers) > 20 * count, "clients were answered all along"
    failed = [a for a in answers if a[2] != 200]
    assert failed == [], f"no request failed: {failed[:3]}"
    since = [a for a in answers if a[0] >= broken_from]
    assert len(since) > 10 * count, "clients were answered all through the broken checkpoints"
    broken = [a for a in since if a[3] not in good]
    assert broken == [], f"none answered by the broken weights: {broken[:3]}"
    assert not daemon.events("reload.started", version="step-3", engine=engines[-1].url) or count == 1
    if count == 1:
        [loaded] = daemon.events("reload.succeeded", version="step-2")
        assert loaded["probe_scanned_bytes"] > 0 and loaded["probe_device"] == "cpu", loaded
    for step in (3, 4):
        started = daemon.events("reload.started", version=f"step-{step}")
        assert [e["engine"] for e in started] == [engines[0].url], (
            "the canary engine only: nothing for the rest"
        )


@pytest.mark.oldest
def test_e2e_probe_changes_nothing_a_request_kept_through_the_pause_holds(tmp_path: Path):
    """A long greedy generation, paused mid-way (`keep`: its KV cache kept), probed, resumed,
    answers token for token what it answers with no pause at all: the probe's forward pass
    wrote into no cache block in use and moved no scheduler or sampler state. An engine of its
    own, no daemon: nothing else pauses or reloads it meanwhile."""
    from vllm_reloader.tools.tinymodel import write_checkpoint

    engine = start_engine(write_checkpoint(tmp_path / "model", seed=1), tmp_path / "engine.log")
    try:
        _generate_across_a_probe(engine)
    finally:
        engine.stop()


TOKENS = 240
"""A generation as long as the model allows (256 positions): the pause must catch it mid-way."""
TRIES = 10


def _generate_across_a_probe(engine: Engine) -> None:
    body = {
        "model": "tiny",
        "prompt": "w1 w2 w3 w4",
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    alone = engine.http.post("/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]
    for _ in range(TRIES):  # a generation may outrun the pause (streamed answers come coalesced,
        streamed, probed = _paused_mid_way(engine, body)  # later on a loaded machine): again
        if len(streamed) == TOKENS:
            break
    assert len(streamed) == TOKENS, f"the pause caught the generation mid-way (in one of {TRIES} tries)"
    assert probed and all(r["available"] and r["finite"] and r["non_finite"] is None for r in probed), probed
    assert "".join(streamed) == alone, "the same tokens as with no pause and no probe"


def _paused_mid_way(engine: Engine, body: dict[str, object]) -> tuple[list[str], list[dict]]:
    """The generation streamed, paused (`keep`) and probed once its first token is out; ([], [])
    when it had ended before the pause took hold."""
    streamed: list[str] = []

    def generate() -> None:
        with engine.http.stream(
            "POST", "/v1/completions", json={**body, "stream": True}, timeout=300
        ) as answer:
            for line in answer.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line[6:])["choices"][0]["text"])

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    while not streamed and thread.is_alive():
        threading.Event().wait(0.001)
    seen = time.monotonic() + 5  # until the engine's own count has it too (later on a loaded machine)
    while thread.is_alive() and not _running(engine) and time.monotonic() < seen:
        threading.Event().wait(0.01)
    engine.http.post("/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
    try:
        running = _running(engine)
        rpc = {"method": "reloader_probe", "kwargs": {"tokens": [5, 6, 7, 8, 9], "scan": True}}
        probed = engine.http.post("/collective_rpc", json=rpc, timeout=120).json()["results"]
    finally:
        engine.http.post("/resume", timeout=60).raise_for_status()
    thread.join(timeout=300)
    return (streamed, probed) if running else ([], [])


def _running(engine: Engine) -> bool:
    """Whether a request is held in the engine (vLLM's own count, not what the stream showed)."""
    metrics = engine.http.get("/metrics", timeout=30).text
    return any(
        line.startswith("vllm:num_requests_running") and float(line.rsplit(" ", 1)[1]) >= 1
        for line in metrics.splitlines()
    )
