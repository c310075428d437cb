"""Tenant authentication: `authorization: Bearer <token>` metadata, tokens kept as sha256,
and a limit on failed attempts per peer address.

Tokens made by `torchfarm token` read `tf_<id>_<secret>`: a random 64-bit id and a 256-bit
secret; others are "legacy", of unknown strength. A failed authentication spends a guess of
the caller's address (of the token's kind), never a token id's: the caller proved no id, and
one who knows a tenant's public id must not refuse its owner (issue 50). Past its guesses an
address is refused (RESOURCE_EXHAUSTED, when to try again), but not a valid token used from
it: a made token is still compared (no guess reaches a 256-bit secret), and a legacy token is
compared only on a connection that has already proved it, so a guesser learns nothing from
its answers while a tenant's open channel keeps working beside him.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import hmac
import logging
import re
import secrets
import threading
import time
from typing import NoReturn

from torchfarm.errors import TorchfarmError

log = logging.getLogger("torchfarm.gateway")
OPEN_TENANT = "public"
LEGACY = "legacy"  # the token id of every token not made by `torchfarm token`
TOKEN_PREFIX = "tf_"
MIN_SECRET_CHARS = 22  # urlsafe base64: 22 characters carry 132 bits
_TOKEN = re.compile(rf"{TOKEN_PREFIX}([0-9a-f]{{16}})_([A-Za-z0-9_-]{{{MIN_SECRET_CHARS},}})")


def make_token() -> str:
    """A new strong token: `tf_`, a public 64-bit id, `_`, a 256-bit urlsafe secret."""
    return f"{TOKEN_PREFIX}{secrets.token_hex(8)}_{secrets.token_urlsafe(32)}"


def token_id(token: str) -> str:
    """The id a token claims, LEGACY for a token not of `torchfarm token`'s form."""
    match = _TOKEN.fullmatch(token)
    return match.group(1) if match else LEGACY


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


Bucket = tuple[str, str]  # (peer address, MADE or LEGACY: the kind of token guessed)
MADE = "made"  # the kind of the tokens of `torchfarm token`


def bucket_of(token: str, peer: str) -> Bucket:
    """Where a failure of `token` from `peer` counts: its address's guesses of that kind."""
    return peer_address(peer), LEGACY if token_id(token) == LEGACY else MADE


class FailureLimiter:
    """A token bucket of failed authentications per (peer address, kind of token): `burst` at
    once, then one per `every_s`, so guessing runs at one try per second; other buckets are
    unaffected."""

    MAX_BUCKETS = 4096  # past this, full buckets are forgotten, then those of made tokens

    def __init__(self, burst: int, every_s: float = 1.0, clock=time.monotonic):
        self.burst, self.every_s, self.clock = burst, every_s, clock
        self._buckets: dict[Bucket, tuple[float, float]] = {}  # -> (tokens, at)
        self._lock = threading.Lock()

    def _tokens(self, bucket: Bucket, now: float) -> float:
        tokens, at = self._buckets.get(bucket, (self.burst, now))
        return min(self.burst, tokens + (now - at) / self.every_s)

    def retry_after_s(self, bucket: Bucket) -> float:
        """0 if the bucket may try now, else the seconds until it may."""
        if not self.burst:
            return 0.0
        with self._lock:
            tokens = self._tokens(bucket, self.clock())
        return 0.0 if tokens >= 1 else (1 - tokens) * self.every_s

    def failed(self, bucket: Bucket) -> None:
        if not self.burst:
            return
        with self._lock:
            now = self.clock()
            if len(self._buckets) >= self.MAX_BUCKETS:
                self._buckets = {
                    b: v for b, v in self._buckets.items() if self._tokens(b, now) < self.burst
                }
            if len(self._buckets) >= self.MAX_BUCKETS:
                # A flood of addresses: forgetting a made token's bucket only helps a guess
                # at a 256-bit secret; the legacy buckets, which guard guessable tokens, stay.
                self._buckets = {b: v for b, v in self._buckets.items() if b[1] == LEGACY}
            self._buckets[bucket] = (max(0.0, self._tokens(bucket, now) - 1), now)


class Refusal(enum.Enum):
    LIMITED = "limited"  # the bucket is empty: refused before the token was looked at
    UNKNOWN = "unknown"  # no token, or not one of the table's
    NOT_ADMIN = "not admin"  # a tenant's token on an admin RPC


