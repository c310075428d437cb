"""Dynamo packages (issue 19 item 4): each tenant's own, kept in the cache's Redis.

A package holds a client's source and pickled guarded values, so it is never shared: its Redis
key is a hash of the authenticated tenant and the client's key, which a client cannot choose
for another tenant. The bytes are opaque here (the client authenticates them with a key only
it holds); the gateway bounds each one's size and each tenant's total
(TORCHFARM_TENANT_PACKAGE_MB), counts them in the cache's byte budget (the artifacts' LRU
makes room for them), and keeps them for a while after their last use.
"""

from __future__ import annotations

import hashlib
import logging
import re

import grpc

from torchfarm.cache import keys
from torchfarm.cache.blobs import CacheClient, OutOfMemoryError
from torchfarm.proto import torchfarm_pb2 as pb

log = logging.getLogger("torchfarm.gateway")

# Measured: a 6-block transformer's package is ~0.3 MB, transformers' GPT-2 training step's
# ~1 MB (its sources and guarded values); 8 MiB leaves headroom for the largest HF models.
MAX_PACKAGE_BYTES = 8 << 20
KEEP_S = 7 * 24 * 3600  # a package unused this long is dropped (its sources have moved on)
PACKAGE_BYTES = "package_bytes"  # the field of keys.TOTALS that counts packages

# Store a tenant's package unless its packages would pass the tenant's budget, in one atomic
# step: forget the tenant's packages that expired, then count what is left. Every key it
# touches carries the tenant's hash tag (one slot of a Redis Cluster); the change to the
# cache's totals (another slot) is returned for the caller to add.
# KEYS: the package, the tenant's package sizes.
# ARGV: the package bytes, the budget, the expiry.
# Returns {-1 if stored else the bytes in use, the change in the tenant's package bytes}.
_PUT = """
local used, change = 0, 0
for _, name in ipairs(redis.call('HKEYS', KEYS[2])) do
  local size = tonumber(redis.call('HGET', KEYS[2], name))
  if redis.call('EXISTS', name) == 0 then
    redis.call('HDEL', KEYS[2], name)
    change = change - size
  elseif name ~= KEYS[1] then
    used = used + size
  end
end
local size = string.len(ARGV[1])
if used + size > tonumber(ARGV[2]) then return {used, change} end
local old = tonumber(redis.call('HGET', KEYS[2], KEYS[1]) or '0')
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
redis.call('HSET', KEYS[2], KEYS[1], size)
redis.call('EXPIRE', KEYS[2], ARGV[3])
return {-1, change + size - old}
"""
_KEY = re.compile(r"[0-9a-f]{64}")


class Packages:
    def __init__(self, client: CacheClient, tenant_budget_bytes: int):
        self.redis = client
        self.tenant_budget_bytes = tenant_budget_bytes
        self._put = client.register_script(_PUT)  # type: ignore[union-attr]  # (types-redis lacks the cluster's)

    @staticmethod
    def redis_key(tenant: str, key: str) -> str:
        return keys.package(tenant, hashlib.sha256(f"{tenant}\0{key}".encode()).hexdigest())

    def put(self, tenant: str, request: pb.PutPackageRequest, context) -> pb.PutPackageReply:
        _check_key(request.key, context)
        if not request.package or len(request.package) > MAX_PACKAGE_BYTES:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED
                if request.package
                else grpc.StatusCode.INVALID_ARGUMENT,
                f"package: 1 to {MAX_PACKAGE_BYTES} bytes",
            )
        name = self.redis_key(tenant, request.key)
        try:
            used, change = self._put(
                keys=[name, keys.tenant_packages(tenant)],
                args=[request.package, self.tenant_budget_bytes, KEEP_S],
            )
        except OutOfMemoryError:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the farm's cache is full")
        if change:
            try:
                self.redis.hincrbyfloat(keys.TOTALS, PACKAGE_BYTES, change)
            except OutOfMemoryError:  # bookkeeping: the package itself is stored (or refused)
                log.warning("the cache's Redis is at its memory limit: package bytes not counted")
        if int(used) >= 0:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"tenant {tenant}'s packages hold {int(used)} bytes; this one "
                f"({len(request.package)} bytes) would pass its budget of "
                f"{self.tenant_budget_bytes} (TORCHFARM_TENANT_PACKAGE_MB); packages unused "
                f"for {KEEP_S // 86400} days leave",
            )
        return pb.PutPackageReply()

    def get(self, tenant: str, request: pb.GetPackageRequest, context) -> pb.GetPackageReply:
        _check_key(request.key, context)
        data = self.redis.getex(self.redis_key(tenant, request.key), ex=KEEP_S)
        return pb.GetPackageReply(found=data is not None, package=data or b"")


def _check_key(key: str, context) -> None:
    if not _KEY.fullmatch(key):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "key: 64 lowercase hex digits")
