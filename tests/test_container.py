"""The CPU container image (deploy/Containerfile.cpu, built by deploy/build-image.sh) built
with podman and run: `pdserve serve` colocated on the embedded model answers a chat request,
the image's HEALTHCHECK passes, the server runs as a non-root user, and it converts no model (the
image holds the embedded one converted).

Skipped where podman, runc or mmdebstrap are missing (Debian packages; where they are installed,
CI runs these tests too), or with PDSERVE_CONTAINER_TESTS=0: a first build takes minutes. The
helpers here also build the image for tests/test_k8s_manifests.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.pd_stack import ROOT, pick_ports

TOOLS = ("podman", "runc", "mmdebstrap")
BASE_IMAGE = "localhost/pdserve-base:bookworm"
IMAGE = "localhost/pdserve:cpu"
IMAGE_PYTHON = (3, 11)  # Debian bookworm's python3: the wheelhouse is built for it
# What the image is built from; its hash lets a second test module reuse a fresh build.
IMAGE_SOURCES = ("pyproject.toml", "README.md", "deploy", "common", "router", "prefill_node",
                 "decode_node", "kv_transfer", "pdserve")  # fmt: skip
STATE_DIR = Path(tempfile.gettempdir()) / "pdserve-image-test"


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def skip_reason() -> str | None:
    if missing_tools():
        return f"building images needs {', '.join(missing_tools())} (Debian packages)"
    if os.environ.get("PDSERVE_CONTAINER_TESTS") == "0":
        return "image builds switched off: PDSERVE_CONTAINER_TESTS=0"
    if sys.version_info[:2] != IMAGE_PYTHON:
        return f"the image's python3 is {IMAGE_PYTHON}; wheels are built with {sys.version}"
    return None


requires_podman = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))


def podman_env() -> dict[str, str]:
    """The environment podman runs in here: runc (crun fails on this machine's cgroups) and no
    default ulimits (the runtime refuses podman's RLIMIT_NOFILE)."""
    STATE_DIR.mkdir(exist_ok=True)
    conf = STATE_DIR / "containers.conf"
    conf.write_text('[containers]\ndefault_ulimits = []\n[engine]\nruntime = "runc"\n')
    return dict(os.environ, CONTAINERS_CONF=str(conf))


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["podman", *args], env=podman_env(), capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {result.returncode}\n{result.stderr}")
    return result


def source_hash() -> str:
    digest = hashlib.sha256()
    for name in IMAGE_SOURCES:
        path = ROOT / name
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        for f in files:
            if f.is_file() and "__pycache__" not in f.parts and "wheelhouse" not in f.parts:
                digest.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


def cpu_image(reuse: bool) -> tuple[str, float]:
    """Build the CPU image (and its Debian base when missing) with deploy/build-image.sh, one
    build at a time on this host; the tag and the build's seconds. `reuse`: no build when the
    image was last built here from the same sources (0 seconds)."""
    STATE_DIR.mkdir(exist_ok=True)
    built = STATE_DIR / "built-from"
    with open(STATE_DIR / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        exists = podman("image", "exists", IMAGE, check=False).returncode == 0
        if reuse and exists and built.exists() and built.read_text() == source_hash():
            return IMAGE, 0.0
        script = str(ROOT / "deploy" / "build-image.sh")
        env = dict(podman_env(), BASE_IMAGE=BASE_IMAGE, PYTHON=sys.executable)
        if podman("image", "exists", BASE_IMAGE, check=False).returncode != 0:
            subprocess.run([script, "base", BASE_IMAGE], env=env, check=True, timeout=900)
        start = time.monotonic()
        result = subprocess.run(
            [script, "cpu", IMAGE], env=env, capture_output=True, text=True, timeout=1800
        )
        assert result.returncode == 0, result.stderr[-4000:]
        built.write_text(source_hash())
        return IMAGE, time.monotonic() - start


def http_json(url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")
    except (OSError, ValueError):
        return 0, {}


def wait_until(check, timeout_s: float, what: str, logs=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout_s:g} s\n{logs()}")
        time.sleep(2)


def chat(base_url: str) -> dict:
    status, body = http_json(
        base_url + "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
         "temperature": 0},
    )  # fmt: skip
    assert status == 200, body
    return body


@requires_podman
def test_cpu_image_serves_a_chat_request_as_non_root_and_reports_healthy():
    image, build_s = cpu_image(reuse=False)
    print(f"\nCPU image build: {build_s:.0f} s")
    port, _ = pick_ports()
    name = f"pdserve-smoke-{os.getpid()}"
    # The image's default command: `pdserve serve --host 0.0.0.0` (colocated below, one node).
    podman("run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000", image,
           "serve", "--host", "0.0.0.0", "--colocated")  # fmt: skip
    try:
        start = time.monotonic()
        url = f"http://127.0.0.1:{port}"
        logs = lambda: podman("logs", name, check=False).stderr[-4000:]  # noqa: E731
        wait_until(lambda: http_json(url + "/health")[0] == 200, 300, "healthy", logs)
        print(f"serving after {time.monotonic() - start:.0f} s")
        body = chat(url)
        assert body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] > 0
        assert podman("healthcheck", "run", name, check=False).returncode == 0, logs()
        uid = podman("exec", name, "id", "-u").stdout.strip()
        assert uid == "1000"
        # The embedded model was converted at build time: the container converted nothing.
        listed = podman("exec", name, "sh", "-c", "ls -A ~/.cache/pdserve/gguf 2>/dev/null || :")
        assert not [n for n in listed.stdout.split() if n.startswith("SmolLM2")], listed.stdout
        inspected = json.loads(podman("image", "inspect", image).stdout)[0]
        assert inspected["Config"]["Entrypoint"] == ["pdserve"]
        assert inspected["Healthcheck"]["Test"] == ["CMD", "pdserve-healthcheck"]
    finally:
        podman("rm", "-f", "-t", "5", name, check=False)
    assert podman("ps", "-a", "-q", "--filter", f"name={name}").stdout.strip() == ""
