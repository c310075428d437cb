"""Tenant authentication: `authorization: Bearer <token>` metadata, tokens kept as sha256."""

from __future__ import annotations

import hashlib
import hmac

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
