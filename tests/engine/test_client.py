import ssl
import subprocess

import httpx
import pytest
from pydantic import SecretStr

from tests.support.fake_engine import FakeEngine, FakeEngineServer, error
from vllm_reloader.config import EngineConfig
from vllm_reloader.engine.capabilities import Capabilities
from vllm_reloader.engine.client import EngineClient
from vllm_reloader.errors import EngineCallFailed, EngineUnavailable

KEY = "sk-test-0123456789"


def client(seen: list[httpx.Request], *, key: str | None, status: int = 200) -> EngineClient:
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if status != 200:
            return httpx.Response(status, json={"error": "Unauthorized"})
        return httpx.Response(200, json={"weight_version": "v1", "is_paused": False, "results": [None]})

    config = EngineConfig(url="http://127.0.0.1:1", api_key=SecretStr(key) if key else None)
    return EngineClient(config, transport=httpx.MockTransport(answer))


def test_client_sends_the_api_key_on_every_engine_call():
    seen: list[httpx.Request] = []
    engine = client(seen, key=KEY)
    engine.weight_version()
    engine.is_paused()
    engine.pause("keep")
    engine.resume()
    engine.reload_weights("/ckpt")
    engine.requests_in_flight()
    assert len(seen) == 7  # requests_in_flight asks /metrics and /load
    assert {r.headers.get("authorization") for r in seen} == {f"Bearer {KEY}"}


def test_client_sends_no_authorization_without_a_key():
    seen: list[httpx.Request] = []
    client(seen, key=None).weight_version()
    assert "authorization" not in seen[0].headers


def test_client_error_for_a_refused_key_names_the_status_not_the_key():
    seen: list[httpx.Request] = []
    with pytest.raises(EngineCallFailed) as error:
        client(seen, key=KEY, status=401).weight_version()
    assert "HTTP 401" in str(error.value)
    assert KEY not in str(error.value) and KEY not in repr(error.value)


def test_client_capabilities_reads_version_and_the_routes_it_drives_from_openapi():
    engine = FakeEngine()
    engine.release = "0.32.0"
    engine.routes = {"/pause", "/resume", "/is_paused", "/v1/completions", "/sleep"}
    found = engine.client().capabilities()
    assert found.version == "0.32.0"
    assert found.routes == {"/pause", "/resume", "/is_paused", "/sleep"}, "only the routes the daemon drives"
    assert found.dev_mode


def test_client_capabilities_without_openapi_probes_is_paused_for_dev_mode():
    engine = FakeEngine()
    found = engine.client().capabilities()
    assert found == Capabilities(None, None, dev_mode=True)
    assert engine.calls[-1] == "/is_paused"
    engine.dev_mode = False
    assert engine.client().capabilities() == Capabilities(None, None, dev_mode=False)


def test_client_capabilities_raises_on_an_engine_error_other_than_404():
    engine = FakeEngine()
    engine.fail["/version"] = error(500)
    with pytest.raises(EngineCallFailed):
        engine.client().capabilities()


def test_client_ends_an_answer_trickling_past_its_deadline_though_every_read_is_quick():
    """httpx's timeout bounds each read: an engine sending a byte every 0.1 s would hold a call
    with timeout 1 s for as long as its answer lasts (here ~5 s). The whole exchange is bounded."""
    engine = FakeEngine()
    server = FakeEngineServer(engine)
    server.slow["/weight_info"] = 0.1
    try:
        client = EngineClient(EngineConfig(url=server.url, timeout=1.0))
        with pytest.raises(EngineUnavailable, match=r"/weight_info: no whole answer within 1 s"):
            client.weight_version()
        assert server.cut.wait(5), "the client hung up on the answer"
        assert not server.trickled.is_set(), "before the engine had sent all of it"
        server.slow.clear()
        assert client.weight_version() == "default", "the next call has a connection of its own"
    finally:
        server.close()


def test_client_ends_a_trickling_answer_over_https_too(tmp_path, monkeypatch):
    """TLS wraps the connection's socket anew: the deadline shuts that one (shutting the plain
    socket it replaced did nothing, and the call lasted as long as the engine liked)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the client trusts it as an operator's CA
    server = FakeEngineServer(FakeEngine(), tls=tls)
    server.slow["/weight_info"] = 0.1
    try:
        client = EngineClient(EngineConfig(url=server.url, timeout=1.0))
        with pytest.raises(EngineUnavailable, match=r"/weight_info: no whole answer within 1 s"):
            client.weight_version()
        assert server.cut.wait(5) and not server.trickled.is_set()
        server.slow.clear()
        assert client.weight_version() == "default"
    finally:
        server.close()
