#!/usr/bin/env python3
"""`pdserve-healthcheck [URL] [--node ID]`: the image's health check (standard library only).

Without --node: exit 0 when the router's /health at URL answers 200, i.e. it has a healthy
path through its pools (the container HEALTHCHECK of `pdserve serve` and of the router).
With --node: a node serves no HTTP of its own, so its health is what the router sees: exit 0
when the router's /health (200 or 503) lists node ID (its control address) healthy and not
draining. Anything else exits 1 with one line on stderr saying why.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000/health"


def fetch(url: str, timeout_s: float) -> tuple[int, dict[str, Any]]:
    """Status and JSON body of GET `url`; a 503 still carries the node list."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def problem(status: int, body: dict[str, Any], node: str | None) -> str | None:
    """Why the check fails, or None when it passes."""
    if node is None:
        return None if status == 200 else f"status {status}: {body.get('status')}"
    for entry in body.get("nodes", []):
        if entry.get("id") == node:
            if not entry.get("healthy"):
                return f"node {node} is not healthy: {entry.get('problem') or 'no heartbeat'}"
            return f"node {node} is draining" if entry.get("draining") else None
    return f"node {node} is not registered with the router"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve-healthcheck", description=__doc__)
    parser.add_argument("url", nargs="?", default=DEFAULT_URL, help="the router's /health")
    parser.add_argument("--node", help="a node's control address, e.g. tcp://10.0.0.7:5601")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds")
    args = parser.parse_args(argv)
    try:
        status, body = fetch(args.url, args.timeout)
    except (OSError, ValueError) as error:
        print(f"pdserve-healthcheck: {args.url}: {error}", file=sys.stderr)
        return 1
    reason = problem(status, body, args.node)
    if reason is not None:
        print(f"pdserve-healthcheck: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
