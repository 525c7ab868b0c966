"""`python -m router --prefill ADDR[,ADDR] --decode ADDR[,ADDR] ...` (see --help)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import uvicorn

from common.wire_auth import require_secret_for
from router.config import build_parser, config_from_args

KEEP_ALIVE_S = 30


def main(argv: Sequence[str] | None = None) -> None:
    try:
        config = config_from_args(argv)
        require_secret_for([config.events_address])
    except ValueError as exc:
        build_parser().error(str(exc))
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s router %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from router.app import create_app  # after logging is set up: loading the tokenizer logs

    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=config.log_level.lower(),
        access_log=config.access_log,
        timeout_graceful_shutdown=3,
        # Longer than the idle expiry of the usual clients (httpx and the openai client: 5 s,
        # aiohttp: 15 s): a server that closes an idle connection at the moment the client
        # reuses it fails that request with a connection error (seen under load at 5 s).
        timeout_keep_alive=KEEP_ALIVE_S,
    )


if __name__ == "__main__":
    main()
