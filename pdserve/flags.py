"""Every flag of `pdserve serve`, derived from the config dataclasses, and the configs built
from them. Nothing here imports torch, so `--help` and flag errors are instant.

Three groups: the launcher's own flags (`LaunchConfig`); engine and node flags (the fields of
`EngineConfig` and `NodeConfig`), which apply to both pools, with hidden `--prefill-X` /
`--decode-X` forms that set one pool only (they win over `--X`); and the router's flags
(`RouterConfig`), also accepted as `--router-X`. Addresses are the launcher's business and
have no flag. Every flag defaults to None here so that only the flags a user gave override
the dataclass defaults, which stay in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from common.engine.config import _SUBCONFIGS, EngineConfig, _scalar_type
from common.node.config import NodeConfig
from router.config import RouterConfig, add_router_args

POOLS = ("prefill", "decode")
FIXED_ZMQ_BASE_PORT = 5600  # --zmq-base-port when other hosts must find the router's events
SHOWN_PER_POOL = {
    "tp",
    "pp",
    "pp_layer_partition",
    "enable_expert_parallel",
}  # --prefill-tp etc. are listed in --help
NODE_ONLY = {"control_address", "router_address", "kv_address", "colocated", "model"}
ROUTER_ONLY = {
    "model", "served_model_name", "host", "port", "prefill", "decode", "events_address", "mode",
}  # fmt: skip


def _gpu_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated GPU ids, got {text!r}"
        ) from None


@dataclass(frozen=True)
class LaunchConfig:
    model: str | None = field(
        default=None,
        metadata={"help": "HF directory, hub id (org/name) in the HF cache, or .gguf file; "
                  "none = the embedded SmolLM2-135M-Instruct"},
    )  # fmt: skip
    served_model_name: str | None = field(
        default=None, metadata={"help": "model name in the API (default: the model's name)"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "router HTTP address"})
    port: int = field(default=8000, metadata={"help": "router HTTP port"})
    num_prefill: int = field(
        default=1, metadata={"help": "prefill processes on this host (0: none here)"}
    )
    num_decode: int = field(
        default=1, metadata={"help": "decode processes on this host (0: none here)"}
    )
    colocated: bool = field(
        default=False, metadata={"help": "no prefill pool: each decode node prefills (baseline)"}
    )
    prefill_gpus: tuple[int, ...] = field(
        default=(), metadata={"help": "GPU ids of the prefill pool (node i gets entry i mod n)"}
    )
    decode_gpus: tuple[int, ...] = field(
        default=(), metadata={"help": "GPU ids of the decode pool (node i gets entry i mod n)"}
    )
    zmq_base_port: int | None = field(
        default=None,
        metadata={"help": "internal ZMQ ports: router events = base, prefill i = base+1+i, "
                  "decode j = base+101+j, its KV = base+201+j; unset: free ports chosen at "
                  f"start on a loopback --bind-host (several stacks on one host need nothing "
                  f"more); {FIXED_ZMQ_BASE_PORT} with another --bind-host or --router-url, so "
                  "that hosts joining the router know its events port"},
    )  # fmt: skip
    health_timeout: float = field(
        default=600.0, metadata={"help": "seconds to wait for every node to be healthy"}
    )
    bind_host: str = field(
        default="127.0.0.1",
        metadata={"help": "address this host's nodes (and the router's events socket) bind to "
                  "and announce; other hosts must reach it; beyond loopback it needs "
                  "PDSERVE_CLUSTER_SECRET"},
    )  # fmt: skip
    router_url: str | None = field(
        default=None,
        metadata={"help": "start no router: this host's nodes join the one at this URL (its "
                  "events socket: the URL's host at --zmq-base-port, as on its own host)"},
    )  # fmt: skip
    restart_nodes: bool = field(
        default=False,
        metadata={"help": "start a node again (same flags and addresses) whenever it exits; "
                  "it rejoins with its first heartbeat"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if min(self.num_prefill, self.num_decode) < 0 or self.prefill_count + self.num_decode < 1:
            raise ValueError(
                f"need at least one node on this host, got num_prefill={self.num_prefill}, "
                f"num_decode={self.num_decode}, colocated={self.colocated}"
            )
        if self.router_url is not None and not urlsplit(self.router_url).hostname:
            raise ValueError(f"router_url must be like http://HOST:PORT, got {self.router_url!r}")
        base = self.zmq_base_port
        if not 0 < self.port < 65536 or (base is not None and not 0 < base < 65536 - 300):
            raise ValueError(f"bad ports: port={self.port}, zmq_base_port={base}")
        if self.health_timeout <= 0:
            raise ValueError(f"health_timeout must be > 0, got {self.health_timeout}")

    @property
    def prefill_count(self) -> int:
        return 0 if self.colocated else self.num_prefill


def engine_fields() -> list[tuple[dataclasses.Field, Any]]:
    """(field, type hint) of every engine and node flag, in --help order."""
    out = []
    for cls in (*_SUBCONFIGS.values(), EngineConfig, NodeConfig):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in NODE_ONLY or (cls is EngineConfig and f.name in _SUBCONFIGS):
                continue
            out.append((f, hints[f.name]))
    return out


def router_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(RouterConfig) if f.name not in ROUTER_ONLY]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="prefill/decode LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        allow_abbrev=False,  # a misspelt flag is an error, never a guess
        help="start the router and the prefill and decode pools",
        description="Start the router and the prefill and decode pools on this host; Ctrl-C "
        "or SIGTERM stops every process.",
    )
    serve.add_argument("model_arg", nargs="?", metavar="MODEL", help="same as --model")
    launch = serve.add_argument_group("launcher")
    hints = typing.get_type_hints(LaunchConfig)
    for f in dataclasses.fields(LaunchConfig):
        _add(launch, "--" + f.name.replace("_", "-"), f.name, hints[f.name], f, hidden=False)
    add_engine_flags(serve)
    parser.set_defaults(serve_parser=serve)  # cli.main reports config errors through it
    router = serve.add_argument_group("router flags", "Also accepted as --router-X.")
    add_router_args(router, router_fields(), dest_prefix="router__", default=None)
    add_router_args(
        router, router_fields(), prefix="router-", dest_prefix="router__", default=None, hidden=True
    )
    _add_plan_parser(commands)
    return parser


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group(
        "engine and node flags",
        "Each applies to both pools; --prefill-X / --decode-X set it for one pool only (e.g. "
        "--decode-max-num-seqs 64, --prefill-no-enable-prefix-caching).",
    )
    for f, hint in engine_fields():
        name = f.name.replace("_", "-")
        _add(engine, f"--{name}", f"all__{f.name}", hint, f, hidden=False)
        for pool in POOLS:
            hidden = f.name not in SHOWN_PER_POOL
            _add(engine, f"--{pool}-{name}", f"{pool}__{f.name}", hint, f, hidden=hidden)


def _add_plan_parser(commands: Any) -> None:
    from pdserve.planner.config import add_plan_args

    plan = commands.add_parser(
        "plan",
        allow_abbrev=False,
        help="profile the engine, simulate layouts and recommend a launch command",
        description="Profile the engine on one device (cached), simulate every prefill/decode "
        "layout and the colocated baseline on --devices devices for a workload and SLOs, print "
        "them ranked with the `pdserve serve` command of the best; --validate K launches the "
        "top K and measures them.",
    )
    plan.add_argument("model_arg", nargs="?", metavar="MODEL", help="same as --model")
    plan.add_argument("--model", dest="model", default=None, help="as for pdserve serve")
    add_engine_flags(plan)
    add_plan_args(plan.add_argument_group("planner flags"))
    plan.set_defaults(plan_parser=plan)


def _add(
    group: Any, flag: str, dest: str, hint: Any, f: dataclasses.Field, *, hidden: bool
) -> None:
    help_text = argparse.SUPPRESS if hidden else _help(f)
    kind = _scalar_type(hint)
    # An old name (`--kv-memory-fraction`, `--decode-kv-memory-fraction`) sets the same value.
    prefix = flag[: len(flag) - len(f.name)]
    aliases = [prefix + a.replace("_", "-") for a in f.metadata.get("aliases", ())]
    if kind is bool:
        assert not aliases, flag  # not needed yet
        negative = "--no-" + flag[2:]
        if flag.startswith(("--prefill-", "--decode-")):  # --prefill-no-X, as launch_pd.sh had
            pool, rest = flag[2:].split("-", 1)
            negative = f"--{pool}-no-{rest}"
        group.add_argument(flag, dest=dest, action="store_const", const=True, help=help_text)
        group.add_argument(
            negative, dest=dest, action="store_const", const=False, help=argparse.SUPPRESS
        )
        return
    if hint == tuple[int, ...]:
        kind = _gpu_list
    group.add_argument(
        flag,
        *aliases,
        dest=dest,
        type=kind,
        choices=f.metadata.get("choices"),
        metavar=None if f.metadata.get("choices") else f.name.upper(),
        help=help_text,
    )


def _help(f: dataclasses.Field) -> str:
    text = f.metadata.get("help", "")
    default = f.default if f.default is not dataclasses.MISSING else None
    if isinstance(default, bool):
        return f"{text} (default: on; --no-X turns it off)" if default else f"{text} (default: off)"
    shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
    return f"{text} (default: {shown if shown not in (None, '') else 'none'})"
