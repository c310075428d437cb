"""The pool registry, on the broker's Redis: each live pool's description, kept alive by its
workers' heartbeats, so the gateway knows which targets it can serve."""

from __future__ import annotations

import json

import redis

from torchfarm.cache import keys

POOL_TTL_S = 30


class PoolRegistry:
    def __init__(self, client: redis.Redis):
        self.redis = client

    def register(self, name: str, info: dict) -> None:
        self.redis.set(keys.pool(name), json.dumps(info, sort_keys=True), ex=POOL_TTL_S)

    def live(self) -> dict[str, dict]:
        """name -> {"target", "describe"} of every pool heard from in the last POOL_TTL_S."""
        names = list(self.redis.scan_iter(keys.POOL_PATTERN, count=100))
        values = self.redis.mget(names) if names else []
        return {n.decode().split(":", 2)[2]: json.loads(v) for n, v in zip(names, values) if v}
