"""deploy/k8s: every variant rendered and validated against the Kubernetes API schemas
(kubernetes-validate, strict: an unknown field fails), its command lines parsed by pdserve's own
parsers, its wiring checked (nodes reach the router through a Service, bind their pod's
address on declared ports, pools with probes and a PodDisruptionBudget), and the CPU variant
run for real with `podman kube play --network host`.

kustomize is not installed here: `render` builds what `kustomize build` builds for the fields
deploy/k8s uses, and refuses any other field, so a manifest needing more fails here.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from common.node.config import parse_node_args
from common.protocol import wire_auth
from pdserve.cli import ROLE_MODULES
from router.config import config_from_args
from tests.pd_stack import ROOT
from tests.test_container import (
    chat,
    cpu_image,
    http_json,
    podman,
    podman_env,
    requires_podman,
    wait_until,
)

K8S = ROOT / "deploy" / "k8s"
VARIANTS = ("cpu", "gpu")
KUBE_VERSIONS = ("1.29", "latest")  # the oldest Kubernetes still widely run, and the newest
# Strategic merge: list fields merged item by item on this key; other lists are replaced.
MERGE_KEYS = {"containers": "name", "env": "name", "volumes": "name", "volumeMounts": "mountPath",
              "ports": "containerPort"}  # fmt: skip
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


# --- rendering: the kustomize subset deploy/k8s uses ---------------------------------------


def render(directory: Path) -> list[dict[str, Any]]:
    """`kustomize build directory` for resources, images and patches (strategic merge or
    JSON 6902, inline or from a file, with an optional kind/name target)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - {"apiVersion", "kind", "resources", "images", "patches"}
    if unknown:
        raise ValueError(f"{directory}: kustomization fields {sorted(unknown)} are not rendered")
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        objects += render(path) if path.is_dir() else list(yaml.safe_load_all(path.read_text()))
    for patch in kustomization.get("patches", []):
        text = patch["patch"] if "patch" in patch else (directory / patch["path"]).read_text()
        for document in yaml.safe_load_all(text):
            apply_patch(objects, document, patch.get("target"))
    for image in kustomization.get("images", []):
        for pod in [o["spec"]["template"]["spec"] for o in objects if o["kind"] == "Deployment"]:
            for container in pod["containers"]:
                if container["image"].rsplit(":", 1)[0] == image["name"]:
                    container["image"] = f"{image['newName']}:{image['newTag']}"
    return objects


def apply_patch(objects: list[dict], patch: Any, target: dict | None) -> None:
    if target is not None and set(target) - {"kind", "name"}:
        raise ValueError(f"patch targets by {sorted(target)} are not rendered")
    if target is None:
        target = {"kind": patch["kind"], "name": patch["metadata"]["name"]}
    matches = [
        i for i, o in enumerate(objects)
        if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]
    ]  # fmt: skip
    if len(matches) != 1:
        raise ValueError(f"patch target {target} matches {len(matches)} objects")
    i = matches[0]
    objects[i] = (
        json_patch(objects[i], patch) if isinstance(patch, list) else merge(objects[i], patch)
    )


def merge(base: Any, patch: Any, key: str = "") -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        field, out = MERGE_KEYS[key], copy.deepcopy(base)
        for item in patch:
            at = [j for j, b in enumerate(out) if b.get(field) == item.get(field)]
            if at:
                out[at[0]] = merge(out[at[0]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def json_patch(obj: dict, operations: list[dict]) -> dict:
    out = copy.deepcopy(obj)
    for op in operations:
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"][1:].split("/")
        ]
        node = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if op["op"] == "add" and isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), op["value"])
        elif op["op"] in ("add", "replace"):
            node[int(last) if isinstance(node, list) else last] = op["value"]
        elif op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
        else:
            raise ValueError(f"JSON patch op {op['op']!r} is not rendered")
    return out


# --- reading the rendered objects ------------------------------------------------------------


