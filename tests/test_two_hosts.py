"""Two hosts without a second machine: the router and a prefill node in one network namespace
(host A, 10.77.0.1), a decode node in another (host B, 10.77.0.2), a veth pair between them.
Each host runs `scripts/launch_pd.sh` as a user would (README, "Two hosts"): host A with
`--num-decode 0`, host B with `--num-prefill 0 --router-url`, both with `--bind-host` and
`PDSERVE_CLUSTER_SECRET`. The decode node registers with the router by heartbeat across the
veth, the prompt's KV goes over zmq/TCP across it, and the text equals the colocated engine's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.stack import ROOT, same_python_env
from common import SamplingParams
from tests.netns import HostPair, NetnsUnavailable

BASE = 5600  # the same --zmq-base-port on both hosts, as the README's layout has it
PORT = 8000
PROMPT = "The capital of France is"
START_TIMEOUT_S = 600


def launch(pair: HostPair, host: int, args: list[str], env: dict, log_path) -> subprocess.Popen:
    cmd = ["bash", str(ROOT / "scripts/launch_pd.sh"), "--zmq-base-port", str(BASE),
           "--num-kv-blocks", "128", "--bind-host", pair.addresses[host], *args]  # fmt: skip
    log = open(log_path, "w")
    return pair.run_in(host, cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def wait_serving(procs: dict[str, subprocess.Popen], logs: dict) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    waiting = set(procs)
    while waiting and time.monotonic() < deadline:
        for name in list(waiting):
            text = logs[name].read_text()
            if "pdserve is serving" in text:
                waiting.discard(name)
            elif procs[name].poll() is not None:
                raise RuntimeError(f"host {name} launcher exited:\n{text[-4000:]}")
        time.sleep(0.3)
    if waiting:
        raise RuntimeError(f"hosts {sorted(waiting)} not serving after {START_TIMEOUT_S} s")


def http_in(pair: HostPair, host: int, path: str, body: dict | None = None) -> tuple[int, dict]:
    """An HTTP request made from inside namespace `host` (the router is reachable there)."""
    script = (
        "import json, sys, urllib.request, urllib.error\n"
        "url, body = sys.argv[1], sys.argv[2]\n"
        "data = body.encode() if body else None\n"
        "req = urllib.request.Request(url, data, {'Content-Type': 'application/json'})\n"
        "try:\n"
        "    r = urllib.request.urlopen(req, timeout=120); print(r.status); print(r.read().decode())\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(e.code); print(e.read().decode())\n"
    )
    url = f"http://{pair.addresses[0]}:{PORT}{path}"
    argv = ["ip", "netns", "exec", pair.names[host], sys.executable, "-c", script, url,
            json.dumps(body) if body is not None else ""]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=True).stdout
    status, text = out.split("\n", 1)
    return int(status), json.loads(text)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two_hosts")
    pair = HostPair(tag=str(os.getpid() % 100000))
    try:
        pair.create()
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces cannot be made here: {exc}")
    env = same_python_env(tmp / "venv")
    env.update(PDSERVE_CLUSTER_SECRET="two-hosts-test-secret", OMP_NUM_THREADS="1")
    logs = {"A": tmp / "host_a.log", "B": tmp / "host_b.log"}
    procs = {}
    try:
        procs["A"] = launch(pair, 0, ["--num-decode", "0", "--host", pair.addresses[0],
                                      "--port", str(PORT)], env, logs["A"])  # fmt: skip
        router_url = f"http://{pair.addresses[0]}:{PORT}"
        procs["B"] = launch(pair, 1, ["--num-prefill", "0", "--router-url", router_url],
                            env, logs["B"])  # fmt: skip
        wait_serving(procs, logs)
        yield pair
    finally:
        for name in ("B", "A"):  # Ctrl-C, as a user stops each host's launcher
            if name in procs and procs[name].poll() is None:
                procs[name].send_signal(signal.SIGINT)
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        leftovers = pair.destroy()
    assert leftovers == [], f"processes left in the namespaces after Ctrl-C: {leftovers}"


def test_decode_node_on_another_host_joins_and_serves_the_colocated_greedy_text(hosts, smollm_llm):
    a, b = hosts.addresses
    status, health = http_in(hosts, 0, "/health")
    assert status == 200, health
    nodes = {n["id"]: n for n in health["nodes"]}
    assert nodes[f"tcp://{a}:{BASE + 1}"]["role"] == "prefill"
    decode = nodes[f"tcp://{b}:{BASE + 101}"]
    assert decode["role"] == "decode" and decode["healthy"]
    assert decode["info"]["kv_address"] == f"tcp://{b}:{BASE + 201}"

    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    status, response = http_in(hosts, 0, "/v1/completions", body)
    assert status == 200, response
    ids = smollm_llm.tokenizer.encode(PROMPT)
    local = smollm_llm.generate(ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert response["choices"][0]["text"] == local[0].text
    assert response["usage"]["completion_tokens"] == 6

    def kv_bytes() -> int:
        load = http_in(hosts, 0, "/health")[1]
        node = next(n for n in load["nodes"] if n["id"] == f"tcp://{b}:{BASE + 101}")
        return node["load"].get("kv_transfer_bytes", 0)

    deadline = time.monotonic() + 30  # the next heartbeat carries the count
    while kv_bytes() == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert kv_bytes() > 0, "the decode node on host B received no KV bytes"
