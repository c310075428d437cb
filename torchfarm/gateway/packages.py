"""Dynamo packages (issue 19 item 4): each tenant's own, kept in the cache's Redis.

A package holds a client's source and pickled guarded values, so it is never shared: its Redis
key is a hash of the authenticated tenant and the client's key, which a client cannot choose
for another tenant. The bytes are opaque here (the client authenticates them with a key only
it holds); the gateway only bounds their size and keeps them for a while after their last use.
"""

from __future__ import annotations

import hashlib
import re

import grpc
import redis

from torchfarm.cache import keys
from torchfarm.proto import torchfarm_pb2 as pb

MAX_PACKAGE_BYTES = 32 << 20  # a 6-block transformer's package is ~0.3 MB; HF models a few MB
KEEP_S = 30 * 24 * 3600  # a package unused this long is dropped (its sources have moved on)
_KEY = re.compile(r"[0-9a-f]{64}")


class Packages:
    def __init__(self, client: redis.Redis):
        self.redis = client

    @staticmethod
    def redis_key(tenant: str, key: str) -> str:
        return keys.package(hashlib.sha256(f"{tenant}\0{key}".encode()).hexdigest())

    def put(self, tenant: str, request: pb.PutPackageRequest, context) -> pb.PutPackageReply:
        _check_key(request.key, context)
        if not request.package or len(request.package) > MAX_PACKAGE_BYTES:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED
                if request.package
                else grpc.StatusCode.INVALID_ARGUMENT,
                f"package: 1 to {MAX_PACKAGE_BYTES} bytes",
            )
        self.redis.set(self.redis_key(tenant, request.key), request.package, ex=KEEP_S)
        return pb.PutPackageReply()

    def get(self, tenant: str, request: pb.GetPackageRequest, context) -> pb.GetPackageReply:
        _check_key(request.key, context)
        data = self.redis.getex(self.redis_key(tenant, request.key), ex=KEEP_S)
        return pb.GetPackageReply(found=data is not None, package=data or b"")


def _check_key(key: str, context) -> None:
    if not _KEY.fullmatch(key):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "key: 64 lowercase hex digits")
