"""Start and stop the whole PD stack exactly as a user does: `scripts/launch_pd.sh`.

Shared by the end-to-end tests (tests/pd_stack.py re-exports it) and the serving benchmarks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 600


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


PORT_ATTEMPTS = 3


class PortTaken(RuntimeError):
    """The stack exited at start-up because a port it was given had been taken meanwhile."""


def pick_ports() -> tuple[int, int]:
    """An HTTP port and a ZMQ base port whose +0..+210 range is free. Below Linux's ephemeral
    range (32768 up): a port free now but in that range can be handed to another process's
    outgoing connection before the stack binds it."""
    rng = random.Random(os.getpid() * 7919 + time.time_ns())
    while True:
        base = rng.randrange(20000, 32400, 10)
        if all(_free(base + k) for k in (0, 1, 2, 101, 102, 201, 202)) and _free(base + 300):
            return base + 300, base


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def rank_pids(node_pid: int) -> list[int]:
    """A node's rank processes (its multiprocessing spawn children: TP ranks, PP stages)."""
    out = []
    for pid in descendants(node_pid):
        try:
            if b"spawn_main" in (Path("/proc") / str(pid) / "cmdline").read_bytes():
                out.append(pid)
        except OSError:
            continue
    return out


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def add_model_args(ap: argparse.ArgumentParser, model_help: str) -> None:
    """--model (Qwen2.5-7B shapes by default), --load-format and --health-timeout of a script
    that starts stacks; `resolve_load_format` fills the load format in after parsing."""
    ap.add_argument(
        "--model", default=str(ROOT / "benchmarks/configs/qwen2.5-7b-instruct"), help=model_help
    )
    ap.add_argument("--load-format", default=None, help="default: dummy with --model, auto without")
    ap.add_argument("--health-timeout", type=int, default=300, help="seconds per stack start")


def resolve_load_format(args: argparse.Namespace) -> None:
    """A config directory has no weights (dummy); the embedded model ('' = none named) has."""
    if args.load_format is None:
        args.load_format = "dummy" if args.model else "auto"


def same_python_env(shim_dir: Path) -> dict[str, str]:
    """An environment in which launch_pd.sh runs every process with this interpreter.

    launch_pd.sh asks scripts/setup_env.sh for its Python, which builds `.venv` (and installs
    torch) unless PDSERVE_VENV names a venv holding bin/python and an install stamp newer than
    pyproject.toml. A machine without network access but with the packages installed (a GPU
    box) has no usable `.venv`; a shim venv whose bin/python execs `sys.executable` lets the
    stack run there with exactly the Python of the caller. A PDSERVE_VENV already set wins.
    """
    env = dict(os.environ)
    if "PDSERVE_VENV" in env:
        return env
    python = shim_dir / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    (shim_dir / ".pdserve-installed").touch()  # the stamp setup_env.sh checks
    env["PDSERVE_VENV"] = str(shim_dir)
    return env


class PDStack:
    def __init__(
        self,
        *args: str,
        log_path: Path,
        start_timeout_s: float = START_TIMEOUT_S,
        env: dict[str, str] | None = None,
    ) -> None:
        self.log_path = log_path
        self.pids: list[int] = []
        # Ports are checked free, then bound seconds later, once the nodes have loaded their
        # weights; a stack starting beside this one in that window can take one of them. The
        # stack that binds second exits naming the port, and starts again on other ports.
        for attempt in range(PORT_ATTEMPTS):
            self._launch(args, env)
            try:
                self._wait_ready(start_timeout_s)
                break
            except PortTaken:
                if attempt == PORT_ATTEMPTS - 1:
                    raise
                with contextlib.suppress(ProcessLookupError):  # whatever the launcher left
                    os.killpg(self.proc.pid, signal.SIGKILL)
        self.pids = descendants(self.proc.pid)

    def _launch(self, args: tuple[str, ...], env: dict[str, str] | None) -> None:
        self.port, self.base = pick_ports()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            "bash",
            str(ROOT / "scripts/launch_pd.sh"),
            "--port",
            str(self.port),
            "--zmq-base-port",
            str(self.base),
            *args,
        ]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
            env=env,
        )

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log_path.read_text()
            if "pdserve is serving" in text:
                return
            if self.proc.poll() is not None:
                self.log.close()
                taken = "Address already in use" in text or ") is in use (" in text
                error = PortTaken if taken else RuntimeError
                raise error(f"launch_pd.sh exited with {self.proc.returncode}:\n{text[-4000:]}")
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("the stack did not become healthy in time")

    def get(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def node(self, role: str) -> dict:
        return next(n for n in self.get("/health")[1]["nodes"] if n["role"] == role)

    def wait_for(self, predicate, what: str, timeout_s: float = 60.0):
        """Poll until `predicate()` is truthy; the deadline guards against hangs, not speed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}")

    def stop(self, sig: int = signal.SIGINT) -> list[int]:
        """Stop the launcher as Ctrl-C does; return the started processes still alive after it."""
        pids = descendants(self.proc.pid) or self.pids
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return [p for p in pids + self.pids if alive(p)]
