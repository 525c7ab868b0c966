"""From parsed `pdserve serve` flags to validated configs, then to the processes to start.

`configs_from_args` builds every config the flags describe, so a bad value fails (ValueError
with the offending value) before any process starts. `plan` then lays the processes out: the
internal ports (`pdserve/ports.py`), the GPU of each node and its memory fraction, and each
process's command line, which holds only the values that differ from the dataclass defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from common.engine.config import CacheConfig, EngineConfig
from common.node.config import NodeConfig
from common.protocol.wire_auth import require_secret_for
from pdserve.flags import FIXED_ZMQ_BASE_PORT, POOLS, LaunchConfig, engine_fields, router_fields
from pdserve.ports import Ports, internal_ports
from router.config import RouterConfig

NODE_FIELDS = {f.name for f in dataclasses.fields(NodeConfig)}


@dataclass(frozen=True)
class Configs:
    launch: LaunchConfig
    engines: dict[str, EngineConfig]  # by pool: "prefill", "decode"
    nodes: dict[str, NodeConfig]
    router: dict[str, Any]  # RouterConfig fields the user set (addresses come from the plan)
    given: dict[str, frozenset[str]]  # by pool: the engine and node options the user set


@dataclass(frozen=True)
class NodeProcess:
    name: str  # prefill-0, decode-1, ...
    role: str  # prefill | decode | colocated
    address: str  # control address, the node's id in /health
    argv: list[str]
    ranks: int = 1  # tp x pp ranks: the node starts ranks - 1 processes of its own
    gpu_memory_fraction: float | None = None  # None: its KV is not sized by a GPU share


@dataclass(frozen=True)
class Plan:
    configs: Configs
    model_name: str
    nodes: list[NodeProcess]
    router_argv: list[str] | None  # None: the nodes join a router on another host
    url: str  # the router's HTTP address
    ports: Ports


def configs_from_args(args: argparse.Namespace) -> Configs:
    """Every config the flags describe; ValueError names the bad value."""
    launch_values = {f.name: getattr(args, f.name) for f in dataclasses.fields(LaunchConfig)}
    if args.model_arg is not None:
        if launch_values["model"] not in (None, args.model_arg):
            raise ValueError(f"two models given: {args.model_arg!r} and {launch_values['model']!r}")
        launch_values["model"] = args.model_arg
    launch = LaunchConfig(**{k: v for k, v in launch_values.items() if v is not None})
    engines, nodes, given_by_pool = {}, {}, {}
    for pool, given in pool_options(args).items():
        given_by_pool[pool] = frozenset(given)
        node = {k: v for k, v in given.items() if k in NODE_FIELDS}
        nodes[pool] = NodeConfig(**node, colocated=launch.colocated and pool == "decode")
        engine = {k: v for k, v in given.items() if k not in NODE_FIELDS}
        engines[pool] = EngineConfig.from_options(model=launch.model, **engine)
    router = {f.name: getattr(args, f"router__{f.name}") for f in router_fields()}
    router = {k: v for k, v in router.items() if v is not None}
    RouterConfig(decode=("check",), **router)  # validates the values the user gave
    require_secret_for([f"tcp://{launch.bind_host}:{launch.zmq_base_port or FIXED_ZMQ_BASE_PORT}"])
    return Configs(launch, engines, nodes, router, given_by_pool)


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
    when the pools need more GPUs than they are given, or the memory fractions of the nodes on
    one GPU sum past 1."""
    launch, host = configs.launch, configs.launch.bind_host
    ports = internal_ports(launch)
    router_host = urlsplit(launch.router_url).hostname if launch.router_url else host
    events = f"tcp://{router_host}:{ports.events}"
    by_pool = pool_gpus(configs, gpus)
    tp = {pool: configs.engines[pool].world_size for pool in POOLS}  # ranks per node
    count = {"prefill": launch.prefill_count, "decode": launch.num_decode}
    slots = [Slot(pool, i, _gpus(by_pool[pool], i, tp[pool]), tp[pool] if gpus else 0)
             for pool in POOLS for i in range(count[pool])]  # fmt: skip
    fractions = memory_fractions(configs, slots)
    nodes = []
    for slot in slots:
        pool, index = slot.pool, slot.index
        if pool == "prefill":
            address = f"tcp://{host}:{ports.prefill[index]}"
            node = dataclasses.replace(
                configs.nodes[pool], control_address=address, router_address=events
            )
        else:
            address = f"tcp://{host}:{ports.decode[index]}"
            node = dataclasses.replace(
                configs.nodes[pool],
                control_address=address,
                router_address=events,
                kv_address=f"tcp://{host}:{ports.kv[index]}",
            )
        engine, fraction = configs.engines[pool], fractions[slot.name]
        if fraction is not None:
            cache = dataclasses.replace(engine.cache, gpu_memory_fraction=fraction)
            engine = dataclasses.replace(engine, cache=cache)
        argv = _node_argv(f"{pool}_node", engine, node, model_dir, slot.pinned, gpus)
        role = "colocated" if launch.colocated and pool == "decode" else pool
        nodes.append(NodeProcess(slot.name, role, address, argv, tp[pool], fraction))
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
    name = router.served_model_name
    if launch.router_url:
        return Plan(configs, name, nodes, None, launch.router_url.rstrip("/"), ports)
    router_argv = [sys.executable, "-m", "router", *_flags(router)]
    return Plan(configs, name, nodes, router_argv, f"http://{launch.host}:{launch.port}", ports)


