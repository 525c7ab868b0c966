"""The router as a gateway, end to end on the real stack (scripts/launch_pd.sh, the embedded
model): admission control, deadlines, API keys, metrics and hostile frames. One stack serves
the whole module: an API key, at most 2 requests waiting per pool, a 15 s request deadline,
and a cluster secret, so every control message and KV header between the processes is signed."""

from __future__ import annotations

import concurrent.futures
import os

import httpx
import msgpack
import openai
import pytest
import zmq

from common.protocol.wire_auth import FrameSigner
from tests.pd_stack import PDStack

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-gateway-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
DEADLINE_S = 15
SECRET = "gateway-test-secret"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = PDStack(
        "--router-max-waiting-requests", "2",
        "--router-retry-after-s", "2",
        "--router-request-timeout-s", str(DEADLINE_S),
        "--router-api-key", KEY,
        "--prefill-num-kv-blocks", "512", "--decode-num-kv-blocks", "512",  # 8192 tokens each
        log_path=tmp_path_factory.mktemp("gateway") / "launch.log",
        env={**os.environ, "PDSERVE_CLUSTER_SECRET": SECRET},
    )  # fmt: skip
    yield s
    assert s.stop() == [], "processes left after Ctrl-C"


def post(stack: PDStack, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        stack.url + "/v1/completions",
        json={"model": MODEL, **body},
        headers=AUTH if headers is None else headers,
        timeout=DEADLINE_S + 60,
    )


def blocks_released(stack: PDStack) -> bool:
    decode, prefill = stack.node("decode")["load"], stack.node("prefill")["load"]
    return (
        decode["used_blocks"] == 0
        and decode["reserved"] == 0
        and decode["quarantined"] == 0
        and prefill["used_blocks"] == 0
    )


def test_overload_past_the_waiting_bound_gets_429_while_admitted_requests_complete(stack):
    # 8 prompts at once for a bound of 2 waiting per pool: the router refuses what does not fit
    # at once (prefills take far longer than the router needs to answer 8 requests).
    prompts = [[100 + (7 * i + j) % 3000 for j in range(200)] for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(
            pool.map(
                lambda p: post(stack, {"prompt": p, "max_tokens": 4, "ignore_eos": True}), prompts
            )
        )
    refused = [r for r in responses if r.status_code == 429]
    served = [r for r in responses if r.status_code != 429]
    assert refused, [r.status_code for r in responses]
    for r in refused:
        assert r.headers["retry-after"] == "2"
        assert r.json()["error"]["type"] == "rate_limit_error"
    assert len(served) >= 2
    for r in served:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    stack.wait_for(lambda: blocks_released(stack), "blocks to be released after the burst")


def test_a_request_past_its_deadline_gets_504_and_frees_its_blocks_on_every_node(stack):
    # 4000 tokens take minutes on a CPU: the deadline ends the request long before.
    r = post(stack, {"prompt": "Count to ten thousand.", "max_tokens": 4000, "ignore_eos": True})
    assert r.status_code == 504, r.text
    assert str(DEADLINE_S) in r.json()["error"]["message"]
    stack.wait_for(lambda: blocks_released(stack), "blocks to be released after the deadline")
    assert post(stack, {"prompt": "Hello", "max_tokens": 2}).status_code == 200


def test_the_openai_client_needs_the_right_api_key(stack):
    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=60)

    resp = client(KEY).completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert resp.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError) as wrong:
        client("sk-wrong").completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert wrong.value.status_code == 401 and wrong.value.code == "invalid_api_key"
    missing = httpx.post(stack.url + "/v1/completions", json={"prompt": "Hi"}, timeout=30)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert stack.get("/health")[0] == 200  # open without a key


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# Frames no node may act on: garbage, msgpack of the wrong shape, unknown or mistyped
# messages, a string that claims 4 GiB, arrays nested 100,000 deep.
HOSTILE_CONTROL = [
    b"",
    b"\xff" * 64,
    pack([1, 2, 3]),
    pack({"type": "NoSuchMessage"}),
    pack({"type": "PrefillRequest"}),
    pack({"type": "Abort", "request_id": 5}),
    pack({"type": "DecodeRequest", "request_id": "x", "prompt_token_ids": "a", "sampling": {},
          "prefill_node": None}),
    b"\xdb\xff\xff\xff\xff",
    b"\x91" * 100_000 + b"\xc0",
]  # fmt: skip
HOSTILE_KV = [
    [b"\x00\x01"],
    [pack({"kind": "layer", "request_id": 7})],
    [pack({"kind": "layer", "request_id": "nobody", "layer": 0, "block_ids": [0],
           "dtype": "torch.float32", "shape": [1]}), b"\x00" * 64],
    [pack({"kind": "complete", "request_id": "nobody", "metadata": {}})],
    [b"\x91" * 100_000 + b"\xc0"],
]  # fmt: skip


def test_hostile_frames_to_node_sockets_are_rejected_counted_and_harmless(stack):
    signer = FrameSigner(SECRET.encode())
    prefill, decode = stack.node("prefill"), stack.node("decode")
    before = {n["id"]: n["load"] for n in (prefill, decode)}
    ctx = zmq.Context()
    try:
        for address in (prefill["id"], decode["id"]):  # control inboxes
            sock = ctx.socket(zmq.PUSH)
            sock.connect(address)
            for frame in HOSTILE_CONTROL:  # unsigned, then signed with the cluster secret
                sock.send(frame)
                sock.send(signer.sign(frame))
            sock.close(linger=5000)
        kv = ctx.socket(zmq.PUSH)
        kv.connect(f"tcp://127.0.0.1:{stack.base + 201}")  # decode node 0's KV receiver
        for frames in HOSTILE_KV:
            kv.send_multipart(frames)
            kv.send_multipart([signer.sign(frames[0]), *frames[1:]])
        kv.close(linger=5000)
    finally:
        ctx.term()
    sent = 2 * len(HOSTILE_CONTROL)

    def counted() -> bool:
        d = stack.node("decode")["load"]
        p = stack.node("prefill")["load"]
        kv_dropped = d["kv_late_frames"] + d["kv_malformed_frames"]
        kv_before = (
            before[decode["id"]]["kv_late_frames"] + before[decode["id"]]["kv_malformed_frames"]
        )
        return (
            p["invalid_messages"] == before[prefill["id"]]["invalid_messages"] + sent
            and d["invalid_messages"] == before[decode["id"]]["invalid_messages"] + sent
            and kv_dropped == kv_before + 2 * len(HOSTILE_KV)
        )

    stack.wait_for(counted, "every hostile frame to be counted as rejected")
    assert stack.node("prefill")["pid"] == prefill["pid"]  # nobody crashed or restarted
    assert stack.node("decode")["pid"] == decode["pid"]
    assert post(stack, {"prompt": "Hello", "max_tokens": 2}).status_code == 200
