"""Tenant authentication: `authorization: Bearer <token>` metadata, tokens kept as sha256,
and a per-peer limit on failed attempts."""

from __future__ import annotations

import hashlib
import hmac
import threading
import time

OPEN_TENANT = "public"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer_token(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and value.startswith("Bearer "):
            return value[len("Bearer ") :]
    return None


def tenant_for(token: str | None, tenants: dict[str, str]) -> str | None:
    """The tenant owning `token`, OPEN_TENANT on an open farm, None if refused."""
    if not tenants:
        return OPEN_TENANT
    if not token:
        return None
    digest = hash_token(token)
    for known, name in tenants.items():
        if hmac.compare_digest(known, digest):
            return name
    return None


def peer_address(peer: str) -> str:
    """gRPC's peer string without its port ("ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7"): a
    guesser opening new connections stays the same peer."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return f"{kind}:{rest.rpartition(':')[0]}"
    return peer


class FailureLimiter:
    """A token bucket of failed authentications per peer address: `burst` at once, then one
    per `every_s`. A peer with an empty bucket is refused before its token is checked, so
    guessing tokens runs at one try per second, not thousands; other peers are unaffected."""

    MAX_PEERS = 4096  # past this, peers whose bucket is full again are forgotten

    def __init__(self, burst: int, every_s: float = 1.0, clock=time.monotonic):
        self.burst, self.every_s, self.clock = burst, every_s, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # peer -> (tokens, at)
        self._lock = threading.Lock()

    def _tokens(self, peer: str, now: float) -> float:
        tokens, at = self._buckets.get(peer, (self.burst, now))
        return min(self.burst, tokens + (now - at) / self.every_s)

    def retry_after_s(self, peer: str) -> float:
        """0 if the peer may try now, else the seconds until it may."""
        if not self.burst:
            return 0.0
        with self._lock:
            tokens = self._tokens(peer, self.clock())
        return 0.0 if tokens >= 1 else (1 - tokens) * self.every_s

    def failed(self, peer: str) -> None:
        if not self.burst:
            return
        with self._lock:
            now = self.clock()
            if len(self._buckets) >= self.MAX_PEERS:
                self._buckets = {
                    p: v for p, v in self._buckets.items() if self._tokens(p, now) < self.burst
                }
            self._buckets[peer] = (max(0.0, self._tokens(peer, now) - 1), now)
