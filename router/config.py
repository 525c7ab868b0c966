"""Router configuration: one frozen dataclass; the CLI flags are derived from its fields."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


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
        metadata={"help": "comma-separated control addresses of prefill nodes; empty = colocated"},
    )
    decode: tuple[str, ...] = field(
        default=(),
        metadata={"help": "comma-separated control addresses of decode (or colocated) nodes"},
    )
    events_address: str = field(
        default="tcp://127.0.0.1:5600",
        metadata={"help": "address the router binds to receive tokens and heartbeats"},
    )
    heartbeat_timeout: float = field(
        default=3.0, metadata={"help": "seconds without a heartbeat before a node is dead"}
    )
    request_timeout: float = field(
        default=600.0, metadata={"help": "seconds from arrival before a request is aborted"}
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
        if not self.decode:
            raise ValueError(
                "at least one --decode node is needed (colocated nodes if no --prefill)"
            )
        nodes = [*self.prefill, *self.decode]
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"node addresses must be distinct, got {nodes}")
        if self.stats_interval < 0:
            raise ValueError(f"stats_interval must be >= 0, got {self.stats_interval}")
        if self.heartbeat_timeout <= 0 or self.request_timeout <= 0:
            raise ValueError(
                f"timeouts must be > 0, got heartbeat_timeout={self.heartbeat_timeout}, "
                f"request_timeout={self.request_timeout}"
            )

    @property
    def colocated(self) -> bool:
        """No prefill pool: every --decode node prefills its own requests."""
        return not self.prefill


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
        shown_help = argparse.SUPPRESS if hidden else help_text
        if hints[f.name] is bool:
            parser.add_argument(
                flag,
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=value,
                help=shown_help,
            )
            continue
        parser.add_argument(
            flag,
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
    return RouterConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RouterConfig)})
