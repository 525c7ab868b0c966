"""From parsed `pdserve serve` flags to validated configs, then to the processes to start.

`configs_from_args` builds every config the flags describe, so a bad value fails (ValueError
with the offending value) before any process starts. `plan` then lays the processes out: the
ports of `--zmq-base-port`, the GPU of each node, and each process's command line, which holds
only the values that differ from the dataclass defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from common.engine.config import EngineConfig
from common.node.config import NodeConfig
from common.protocol.wire_auth import require_secret_for
from pdserve.flags import POOLS, LaunchConfig, engine_fields, router_fields
from router.config import RouterConfig

NODE_FIELDS = {f.name for f in dataclasses.fields(NodeConfig)}


@dataclass(frozen=True)
class Configs:
    launch: LaunchConfig
    engines: dict[str, EngineConfig]  # by pool: "prefill", "decode"
    nodes: dict[str, NodeConfig]
    router: dict[str, Any]  # RouterConfig fields the user set (addresses come from the plan)


@dataclass(frozen=True)
class NodeProcess:
    name: str  # prefill-0, decode-1, ...
    role: str  # prefill | decode | colocated
    address: str  # control address, the node's id in /health
    argv: list[str]
    ranks: int = 1  # tp x pp ranks: the node starts ranks - 1 processes of its own


@dataclass(frozen=True)
class Plan:
    configs: Configs
    model_name: str
    nodes: list[NodeProcess]
    router_argv: list[str] | None  # None: the nodes join a router on another host
    url: str  # the router's HTTP address


def configs_from_args(args: argparse.Namespace) -> Configs:
    """Every config the flags describe; ValueError names the bad value."""
    launch_values = {f.name: getattr(args, f.name) for f in dataclasses.fields(LaunchConfig)}
    if args.model_arg is not None:
        if launch_values["model"] not in (None, args.model_arg):
            raise ValueError(f"two models given: {args.model_arg!r} and {launch_values['model']!r}")
        launch_values["model"] = args.model_arg
    launch = LaunchConfig(**{k: v for k, v in launch_values.items() if v is not None})
    engines, nodes = {}, {}
    for pool, given in pool_options(args).items():
        node = {k: v for k, v in given.items() if k in NODE_FIELDS}
        nodes[pool] = NodeConfig(**node, colocated=launch.colocated and pool == "decode")
        engine = {k: v for k, v in given.items() if k not in NODE_FIELDS}
        engines[pool] = EngineConfig.from_options(model=launch.model, **engine)
    router = {f.name: getattr(args, f"router__{f.name}") for f in router_fields()}
    router = {k: v for k, v in router.items() if v is not None}
    RouterConfig(decode=("check",), **router)  # validates the values the user gave
    require_secret_for([f"tcp://{launch.bind_host}:{launch.zmq_base_port}"])
    return Configs(launch, engines, nodes, router)


def pool_options(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Per pool, the engine and node flags the user gave (`--prefill-X` wins over `--X`)."""
    out = {}
    for pool in POOLS:
        options = {}
        for f, _ in engine_fields():
            value = getattr(args, f"{pool}__{f.name}")
            options[f.name] = value if value is not None else getattr(args, f"all__{f.name}")
        out[pool] = {k: v for k, v in options.items() if v is not None}
    return out


def serving_dtype(engine: EngineConfig, gpu_count: int) -> str:
    """The dtype a pool computes in: what `Worker` picks for `--dtype auto`."""
    if engine.model.dtype != "auto":
        return engine.model.dtype
    on_gpu = engine.model.device.startswith("cuda") or (
        engine.model.device == "auto" and gpu_count > 0
    )
    return "bfloat16" if on_gpu else "float32"


def gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def pool_gpus(configs: Configs, gpus: int) -> dict[str, tuple[int, ...]]:
    """GPU ids of each pool. A node of `--X-tp T --X-pp P` takes N = T * P consecutive entries
    of its pool's list, so a pool of `count` nodes needs N * count entries (ValueError
    otherwise). Default
    (no lists, GPUs present): prefill on the first GPUs, decode on the next ones; with one
    rank per node they are shared round-robin when too few, with several ranks never."""
    launch = configs.launch
    tp = {pool: configs.engines[pool].world_size for pool in POOLS}  # ranks per node
    count = {"prefill": launch.prefill_count, "decode": launch.num_decode}
    given = {"prefill": launch.prefill_gpus, "decode": launch.decode_gpus}
    if gpus and not any(given.values()):
        need = {pool: tp[pool] * count[pool] for pool in POOLS}
        if max(tp.values()) > 1 and sum(need.values()) > gpus:
            raise ValueError(
                f"{need['prefill']} prefill + {need['decode']} decode GPUs needed "
                f"({_ranks(configs, 'prefill')} x {count['prefill']} nodes, "
                f"{_ranks(configs, 'decode')} x {count['decode']} nodes), {gpus} present"
            )
        first = need["prefill"]
        return {
            "prefill": tuple(range(first)),
            "decode": tuple((first + j) % gpus for j in range(need["decode"])),
        }
    for pool in POOLS:
        if given[pool] and tp[pool] > 1 and len(given[pool]) < tp[pool] * count[pool]:
            raise ValueError(
                f"--{pool}-gpus {','.join(map(str, given[pool]))} names {len(given[pool])} "
                f"GPUs; {count[pool]} {pool} node(s) of {_ranks(configs, pool)} need "
                f"{tp[pool] * count[pool]}"
            )
    return given


