"""Signed frames between the router and the nodes, and the rule for when they are required.

Every socket binds to loopback by default, where only this host can reach it. A process that
binds a control, events or KV socket to any other interface must be given a shared secret
(PDSERVE_CLUSTER_SECRET, the same on every host): then every control message
(`common.protocol.messages`) and every KV frame header (`kv_transfer.frames`) starts with an
HMAC-SHA256 tag of the rest, and frames without a valid tag are dropped as invalid before
anything decodes them. KV payload bytes (the tensors that follow a signed layer header) are
not tagged: a forged header cannot be made, and a replayed one fails its transfer ("layer
arrived twice"). Messages stay msgpack; the tag is a fixed-size prefix.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from urllib.parse import urlsplit

from common import envs

TAG_BYTES = 32
LOOPBACK_HOSTS = frozenset({"localhost", "::1", "[::1]"})


class SignatureError(ValueError):
    pass


class FrameSigner:
    """`sign` prefixes a tag, `verify` checks and strips it; with no secret both are identity."""

    def __init__(self, secret: bytes | None) -> None:
        self.secret = secret

    def sign(self, payload: bytes) -> bytes:
        if self.secret is None:
            return payload
        return hmac.new(self.secret, payload, hashlib.sha256).digest() + payload

    def verify(self, frame: bytes) -> bytes:
        if self.secret is None:
            return frame
        frame = bytes(frame)
        if len(frame) < TAG_BYTES:
            raise SignatureError("frame too short to carry a signature")
        tag, payload = frame[:TAG_BYTES], frame[TAG_BYTES:]
        expected = hmac.new(self.secret, payload, hashlib.sha256).digest()
        if not hmac.compare_digest(tag, expected):
            raise SignatureError("bad frame signature (wrong or missing cluster secret)")
        return payload


SIGNER = FrameSigner(envs.cluster_secret())  # one per process, from its environment


def is_loopback(address: str) -> bool:
    """True for ipc:// and inproc:// addresses and tcp:// on 127.0.0.0/8, localhost or ::1."""
    parts = urlsplit(address)
    if parts.scheme in ("ipc", "inproc"):
        return True
    host = (parts.hostname or "").lower()
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def require_secret_for(bind_addresses: Iterable[str], signer: FrameSigner = SIGNER) -> None:
    """ValueError when a socket would bind beyond loopback and no cluster secret is set."""
    exposed = [a for a in bind_addresses if not is_loopback(a)]
    if exposed and signer.secret is None:
        raise ValueError(
            f"{', '.join(exposed)} binds beyond loopback: set PDSERVE_CLUSTER_SECRET (the same "
            "value on the router and every node) so that every frame is signed"
        )
