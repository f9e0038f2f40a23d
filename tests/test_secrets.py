"""The engine's API key never reaches the log: a key an HTTP header cannot carry is a config
error that names where it came from, and every event passes one processor that replaces the
key wherever it sits (issue 22, item 6). Through the real logging setup: `capture_logs`
replaces the processors, so it would prove nothing here."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import structlog

from tests.support.fake_engine import FakeEngine
from vllm_reloader import cli, config, log
from vllm_reloader.engine.client import EngineClient
from vllm_reloader.errors import ConfigError, EngineUnavailable
from vllm_reloader.service.daemon import Daemon

KEY = "sk-planted-9f3a7c21e4b0"


@pytest.fixture(autouse=True)
def no_secrets_left() -> Iterator[None]:
    """Each test registers its own key, and leaves logging as it found it."""
    saved = structlog.get_config()
    log.forget_secrets()
    yield
    log.forget_secrets()
    structlog.configure(**saved)


def config_text(tmp_path: Path, extra: str = "") -> str:
    (tmp_path / "root").mkdir(exist_ok=True)
    (tmp_path / "state").mkdir(exist_ok=True)
    return (
        f'[source]\npath = "{tmp_path / "root"}"\n'
        f'[engine]\nurl = "http://engine.test"\nretry_initial = 0.05\nretry_max = 0.1\n{extra}'
        f'[state]\ndir = "{tmp_path / "state"}"\n'
    )


def key_file(tmp_path: Path, content: bytes) -> str:
    path = tmp_path / "engine.key"
    path.write_bytes(content)
    path.chmod(0o600)
    return f'api_key_file = "{path}"\n'


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


@pytest.mark.parametrize(
    ("content", "kind"),
    [
        (b"sk-abc\x00def\n", "a control character"),
        (b"sk-abc\x1bdef", "a control character"),
        ("sk-abcédef".encode(), "a non-ASCII character"),
    ],
)
def test_a_key_file_holding_what_a_header_cannot_carry_is_a_config_error_naming_the_file(
    tmp_path, content, kind
):
    text = config_text(tmp_path, key_file(tmp_path, content))
    with pytest.raises(ConfigError) as error:
        config.parse(text, "x.toml", environ={})
    message = str(error.value)
    assert message == (
        f"x.toml: engine.api_key_file: {tmp_path / 'engine.key'}: the key holds {kind}; "
        "it must be printable ASCII"
    )
    assert "abc" not in message and "def" not in message


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("sk-abc\ndef", "a control character"),
        ("sk-abc\x7fdef", "a control character"),
        ("sk-abc€def", "a non-ASCII character"),
    ],
)
def test_a_vllm_api_key_holding_what_a_header_cannot_carry_is_a_config_error_naming_the_variable(
    tmp_path, value, kind
):
    with pytest.raises(ConfigError) as error:
        config.parse(config_text(tmp_path), "x.toml", environ={"VLLM_API_KEY": value})
    assert str(error.value) == (
        f"x.toml: VLLM_API_KEY (the environment): the key holds {kind}; it must be printable ASCII"
    )


def test_the_daemon_with_a_newline_in_vllm_api_key_exits_2_with_one_line_that_hides_the_key(
    tmp_path, monkeypatch, capsys
):
    path = tmp_path / "x.toml"
    path.write_text(config_text(tmp_path))
    monkeypatch.setenv("VLLM_API_KEY", f"{KEY}\n{KEY}")
    monkeypatch.setattr(Daemon, "run", lambda _self: 99)  # started after all: say so, do not hang
    assert cli.main(["run", "--config", str(path)]) == 2
    out, err = capsys.readouterr()
    problem = "the key holds a control character; it must be printable ASCII"
    assert err == f"vllm-reloader: {path}: VLLM_API_KEY (the environment): {problem}\n"
    assert KEY not in out + err


def test_a_trailing_newline_or_an_empty_vllm_api_key_is_still_fine(tmp_path):
    cfg = config.parse(config_text(tmp_path, key_file(tmp_path, f"{KEY}\n".encode())), environ={})
    assert cfg.engine.api_key is not None and cfg.engine.api_key.get_secret_value() == KEY
    assert config.parse(config_text(tmp_path), environ={"VLLM_API_KEY": ""}).engine.api_key is None


def test_the_key_in_an_engine_error_is_redacted_from_every_field_and_traceback(tmp_path):
    """The key, read by the config as the daemon reads it, sent by the real client and quoted
    back in the HTTP library's exception (as it quotes a header it refuses): logged as a
    reason, as a traceback, as an exception object and nested in lists and dicts."""
    cfg = config.parse(config_text(tmp_path), environ={"VLLM_API_KEY": KEY})

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.LocalProtocolError(f"Illegal header value {request.headers['authorization'].encode()!r}")

    client = EngineClient(cfg.engine, transport=httpx.MockTransport(refuse))
    stream = io.StringIO()
    log.configure(fmt="json", stream=stream)
    logger = log.get()
    with pytest.raises(EngineUnavailable) as raised:
        client.weight_version()
    assert KEY in str(raised.value)  # the leak this guards against
    try:
        raise raised.value
    except EngineUnavailable as exc:
        logger.warning("engine.unreachable", reason=str(exc), error=exc, nested={"why": [str(exc)], KEY: 1})
        logger.exception("daemon.crashed")
    warning, crashed = lines(stream)
    assert KEY not in stream.getvalue()
    assert warning["reason"] == "/weight_info: Illegal header value b'Bearer [redacted]'"
    assert warning["nested"] == {"why": [warning["reason"]], "[redacted]": 1}
    assert "[redacted]" in warning["error"]
    assert "Illegal header value b'Bearer [redacted]'" in crashed["exception"]


def test_the_running_daemon_logs_an_engine_error_quoting_the_key_without_it(tmp_path):
    """End to end in this process: the config loaded from its file with the key in the
    environment, the daemon's own `engine.starting` while the engine never answered."""
    path = tmp_path / "x.toml"
    path.write_text(config_text(tmp_path))
    cfg = config.parse(path.read_text(), str(path), environ={"VLLM_API_KEY": KEY})
    engine = FakeEngine()

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/weight_info":
            raise httpx.ConnectError(f"refused, headers {dict(request.headers)}")
        return engine.handle(request)

    stream = io.StringIO()
    log.configure(fmt="json", stream=stream)
    client = EngineClient(cfg.engine, transport=httpx.MockTransport(answer))
    daemon = Daemon(cfg, client=client)
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while '"engine.starting"' not in stream.getvalue() and time.monotonic() < deadline:
        time.sleep(0.02)
    daemon.request_stop()
    thread.join(timeout=10)
    assert not thread.is_alive()
    starting = [e for e in lines(stream) if e["event"] == "engine.starting"]
    assert len(starting) == 1
    assert "'authorization': 'Bearer [redacted]'" in starting[0]["reason"]
    assert KEY not in stream.getvalue()
