"""`python -m router --prefill ADDR[,ADDR] --decode ADDR[,ADDR] ...` (see --help)."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from types import FrameType

import uvicorn

from common.protocol.wire_auth import require_secret_for
from router.config import build_parser, config_from_args

KEEP_ALIVE_S = 30


class RouterServer(uvicorn.Server):
    """uvicorn, but a second SIGINT does not force the exit. Ctrl-C in the launcher's terminal
    reaches the router twice, from the terminal (the process group) and from the launcher,
    and a forced exit skips the app's shutdown (its sockets stay open, a traceback is printed).
    The launcher kills whatever is still running after its grace period."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGINT and self.should_exit:
            return
        super().handle_exit(sig, frame)


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

    server_config = uvicorn.Config(
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
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the Ctrl-C it handled
        RouterServer(server_config).run()


if __name__ == "__main__":
    main()