@dataclass(frozen=True)
class Slot:
    """A node of this host before its command line."""

    pool: str
    index: int  # in its pool
    pinned: tuple[int, ...]  # GPU per rank, --device cuda:A,B; () unpinned
    ranks_on_gpus: int  # 0 on CPU

    @property
    def name(self) -> str:
        return f"{self.pool}-{self.index}"

    @property
    def gpus(self) -> tuple[int, ...]:
        """The GPUs its ranks run on: an unpinned node (`--device cuda`) takes 0..ranks-1."""
        return self.pinned or tuple(range(self.ranks_on_gpus))


def memory_fractions(configs: Configs, slots: list[Slot]) -> dict[str, float | None]:
    """Each node's `--gpu-memory-fraction`, by name: its pool's when the user set it, else the
    default shared evenly by the processes (tensor-parallel ranks included) on the node's most
    crowded GPU, so that a prefill and a decode node on one GPU get 0.425 each. None for a node
    whose KV is not sized by it (CPU, an explicit --device, --num-kv-blocks,
    --kv-cache-memory-bytes). ValueError when the fractions on one GPU sum past 1."""
    crowd: dict[int, int] = {}
    for slot in slots:
        for gpu in slot.gpus:
            crowd[gpu] = crowd.get(gpu, 0) + 1
    default = CacheConfig().gpu_memory_fraction
    fractions: dict[str, float | None] = {}
    on_gpu: dict[int, list[tuple[str, float]]] = {}
    for slot in slots:
        engine = configs.engines[slot.pool]
        cache = engine.cache
        sized_otherwise = cache.num_kv_blocks or cache.kv_cache_memory_bytes
        if not slot.gpus or engine.model.device != "auto" or sized_otherwise:
            fractions[slot.name] = None
            continue
        fraction = cache.gpu_memory_fraction
        if "gpu_memory_fraction" not in configs.given[slot.pool]:
            fraction = math.floor(1000 * default / max(crowd[g] for g in slot.gpus)) / 1000
        fractions[slot.name] = fraction
        for gpu in slot.gpus:
            on_gpu.setdefault(gpu, []).append((slot.name, fraction))
    for gpu, shares in on_gpu.items():
        total = sum(f for _, f in shares)
        if total > 1 + 1e-9:
            listed = ", ".join(f"{name} {f:g}" for name, f in shares)
            raise ValueError(
                f"GPU {gpu} would hold {listed}: their --gpu-memory-fraction values sum to "
                f"{total:g}, more than the whole GPU"
            )
    return fractions


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