def plan(configs: Configs, model_dir: str, model_name: str, gpus: int) -> Plan:
    """Every socket binds to `--bind-host` (loopback by default); with `--router-url` no router
    is started and the nodes heartbeat to its events socket on the router's host. ValueError
    when the pools need more GPUs than they are given."""
    launch = configs.launch
    base, host = launch.zmq_base_port, launch.bind_host
    router_host = urlsplit(launch.router_url).hostname if launch.router_url else host
    events = f"tcp://{router_host}:{base}"
    by_pool = pool_gpus(configs, gpus)
    prefill_gpus, decode_gpus = by_pool["prefill"], by_pool["decode"]
    tp_prefill = configs.engines["prefill"].world_size  # processes (GPUs) per node
    tp_decode = configs.engines["decode"].world_size
    nodes = []
    for i in range(launch.prefill_count):
        address = f"tcp://{host}:{base + 1 + i}"
        node = dataclasses.replace(
            configs.nodes["prefill"], control_address=address, router_address=events
        )
        argv = _node_argv("prefill_node", configs.engines["prefill"], node, model_dir,
                          _gpus(prefill_gpus, i, tp_prefill), gpus)  # fmt: skip
        nodes.append(NodeProcess(f"prefill-{i}", "prefill", address, argv, tp_prefill))
    for j in range(launch.num_decode):
        address = f"tcp://{host}:{base + 101 + j}"
        node = dataclasses.replace(
            configs.nodes["decode"],
            control_address=address,
            router_address=events,
            kv_address=f"tcp://{host}:{base + 201 + j}",
        )
        argv = _node_argv("decode_node", configs.engines["decode"], node, model_dir,
                          _gpus(decode_gpus, j, tp_decode), gpus)  # fmt: skip
        role = "colocated" if launch.colocated else "decode"
        nodes.append(NodeProcess(f"decode-{j}", role, address, argv, tp_decode))
    router = RouterConfig(
        model=model_dir,
        served_model_name=launch.served_model_name or model_name,
        host=launch.host,
        port=launch.port,
        prefill=tuple(n.address for n in nodes if n.role == "prefill"),
        decode=tuple(n.address for n in nodes if n.role != "prefill"),
        mode="colocated" if launch.colocated else "pd",  # a pool may be on other hosts only
        events_address=events,
        **configs.router,
    )
    if launch.router_url:
        return Plan(configs, router.served_model_name, nodes, None, launch.router_url.rstrip("/"))
    router_argv = [sys.executable, "-m", "router", *_flags(router)]
    url = f"http://{launch.host}:{launch.port}"
    return Plan(configs, router.served_model_name, nodes, router_argv, url)


def _ranks(configs: Configs, pool: str) -> str:
    engine = configs.engines[pool]
    return f"--{pool}-tp {engine.tp} x --{pool}-pp {engine.pp}"


def _gpus(gpus: tuple[int, ...], i: int, tp: int) -> tuple[int, ...]:
    """Node i's GPUs, one per rank (entry i mod n of the list with one rank per node)."""
    if not gpus:
        return ()
    if tp == 1:
        return (gpus[i % len(gpus)],)
    return gpus[i * tp : (i + 1) * tp]


def _node_argv(
    module: str,
    engine: EngineConfig,
    node: NodeConfig,
    model_dir: str,
    node_gpus: tuple[int, ...],
    gpus: int,
) -> list[str]:
    options = engine.flat_options()
    options["model"] = model_dir
    if options["device"] == "auto":
        # Every process sees every GPU and is pinned with --device cuda:N (cuda:A,B,... one
        # per tensor-parallel rank), so that a prefill node can open a decode node's KV pool
        # through CUDA IPC.
        if node_gpus:
            options["device"] = "cuda:" + ",".join(map(str, node_gpus))
        else:
            options["device"] = "cuda" if gpus else "cpu"
    defaults = EngineConfig().flat_options()
    argv = [sys.executable, "-m", module]
    for name, value in options.items():
        if value != defaults[name] or name in ("model", "device"):
            argv += _flag(name, value)
    return argv + _flags(node)


def _flags(config: Any) -> list[str]:
    """Flags for the fields of `config` that differ from their defaults."""
    out = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value != f.default:
            out += _flag(f.name, value)
    return out


def _flag(name: str, value: Any) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag] if value else ["--no-" + flag[2:]]
    if value is None:
        return []
    if isinstance(value, tuple):
        return [flag, ",".join(map(str, value))]
    return [flag, str(value)]
