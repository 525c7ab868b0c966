"""Several `pdserve serve` stacks on one host: the internal ZMQ ports are chosen free unless
`--zmq-base-port` forces them, and a port in use (the HTTP port, or one of a forced base) stops
the launch before any process starts with one line naming its flag and exit code 2."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest

from benchmarks.stack import ROOT, START_TIMEOUT_S, alive, descendants, same_python_env
from common.protocol import wire_auth
from pdserve.cli import main
from pdserve.flags import build_parser
from pdserve.plan import configs_from_args
from pdserve.ports import Ports, bind_problem, free_ports, internal_ports


class DefaultStack:
    """`scripts/launch_pd.sh --port P ...` with no --zmq-base-port, as a user starts it."""

    def __init__(self, port: int, args: list[str], log_path: Path, env: dict) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path, self.log = log_path, open(log_path, "w")
        cmd = ["bash", str(ROOT / "scripts/launch_pd.sh"), "--port", str(port), *args]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
            start_new_session=True,
        )  # fmt: skip

    def serving(self) -> bool:
        text = self.log_path.read_text()
        if self.proc.poll() is not None:
            raise RuntimeError(f"launcher exited with {self.proc.returncode}:\n{text[-4000:]}")
        return "pdserve is serving" in text

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return json.loads(response.read())

    def chat(self, text: str) -> dict:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0}
        request = urllib.request.Request(
            self.url + "/v1/chat/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
            return json.loads(response.read())

    def wait_for(self, predicate, what: str, timeout_s: float = 60.0):
        """Poll until `predicate()` is truthy; the deadline guards against hangs, not speed."""
        deadline = time.monotonic() + timeout_s
        while (value := predicate()) is None or value is False:
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)
        return value

    def stop(self) -> list[int]:
        """Ctrl-C; the started processes still alive after it."""
        pids = descendants(self.proc.pid)
        self.proc.send_signal(2)
        self.proc.wait(timeout=60)
        self.log.close()
        return [p for p in pids if alive(p)]


def start_side_by_side(tmp_path: Path, args: list[str], count: int) -> list[DefaultStack]:
    env = same_python_env(tmp_path / "venv")
    ports = free_ports("127.0.0.1", count)
    with ExitStack() as cleanup:
        stacks = []
        for i, port in enumerate(ports):
            stack = DefaultStack(port, args, tmp_path / f"stack{i}.log", env)
            cleanup.callback(stack.stop)
            stacks.append(stack)
        deadline = time.monotonic() + START_TIMEOUT_S  # guards against a hang, not speed
        while not all(s.serving() for s in stacks):
            assert time.monotonic() < deadline, "stacks not serving in time"
            time.sleep(0.3)
        cleanup.pop_all()
    return stacks


def test_two_default_stacks_started_side_by_side_both_serve(tmp_path):
    stacks = start_side_by_side(tmp_path, ["--colocated"], 2)
    try:
        answers = [s.chat("Name a colour.") for s in stacks]
        assert all(a["choices"][0]["message"]["content"] for a in answers)
        assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
        (a,), (b,) = ([n["id"] for n in s.get("/health")["nodes"]] for s in stacks)
        assert a != b  # each stack's node on its own port
    finally:
        assert [s.stop() for s in stacks] == [[], []]


def parse(*argv: str):
    return configs_from_args(build_parser().parse_args(["serve", *argv])).launch


def test_one_rule_for_the_internal_ports(monkeypatch):
    chosen = internal_ports(parse("--num-prefill", "2"))
    assert chosen.base is None and len({p for _, p in chosen.named()}) == 1 + 2 + 2
    assert all(bind_problem("127.0.0.1", p) is None for _, p in chosen.named())
    assert internal_ports(parse("--zmq-base-port", "7000")) == Ports.from_base(7000, 1, 1)
    monkeypatch.setattr(wire_auth.SIGNER, "secret", b"s")  # beyond loopback needs one
    beyond = internal_ports(parse("--bind-host", "10.0.0.2"))
    joining = internal_ports(parse("--num-prefill", "0", "--router-url", "http://10.0.0.1:8000"))
    assert beyond.base == joining.base == 5600  # other hosts must know the events port


@pytest.fixture
def listening():
    """A port something listens on, whose neighbours at -101, -100 and +100 are free (the
    other ports of the ZMQ base 101 below it)."""
    with socket.socket() as s:
        for port in range(30101, 31000):
            if all(bind_problem("127.0.0.1", port + d) is None for d in (-101, -100, 0, 100)):
                s.bind(("127.0.0.1", port))
                s.listen()
                yield port
                return
        pytest.fail("no free port range found")


def test_a_taken_http_port_is_one_line_naming_the_flag_and_exit_code_2(listening, capsys):
    assert main(["serve", "--colocated", "--port", str(listening)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pdserve: error: --port {listening} is in use (127.0.0.1)"]


def test_a_taken_port_of_a_forced_zmq_base_names_the_flag_port_and_socket(listening, capsys):
    base = listening - 101  # decode-0's control port is base + 101
    (http,) = free_ports("127.0.0.1", 1)
    assert main(["serve", "--port", str(http), "--zmq-base-port", str(base)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"pdserve: error: --zmq-base-port {base}: port {listening} (decode-0 control) is in use "
        "(127.0.0.1)"
    ]
