"""The HTTP front door (API key, body limit, CORS) through the real FastAPI app against
loopback nodes, and the signed frames required once sockets leave loopback."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest

from common.protocol.messages import Abort, MessageError, decode, encode
from common.protocol.wire_auth import (
    SIGNER,
    FrameSigner,
    SignatureError,
    is_loopback,
    require_secret_for,
)
from kv_transfer.frames import AbortHeader, FrameError, decode_header, encode_header
from router.app import create_app
from router.config import RouterConfig
from tests.pd_stack import ROOT
from tests.router_fakes import LoopbackNodes, ManualClock, generation_script, heartbeat

P, D = "tcp://127.0.0.1:5601", "tcp://127.0.0.1:5701"
KEY = "sk-test-key"


@pytest.fixture
def make(source, tokenizer):
    def build(**cfg):
        link = LoopbackNodes(generation_script([42, 43]))
        config = RouterConfig(prefill=(P,), decode=(D,), served_model_name="smol", **cfg)
        app = create_app(config, source=source, tokenizer=tokenizer, link=link, clock=ManualClock())
        link.deliver = app.state.core.on_message
        app.state.core.on_message(heartbeat(P, "prefill"))
        app.state.core.on_message(heartbeat(D, "decode"))
        return app

    return build


def call(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            return await c.request(method, path, **kwargs)

    return asyncio.run(go())


BODY = {"prompt": [1, 2, 3], "max_tokens": 2}


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x"])
def test_v1_without_the_right_bearer_key_is_401_in_the_openai_shape(make, header):
    app = make(api_key=KEY)
    headers = {} if header is None else {"Authorization": header}
    for method, path, body in [
        ("POST", "/v1/completions", BODY),
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"prompt": "hi"}),
    ]:
        r = call(app, method, path, json=body, headers=headers)
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_the_right_key_passes_and_health_and_metrics_stay_open(make):
    app = make(api_key=KEY)
    for auth in ({"Authorization": f"Bearer {KEY}"}, {"Authorization": f"bearer {KEY}"}):
        assert call(app, "POST", "/v1/completions", json=BODY, headers=auth).status_code == 200
    assert call(app, "GET", "/health").status_code == 200
    assert call(app, "GET", "/metrics").status_code == 200


def test_auth_all_endpoints_protects_health_and_metrics_too(make):
    app = make(api_key=KEY, auth_all_endpoints=True)
    assert call(app, "GET", "/health").status_code == 401
    assert call(app, "GET", "/metrics").status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    assert call(app, "GET", "/health", headers=auth).status_code == 200


def test_without_a_key_everything_is_open(make):
    assert call(make(), "POST", "/v1/completions", json=BODY).status_code == 200


def test_a_body_over_the_limit_is_413_announced_or_streamed(make):
    app = make(max_request_body_bytes=100)
    big = {"prompt": list(range(200)), "max_tokens": 2}
    r = call(app, "POST", "/v1/completions", json=big)
    assert r.status_code == 413 and "100 bytes" in r.json()["error"]["message"]

    async def chunks():
        for _ in range(10):
            yield b" " * 20  # no content-length: counted as it arrives

    r = call(app, "POST", "/v1/completions", content=chunks())
    assert r.status_code == 413
    assert call(app, "POST", "/v1/completions", json=BODY).status_code == 200


def test_cors_preflight_is_answered_without_a_key_and_responses_carry_the_origin(make):
    app = make(api_key=KEY, allowed_origins=("https://app.example",))
    preflight = call(
        app,
        "OPTIONS",
        "/v1/completions",
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    r = call(app, "GET", "/health", headers={"Origin": "https://app.example"})
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    other = call(app, "GET", "/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_signed_frames_verify_and_tampered_or_unsigned_ones_do_not():
    signer = FrameSigner(b"s3cret")
    frame = signer.sign(b"payload")
    assert signer.verify(frame) == b"payload"
    with pytest.raises(SignatureError):
        signer.verify(frame[:-1] + b"X")
    with pytest.raises(SignatureError):
        signer.verify(b"payload")
    with pytest.raises(SignatureError):
        FrameSigner(b"other").verify(frame)
    assert FrameSigner(None).verify(b"payload") == b"payload"


def test_with_a_cluster_secret_messages_and_kv_headers_must_be_signed(monkeypatch):
    unsigned_message, unsigned_header = encode(Abort("r1")), encode_header(AbortHeader("r1", "x"))
    monkeypatch.setattr(SIGNER, "secret", b"cluster")
    assert decode(encode(Abort("r1"))) == Abort("r1")
    assert decode_header(encode_header(AbortHeader("r1", "x"))) == AbortHeader("r1", "x")
    with pytest.raises(MessageError, match="signature"):
        decode(unsigned_message)
    with pytest.raises(FrameError, match="signature"):
        decode_header(unsigned_header)


def test_loopback_addresses():
    assert is_loopback("tcp://127.0.0.1:5600") and is_loopback("tcp://localhost:1")
    assert is_loopback("tcp://[::1]:5600") and is_loopback("ipc:///tmp/x")
    assert not is_loopback("tcp://0.0.0.0:5600") and not is_loopback("tcp://*:5600")
    assert not is_loopback("tcp://10.1.2.3:5600")


def test_binding_beyond_loopback_requires_a_cluster_secret():
    require_secret_for(["tcp://127.0.0.1:1"], FrameSigner(None))
    require_secret_for(["tcp://0.0.0.0:1"], FrameSigner(b"s"))
    with pytest.raises(ValueError, match="PDSERVE_CLUSTER_SECRET"):
        require_secret_for(["tcp://127.0.0.1:1", "tcp://0.0.0.0:1"], FrameSigner(None))


@pytest.mark.parametrize("module", ["prefill_node", "router"])
def test_processes_refuse_to_bind_beyond_loopback_without_a_secret(module):
    flag = "--events-address" if module == "router" else "--control-address"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", module, flag, "tcp://0.0.0.0:5999"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "PDSERVE_CLUSTER_SECRET" in done.stderr
