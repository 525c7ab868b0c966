"""The internal ZMQ ports of `pdserve serve`, and the check that the ports it binds are free.

One rule (`internal_ports`): `--zmq-base-port B` lays the ports out from B. Unset, they are
ports the OS hands out free on a loopback `--bind-host`, so that stacks started side by side
never collide, and `FIXED_ZMQ_BASE_PORT` on any other address (or with `--router-url`), because
a host that joins the router must know its events port, and firewalls the others. The check
runs before any process starts and names the flag of the first port in use.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

from common.protocol.wire_auth import is_loopback
from pdserve.flags import FIXED_ZMQ_BASE_PORT, LaunchConfig


@dataclass(frozen=True)
class Ports:
    events: int  # the router's events socket
    prefill: tuple[int, ...]  # control socket of prefill node i
    decode: tuple[int, ...]  # control socket of decode node j
    kv: tuple[int, ...]  # KV receiver of decode node j
    base: int | None = None  # the base they are laid out from; None: chosen free

    @classmethod
    def from_base(cls, base: int, num_prefill: int, num_decode: int) -> Ports:
        return cls(
            base,
            tuple(base + 1 + i for i in range(num_prefill)),
            tuple(base + 101 + j for j in range(num_decode)),
            tuple(base + 201 + j for j in range(num_decode)),
            base,
        )

    @classmethod
    def free(cls, host: str, num_prefill: int, num_decode: int) -> Ports:
        ports = free_ports(host, 1 + num_prefill + 2 * num_decode)
        decode = ports[1 + num_prefill :]
        return cls(
            ports[0], tuple(ports[1 : 1 + num_prefill]), tuple(decode[::2]), tuple(decode[1::2])
        )

    def named(self) -> list[tuple[str, int]]:
        out = [("router events", self.events)]
        out += [(f"prefill-{i} control", p) for i, p in enumerate(self.prefill)]
        out += [(f"decode-{j} control", p) for j, p in enumerate(self.decode)]
        return out + [(f"decode-{j} KV", p) for j, p in enumerate(self.kv)]


def internal_ports(launch: LaunchConfig) -> Ports:
    counts = (launch.prefill_count, launch.num_decode)
    if launch.zmq_base_port is not None:
        return Ports.from_base(launch.zmq_base_port, *counts)
    if launch.router_url is not None or not is_loopback(f"tcp://{launch.bind_host}"):
        return Ports.from_base(FIXED_ZMQ_BASE_PORT, *counts)
    return Ports.free(launch.bind_host, *counts)


def free_ports(host: str, n: int) -> list[int]:
    """`n` distinct ports free on `host` now. Another process may bind one before ours does;
    Linux hands out these ports from a random offset, so stacks started side by side do not
    draw the same ones."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(n):  # all held open at once, so the OS gives n distinct ports
            s = socket.socket(_family(host))
            sockets.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def first_port_taken(launch: LaunchConfig, ports: Ports) -> str | None:
    """The flag of the first port this host's processes would fail to bind, with the port and
    the reason, or None. Ports chosen free are not checked again."""
    if launch.router_url is None:
        problem = bind_problem(launch.host, launch.port)
        if problem:
            return f"--port {launch.port} {problem} ({launch.host})"
    if ports.base is None:
        return None
    flag = f"--zmq-base-port {ports.base}"
    if launch.zmq_base_port is None:
        flag += f" (the default with --bind-host {launch.bind_host} or --router-url)"
    for what, port in ports.named():
        if what == "router events" and launch.router_url is not None:
            continue  # it is on the router's host
        problem = bind_problem(launch.bind_host, port)
        if problem:
            return f"{flag}: port {port} ({what}) {problem} ({launch.bind_host})"
    return None


def bind_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port now ("is in use", ...), or None."""
    with socket.socket(_family(host)) as s:
        # As servers bind: a port whose old connections linger in TIME_WAIT is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound: {exc}"
    return None


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