def deployments(objects: list[dict]) -> dict[str, dict]:
    """By component label: router, prefill, decode."""
    return {
        o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: o
        for o in objects
        if o["kind"] == "Deployment"
    }


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion (a reference to an undefined variable stays as it is)."""
    return VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def container_env(c: dict, pod_ip: str) -> dict[str, str]:
    """The container's variables as the kubelet sets them, in order; secrets as '<secret>'."""
    env: dict[str, str] = {}
    for var in c.get("env", []):
        source = var.get("valueFrom", {})
        if source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[var["name"]] = pod_ip
        elif "secretKeyRef" in source:
            env[var["name"]] = "<secret>"
        else:
            env[var["name"]] = expand(var["value"], env)
    return env


def argv(c: dict, pod_ip: str = "10.1.2.3") -> list[str]:
    env = container_env(c, pod_ip)
    return [expand(arg, env) for arg in c["args"]]


def flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return value


def port_number(c: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in c["ports"] if p["name"] == port]
    return number


def selects(selector: dict[str, str], deployment: dict) -> bool:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / "overlays" / request.param)


# --- the manifests -------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_variant_renders_objects_the_kubernetes_api_accepts(variant, version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install .[test]")
    version = kubernetes_validate.latest_version() if version == "latest" else version
    name, objects = variant
    kinds = sorted(o["kind"] for o in objects)
    assert kinds.count("Deployment") == 3 and kinds.count("PodDisruptionBudget") == 2
    assert kinds.count("Service") == 2
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            where = f"{name} {obj['kind']} {obj['metadata']['name']}"
            raise AssertionError(f"{where}: {error}") from None


def test_every_command_line_is_accepted_by_pdserve_itself(variant, monkeypatch):
    monkeypatch.setattr(wire_auth.SIGNER, "secret", b"k8s")  # PDSERVE_CLUSTER_SECRET is set
    _, objects = variant
    for component, deployment in deployments(objects).items():
        args = argv(container(deployment))
        assert not [a for a in args if VAR_REF.search(a)], args  # every $(VAR) is defined
        role, *rest = args
        assert role in ROLE_MODULES and role == component
        if role == "router":
            config = config_from_args(rest)
            assert config.mode == "pd" and not config.prefill and not config.decode
        else:
            node, engine = parse_node_args(role, rest)
            assert node.control_address.startswith("tcp://10.1.2.3:")


@pytest.mark.parametrize(("role", "own_flag"), [("router", "--events-address"),
                                              ("decode", "--kv-address")])  # fmt: skip
