"""Router configuration: one frozen dataclass; the CLI flags are derived from its fields."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from common import envs
from router.policy import POLICIES, PolicyConfig

MODES = ("auto", "pd", "colocated")


@dataclass(frozen=True)
class RouterConfig:
    model: str | None = field(
        default=None,
        metadata={"help": "HF directory or .gguf file for the tokenizer; none = embedded SmolLM2"},
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "model name in the API (default: the model's own name)"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP bind address"})
    port: int = field(default=8000, metadata={"help": "HTTP port"})
    prefill: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "comma-separated control addresses of prefill nodes known at start (more "
            "may register later through their heartbeats)"
        },
    )
    decode: tuple[str, ...] = field(
        default=(),
        metadata={"help": "comma-separated control addresses of decode (or colocated) nodes"},
    )
    mode: str = field(
        default="auto",
        metadata={
            "help": "pd, colocated, or auto: colocated when --decode is given without "
            "--prefill, else pd"
        },
    )
    events_address: str = field(
        default="tcp://127.0.0.1:5600",
        metadata={"help": "address the router binds to receive tokens and heartbeats"},
    )
    heartbeat_timeout: float = field(
        default=3.0, metadata={"help": "seconds without a heartbeat before a node is dead"}
    )
    forget_node_after_s: float = field(
        default=60.0,
        metadata={"help": "a dead node not given on the command line is forgotten after this"},
    )
    request_timeout_s: float = field(
        default=600.0,
        metadata={
            "help": "seconds from arrival before a request is ended with an error and aborted "
            "on its nodes",
            "aliases": ("--request-timeout",),
        },
    )
    max_waiting_requests: int = field(
        default=1024,
        metadata={
            "help": "requests per pool that may wait for it (prefill: before their first "
            "token; decode: before their first decoded token); past it, 429 (0: no bound)"
        },
    )
    retry_after_s: int = field(
        default=1, metadata={"help": "Retry-After header (seconds) of a 429"}
    )
    prefill_policy: str = field(
        default="least_load",
        metadata={"help": "round_robin, least_load or cache_aware (router/policy.py)"},
    )
    decode_policy: str = field(default="least_load", metadata={"help": "round_robin or least_load"})
    cache_aware_block_tokens: int = field(
        default=16, metadata={"help": "cache_aware: tokens per prefix-tree edge"}
    )
    cache_aware_min_match: float = field(
        default=0.25,
        metadata={"help": "cache_aware: shorter matches (fraction of the prompt) go by load"},
    )
    cache_aware_balance_abs_tokens: int = field(
        default=4096,
        metadata={"help": "cache_aware: queued-token gap past which the pool is out of balance"},
    )
    cache_aware_balance_rel: float = field(
        default=1.5,
        metadata={"help": "cache_aware: ... and the load ratio past which it is"},
    )
    cache_aware_max_tree_blocks: int = field(
        default=1 << 20,
        metadata={"help": "cache_aware: blocks per node's prefix tree (also capped by its pool)"},
    )
    api_key: str | None = field(
        default=None,
        metadata={
            "help": "require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize "
            "(default: $PDSERVE_API_KEY; "
            "none = open)"
        },
    )
    auth_all_endpoints: bool = field(
        default=False, metadata={"help": "with --api-key, also protect /health and /metrics"}
    )
    allowed_origins: tuple[str, ...] = field(
        default=(), metadata={"help": "CORS: comma-separated origins, '*' for any (none: off)"}
    )
    allowed_methods: tuple[str, ...] = field(
        default=("GET", "POST", "OPTIONS"), metadata={"help": "CORS: allowed methods"}
    )
    allowed_headers: tuple[str, ...] = field(
        default=("Authorization", "Content-Type"), metadata={"help": "CORS: allowed headers"}
    )
    allow_credentials: bool = field(default=False, metadata={"help": "CORS: allow credentials"})
    max_request_body_bytes: int = field(
        default=16 << 20, metadata={"help": "larger request bodies get a 413"}
    )
    log_level: str = field(
        default="info",
        metadata={"help": "router log level", "choices": ("debug", "info", "warning", "error")},
    )
    tool_call_parser: str = field(
        default="auto",
        metadata={
            "help": "how tool calls are read from the model's text: hermes (<tool_call> blocks: "
            "Hermes, Qwen2.5, Qwen3), llama3_json (Llama 3.1 JSON calls), auto (from the chat "
            "template)",
            "choices": ("auto", "hermes", "llama3_json"),
        },
    )
    access_log: bool = field(
        default=False, metadata={"help": "log one line per HTTP request (uvicorn access log)"}
    )
    stats_interval: float = field(
        default=10.0,
        metadata={
            "help": "seconds between stats lines (throughput, running/waiting, KV use, prefix "
            "hit rate) while there is traffic; 0 turns them off"
        },
    )

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "colocated" and self.prefill:
            raise ValueError(f"colocated mode takes no prefill nodes, got {self.prefill}")
        nodes = [*self.prefill, *self.decode]
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"node addresses must be distinct, got {nodes}")
        if self.stats_interval < 0:
            raise ValueError(f"stats_interval must be >= 0, got {self.stats_interval}")
        if self.heartbeat_timeout <= 0 or self.request_timeout_s <= 0:
            raise ValueError(
                f"timeouts must be > 0, got heartbeat_timeout={self.heartbeat_timeout}, "
                f"request_timeout_s={self.request_timeout_s}"
            )
        if self.max_waiting_requests < 0 or self.retry_after_s < 0:
            raise ValueError(
                f"max_waiting_requests and retry_after_s must be >= 0, got "
                f"{self.max_waiting_requests}, {self.retry_after_s}"
            )
        if self.max_request_body_bytes < 1:
            raise ValueError(
                f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}"
            )
        if self.decode_policy == "cache_aware":
            raise ValueError("cache_aware routes prefill requests only; decode nodes receive KV")
        for name in (self.prefill_policy, self.decode_policy):
            if name not in POLICIES:
                raise ValueError(f"unknown routing policy {name!r}; choose from {sorted(POLICIES)}")
        self.policy_config()  # validates the cache_aware knobs

    @property
    def colocated(self) -> bool:
        """No prefill pool: every decode-pool node prefills its own requests."""
        if self.mode == "auto":
            return bool(self.decode) and not self.prefill
        return self.mode == "colocated"

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig(
            block_tokens=self.cache_aware_block_tokens,
            min_match_ratio=self.cache_aware_min_match,
            balance_abs_tokens=self.cache_aware_balance_abs_tokens,
            balance_rel=self.cache_aware_balance_rel,
            max_tree_blocks=self.cache_aware_max_tree_blocks,
        )

    def with_env(self) -> RouterConfig:
        """The config with unset options filled from the environment (PDSERVE_API_KEY)."""
        if self.api_key is None and envs.api_key() is not None:
            return dataclasses.replace(self, api_key=envs.api_key())
        return self


def _address_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _optional_str(text: str) -> str | None:
    return None if text.strip().lower() in ("", "none") else text


def _flag_type(hint: Any) -> typing.Callable[[str], Any]:
    if hint == tuple[str, ...]:
        return _address_list
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _optional_str if args == [str] else args[0]
    return hint


def add_router_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    fields: Sequence[dataclasses.Field] | None = None,
    prefix: str = "",
    dest_prefix: str = "",
    default: Any = dataclasses.MISSING,
    hidden: bool = False,
) -> None:
    """One flag per RouterConfig field (or the given subset); `default` overrides every
    field's default (the pdserve launcher passes None to know which flags were given)."""
    hints = typing.get_type_hints(RouterConfig)
    for f in fields if fields is not None else dataclasses.fields(RouterConfig):
        value = f.default if default is dataclasses.MISSING else default
        help_text = f.metadata.get("help", "")
        if f.default is not None and "default" not in help_text:
            shown = ",".join(f.default) if isinstance(f.default, tuple) else f.default
            help_text += f" (default: {shown if shown not in ('', ()) else 'none'})"
        flag, dest = "--" + prefix + f.name.replace("_", "-"), dest_prefix + f.name
        aliases = ["--" + prefix + a.removeprefix("--") for a in f.metadata.get("aliases", ())]
        shown_help = argparse.SUPPRESS if hidden else help_text
        if hints[f.name] is bool:
            parser.add_argument(
                flag,
                *aliases,
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=value,
                help=shown_help,
            )
            continue
        parser.add_argument(
            flag,
            *aliases,
            dest=dest,
            type=_flag_type(hints[f.name]),
            default=value,
            choices=f.metadata.get("choices"),
            metavar=None if f.metadata.get("choices") else f.name.upper(),
            help=shown_help,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m router", description="OpenAI-compatible front end of pdserve"
    )
    add_router_args(parser)
    return parser


def config_from_args(argv: Sequence[str] | None = None) -> RouterConfig:
    args = build_parser().parse_args(argv)
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(RouterConfig)}
    return RouterConfig(**fields).with_env()
