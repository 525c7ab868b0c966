"""`pdserve serve [MODEL] [flags]`: parse and validate every flag, resolve the model once (a
hub id from the local Hugging Face cache, a GGUF converted to the serving dtype), then launch.

Errors in flags or in the model name end with one line and exit code 2 before any process
starts; `pdserve serve --help` lists every launcher, engine/node and router flag.
`pdserve plan [MODEL] [flags]` recommends a layout and its flags (`pdserve/planner/`).
`pdserve router|prefill|decode [flags]` is one process of that role, exactly `python -m router`,
`prefill_node` or `decode_node` (what a container of one role runs; `--help` lists its flags).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from common.engine.config import EngineConfig
from pdserve.flags import build_parser

USAGE_ERROR = 2
ROLE_MODULES = {"router": "router", "prefill": "prefill_node", "decode": "decode_node"}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ROLE_MODULES:
        run_role(argv[0], argv[1:])
    parser = build_parser()
    parser.epilog = "pdserve router|prefill|decode [flags]: one process of that role"
    args = parser.parse_args(argv)
    if args.command == "plan":
        return plan_command(args)
    from pdserve.plan import configs_from_args, gpu_count, plan, serving_dtype

    try:
        configs = configs_from_args(args)
    except ValueError as exc:
        args.serve_parser.error(str(exc))
    gpus = gpu_count()
    dtype = serving_dtype(configs.engines["decode"], gpus)
    from common.model.source import resolve_model

    try:
        source = resolve_model(configs.launch.model, dtype=dtype)
        check_parallel(source, list(configs.engines.values()))
    except ValueError as exc:  # ModelNotFound and every other "this is not a model" case
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    from pdserve.launcher import Launcher

    try:
        layout = plan(configs, str(source.directory), source.name, gpus)
    except ValueError as exc:  # not enough GPUs for the pools' tensor-parallel ranks
        args.serve_parser.error(str(exc))
    return Launcher(layout).run()


def plan_command(args) -> int:
    """`pdserve plan`: a bad flag or model ends with one line and exit code 2."""
    from pdserve.planner.main import main as plan_main

    try:
        return plan_main(args)
    except ValueError as exc:
        args.plan_parser.error(str(exc))
    return USAGE_ERROR  # not reached: error() exits


def run_role(role: str, argv: list[str]) -> None:
    """Replace this process with `python -m MODULE ARGV`: same pid (a container's main process
    keeps receiving its signals), flags, exit codes and multiprocessing start-up as that
    command."""
    os.execv(sys.executable, [sys.executable, "-m", ROLE_MODULES[role], *argv])


def check_parallel(source, engines: list[EngineConfig]) -> None:
    """ValueError when the model cannot be split into a pool's tensor-parallel ranks (heads,
    KV heads and MLP must divide), its experts over them, or its layers into the pool's
    pipeline stages, before any process starts."""
    if all(e.world_size == 1 and not e.enable_expert_parallel for e in engines):
        return
    from common.model.parallel import PPLayout, TPLayout, check_expert_parallel
    from common.model.source import read_spec

    spec = read_spec(source)
    for engine in engines:
        TPLayout.of(spec, engine.tp)
        PPLayout.of(spec.num_layers, engine.pp, engine.pp_layer_partition)
        if engine.enable_expert_parallel:
            check_expert_parallel(spec, engine.tp)


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