def test_pdserve_role_commands_run_that_role(role, own_flag):
    """What the pods run: `pdserve ROLE` is `python -m MODULE` (its flags, its exit codes)."""
    run = [sys.executable, "-m", "pdserve", role]
    shown = subprocess.run([*run, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert shown.returncode == 0 and own_flag in shown.stdout, shown.stderr
    refused = subprocess.run([*run, "--no-such-flag"], capture_output=True, text=True, cwd=ROOT)
    assert refused.returncode == 2 and "--no-such-flag" in refused.stderr


def test_nodes_reach_the_router_through_a_service_published_before_it_is_ready(variant):
    """The router is ready only once nodes registered, so the Service nodes connect through must
    publish it while it is not; its port must lead to the router's events socket."""
    _, objects = variant
    pods = deployments(objects)
    router = container(pods["router"])
    events_port = urlsplit(flag(argv(router), "events-address")).port
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for pool in ("prefill", "decode"):
        url = urlsplit(flag(argv(container(pods[pool])), "router-address"))
        service = services[url.hostname]
        assert selects(service["spec"]["selector"], pods["router"])
        assert service["spec"].get("publishNotReadyAddresses") is True, url.hostname
        (port,) = [p for p in service["spec"]["ports"] if p["port"] == url.port]
        assert port_number(router, port["targetPort"]) == events_port
        probe = " ".join(container(pods[pool])["readinessProbe"]["exec"]["command"])
        health = urlsplit(re.search(r"http://\S+", probe).group(0))
        assert health.hostname == url.hostname and health.path == "/health"
    clients = services["pdserve-router"]
    assert selects(clients["spec"]["selector"], pods["router"])
    assert not clients["spec"].get("publishNotReadyAddresses")


def test_nodes_bind_their_pod_address_on_the_ports_they_declare(variant):
    _, objects = variant
    pods = deployments(objects)
    for pool, flags in (("prefill", ["control-address"]), ("decode", ["control-address",
                                                                       "kv-address"])):  # fmt: skip
        c = container(pods[pool])
        declared = {p["containerPort"] for p in c["ports"]}
        for name in flags:
            address = urlsplit(flag(argv(c, pod_ip="10.9.8.7"), name))
            assert address.hostname == "10.9.8.7" and address.port in declared, (pool, name)
        probe = " ".join(c["readinessProbe"]["exec"]["command"])
        control = urlsplit(flag(argv(c), "control-address")).port
        assert f'--node "tcp://$POD_IP:{control}"' in probe
        assert port_number(c, c["livenessProbe"]["tcpSocket"]["port"]) == control


def test_each_pool_is_a_deployment_with_probes_a_disruption_budget_and_the_secret(variant):
    _, objects = variant
    pods = deployments(objects)
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    for component, deployment in pods.items():
        spec = deployment["spec"]
        assert selects(spec["selector"]["matchLabels"], deployment)
        c = container(deployment)
        assert {"startupProbe", "livenessProbe", "readinessProbe"} <= set(c)
        assert spec["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
        (secret,) = [v for v in c["env"] if v["name"] == "PDSERVE_CLUSTER_SECRET"]
        assert secret["valueFrom"]["secretKeyRef"] == {"name": "pdserve-cluster", "key": "secret"}
        covering = [b for b in budgets if selects(b["spec"]["selector"]["matchLabels"], deployment)]
        assert len(covering) == (0 if component == "router" else 1), component
    router = container(pods["router"])
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    scrape = pods["router"]["spec"]["template"]["metadata"]["annotations"]
    assert scrape["prometheus.io/scrape"] == "true" and scrape["prometheus.io/path"] == "/metrics"
    assert int(scrape["prometheus.io/port"]) == int(flag(argv(router), "port"))


def test_gpu_pools_ask_for_a_gpu_each_and_cpu_pools_for_none(variant):
    name, objects = variant
    for component, deployment in deployments(objects).items():
        limits = container(deployment).get("resources", {}).get("limits", {})
        wanted = 1 if name == "gpu" and component != "router" else None
        assert limits.get("nvidia.com/gpu") == wanted, component
        assert container(deployment)["image"] == f"localhost/pdserve:{name}"


# --- the CPU variant under podman --------------------------------------------------------------


def podman_pods(objects: list[dict], addresses: dict[str, str]) -> list[dict]:
    """The Deployments (by name: the pod's address) as `podman kube play --network host` 4.3
    runs them: it neither resolves status.podIP, expands $(VAR), gives pods their own network,
    resolves Service names nor keeps emptyDir volumes of different pods apart. Here each pod
    gets its own loopback address (0.0.0.0 in its flags means it, as in its own network
    namespace), Service names become the address of the pod they select, and volumes are
    named after their pod: what the kubelet and the cluster's DNS would do. Declared ports go
    (the host's network has no port mappings), probes name them by number."""
    by_name = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    service_ips = {
        s["metadata"]["name"]: addresses[name]
        for s in objects if s["kind"] == "Service"
        for name, d in by_name.items() if name in addresses and selects(s["spec"]["selector"], d)
    }  # fmt: skip
    out = []
    for name, ip in addresses.items():
        deployment = copy.deepcopy(by_name[name.removesuffix("-scaled")])
        deployment["metadata"]["name"] = name
        pod = deployment["spec"]["template"]["spec"]
        text = json.dumps(pod).replace("0.0.0.0", ip)
        for service in sorted(service_ips, key=len, reverse=True):
            text = re.sub(rf"(?<![\w.-]){service}(?![\w.-])", service_ips[service], text)
        pod = json.loads(text)
        for c in pod["containers"]:
            env = container_env(c, ip)
            c["env"] = [
                v if "secretKeyRef" in v.get("valueFrom", {}) else {"name": v["name"],
                                                                  "value": env[v["name"]]}
                for v in c["env"]
            ]  # fmt: skip
            c["args"] = [expand(a, env) for a in c["args"]]
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                for check in ("httpGet", "tcpSocket"):
                    if check in c.get(probe, {}):
                        c[probe][check]["port"] = port_number(c, c[probe][check]["port"])
            del c["ports"]  # podman publishes declared ports, which host networking refuses
            for mount in c.get("volumeMounts", []):
                mount["name"] = f"{name}-{mount['name']}"
        for volume in pod.get("volumes", []):
            volume["name"] = f"{name}-{volume['name']}"
        deployment["spec"]["template"]["spec"] = pod
        out.append(deployment)
    return out


def play(path: Path, objects: list[dict]) -> None:
    path.write_text(yaml.safe_dump_all(objects))
    podman("kube", "play", "--network", "host", str(path), timeout=300)


def pod_logs(names: list[str]) -> str:
    out = []
    for name in names:
        for suffix in ("-pod-0-router", "-pod-0-prefill", "-pod-0-decode"):
            result = podman("logs", "--tail", "30", name + suffix, check=False)
            if result.returncode == 0:
                out.append(f"--- {name}{suffix}\n{result.stdout}{result.stderr}")
    return "\n".join(out)


@requires_podman
def test_cpu_variant_serves_with_podman_kube_play_and_a_scaled_decode_pool_joins(tmp_path):
    image, _ = cpu_image(reuse=True)
    objects = render(K8S / "overlays" / "cpu")
    assert {container(d)["image"] for d in deployments(objects).values()} == {image}
    secret = base64.b64encode(secrets.token_hex(16).encode()).decode()
    podman("secret", "rm", "pdserve-cluster", check=False)
    # podman 4.3 reads a secretKeyRef from a podman secret holding {key: base64 value}.
    subprocess.run(
        ["podman", "secret", "create", "pdserve-cluster", "-"],
        input=json.dumps({"secret": secret}), text=True, check=True, env=podman_env(),
        capture_output=True,
    )  # fmt: skip
    first = {"pdserve-router": "127.0.0.2", "pdserve-prefill": "127.0.0.3",
             "pdserve-decode": "127.0.0.4"}  # fmt: skip
    scaled = {"pdserve-decode-scaled": "127.0.0.5"}
    names = [*first, *scaled]
    stack, more = tmp_path / "stack.yaml", tmp_path / "scaled.yaml"
    url = "http://127.0.0.2:8000"
    start = time.monotonic()
    try:
        played = podman_pods(objects, first)
        play(stack, played)
        wait_until(lambda: http_json(url + "/health")[0] == 200, 600, "router healthy",
                   lambda: pod_logs(names))  # fmt: skip
        print(f"\nrouter, prefill and decode pods serving after {time.monotonic() - start:.0f} s")
        assert chat(url)["choices"][0]["message"]["content"]
        for pool in ("prefill", "decode"):
            probe = container(deployments(played)[pool])["readinessProbe"]["exec"]["command"]
            result = podman("exec", f"pdserve-{pool}-pod-0-{pool}", *probe, check=False)
            assert result.returncode == 0, result.stderr  # the node's readiness, for real

        # Scaling the decode pool: one more pod of the same template (its own address).
        start = time.monotonic()
        play(more, podman_pods(objects, {**first, **scaled})[-1:])

        def decode_nodes() -> set[str]:
            nodes = http_json(url + "/health")[1].get("nodes", [])
            return {n["id"] for n in nodes if n["role"] == "decode" and n["healthy"]}

        wait_until(lambda: len(decode_nodes()) == 2, 600, "scaled decode node registered",
                   lambda: pod_logs(names))  # fmt: skip
        print(f"scaled decode pod registered after {time.monotonic() - start:.0f} s")
        assert decode_nodes() == {"tcp://127.0.0.4:5701", "tcp://127.0.0.5:5701"}
        assert chat(url)["usage"]["completion_tokens"] > 0
    finally:
        for path in (more, stack):
            if path.exists():
                podman("kube", "down", str(path), check=False, timeout=300)
        podman("secret", "rm", "pdserve-cluster", check=False)
    pods = podman("pod", "ps", "--format", "{{.Name}}").stdout.split()
    containers = podman("ps", "-a", "--format", "{{.Names}}").stdout.split()
    volumes = podman("volume", "ls", "--format", "{{.Name}}").stdout.split()
    left = [n for n in pods + containers + volumes if n.startswith(tuple(names))]
    assert not left, f"left after podman kube down: {left}"