class AccessRefused(TorchfarmError):
    def __init__(self, why: Refusal, message: str):
        super().__init__(message)
        self.why = why


class Authenticator:
    """Who a call's token names, through the failure limiter, for tenants and admins alike."""

    MAX_PROVEN = 4096  # connections remembered with the legacy token they proved

    def __init__(
        self,
        tenants: dict[str, str],
        admins: dict[str, str],
        limiter: FailureLimiter,
        legacy_tokens: bool = True,
    ):
        self.tenants, self.admins, self.limiter = tenants, admins, limiter
        self.legacy_tokens = legacy_tokens
        self._warned: set[str] = set()  # names seen with a legacy token (logged once each)
        # (peer with its port: one connection, hash of a legacy token it authenticated with)
        self._proven: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def tenant(self, metadata, peer: str) -> str:
        """The caller's tenant (OPEN_TENANT on an open farm), else AccessRefused."""
        if not self.tenants:
            return OPEN_TENANT
        token = _token(metadata)
        name = self._lookup(token, peer, self.tenants)
        if name is None:
            self._failed(token, peer, Refusal.UNKNOWN)
        return name

    def admin(self, metadata, peer: str) -> str:
        """The caller's admin name, else AccessRefused (NOT_ADMIN for a tenant's token)."""
        token = _token(metadata)
        name = self._lookup(token, peer, self.admins)
        if name is not None:
            return name
        if self.tenants and self._match(token, self.tenants) is None:
            self._failed(token, peer, Refusal.UNKNOWN)
        if not self.tenants:  # an open farm: a wrong admin token is a failed guess too
            self._failed(token, peer, Refusal.NOT_ADMIN)
        raise AccessRefused(Refusal.NOT_ADMIN, "admin RPCs need a token listed in TORCHFARM_ADMINS")

    def _lookup(self, token: str, peer: str, table: dict[str, str]) -> str | None:
        """`token`'s name in `table`, or None. A legacy token from an address out of guesses
        is refused before it is compared (LIMITED: the same answer right or wrong), unless
        this connection proved it before."""
        bucket = bucket_of(token, peer)
        if bucket[1] != LEGACY:
            return self._match(token, table)
        proof = (peer, hash_token(token))
        with self._lock:
            proven = proof in self._proven
        if not proven:
            self._refuse_if_limited(bucket)
        name = self._match(token, table)
        if name is not None:
            with self._lock:
                self._proven[proof] = None
                self._proven.move_to_end(proof)
                if len(self._proven) > self.MAX_PROVEN:
                    self._proven.popitem(last=False)
        return name

    def _failed(self, token: str, peer: str, why: Refusal) -> NoReturn:
        """A failed authentication: one guess of the caller's address spent (LIMITED where
        none is left), never a token id's."""
        bucket = bucket_of(token, peer)
        self._refuse_if_limited(bucket)
        self.limiter.failed(bucket)
        if why is Refusal.NOT_ADMIN:
            raise AccessRefused(why, "admin RPCs need a token listed in TORCHFARM_ADMINS")
        raise AccessRefused(why, "missing or unknown token")

    def _refuse_if_limited(self, bucket: Bucket) -> None:
        wait_s = self.limiter.retry_after_s(bucket)
        if wait_s:
            raise AccessRefused(
                Refusal.LIMITED,
                f"too many failed authentications from {bucket[0]}; retry in {wait_s:.1f} s",
            )

    def _match(self, token: str, table: dict[str, str]) -> str | None:
        name = tenant_for(token, table) if table else None
        if name is None or token_id(token) != LEGACY:
            return name
        if not self.legacy_tokens:
            return None
        if name not in self._warned:
            self._warned.add(name)
            log.warning(
                "%s authenticates with a token not made by `torchfarm token`: its strength is "
                "unknown, and a guesser at its address can refuse it on new connections",
                name,
            )
        return name


def _token(metadata) -> str:
    """The call's token; AccessRefused (UNKNOWN, no failure counted: it guesses nothing) if none."""
    token = bearer_token(metadata)
    if not token:
        raise AccessRefused(Refusal.UNKNOWN, "missing or unknown token")
    return token
