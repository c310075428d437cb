"""gateway/packages.py on a real redis-server and a real Redis Cluster: each tenant reads only
its own packages, and keeps no more than its budget."""

import grpc
import pytest

from torchfarm.cache import keys
from torchfarm.cache.artifacts import ArtifactCache
from torchfarm.cache.store import connect_cache
from torchfarm.gateway.packages import MAX_PACKAGE_BYTES, Packages
from torchfarm.proto import torchfarm_pb2 as pb

KEY = "ab" * 32


class Aborted(Exception):
    pass


class Context:
    def abort(self, code, message):
        self.code = code
        raise Aborted(message)


@pytest.fixture(params=["redis", "cluster"])
def packages(request, redis_url):
    """On a bare redis-server, and on a real three-master Redis Cluster (the script's keys
    share the tenant's hash tag; the totals live in another slot)."""
    url = request.getfixturevalue("redis_cluster_url") if request.param == "cluster" else redis_url
    client = connect_cache(url)
    client.flushdb()
    return Packages(client, BUDGET)


BUDGET = 1000


def test_a_tenant_gets_its_own_package_and_no_other(packages):
    packages.put("alice", pb.PutPackageRequest(key=KEY, package=b"alice's"), Context())
    mine = packages.get("alice", pb.GetPackageRequest(key=KEY), Context())
    assert mine.found and mine.package == b"alice's"
    theirs = packages.get("bob", pb.GetPackageRequest(key=KEY), Context())
    assert not theirs.found and theirs.package == b""
    packages.put("bob", pb.PutPackageRequest(key=KEY, package=b"bob's"), Context())
    assert packages.get("alice", pb.GetPackageRequest(key=KEY), Context()).package == b"alice's"


def test_the_redis_key_is_derived_never_the_clients(packages):
    packages.put("alice", pb.PutPackageRequest(key=KEY, package=b"x"), Context())
    (stored,) = packages.redis.scan_iter(keys.package("alice", "*"))
    assert KEY not in stored.decode()
    assert stored.decode() == Packages.redis_key("alice", KEY)
    assert 0 < packages.redis.ttl(stored)


@pytest.mark.parametrize(
    "request_, code",
    [
        (pb.PutPackageRequest(key="AB" * 32, package=b"x"), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.PutPackageRequest(key=KEY[:-1], package=b"x"), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.PutPackageRequest(key=KEY), grpc.StatusCode.INVALID_ARGUMENT),
        (
            pb.PutPackageRequest(key=KEY, package=b"x" * (MAX_PACKAGE_BYTES + 1)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
    ],
)
def test_bad_puts_get_a_precise_status_and_store_nothing(packages, request_, code):
    context = Context()
    with pytest.raises(Aborted):
        packages.put("alice", request_, context)
    assert context.code == code
    assert list(packages.redis.scan_iter(f"{keys.FORMAT}:package:*")) == []


def test_a_bad_key_on_get_is_refused(packages):
    context = Context()
    with pytest.raises(Aborted):
        packages.get("alice", pb.GetPackageRequest(key="../x"), context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT


def _put(packages, tenant: str, key: str, size: int) -> grpc.StatusCode | None:
    context = Context()
    try:
        packages.put(tenant, pb.PutPackageRequest(key=key, package=b"p" * size), context)
    except Aborted:
        return context.code
    return None


def test_a_tenant_past_its_budget_is_refused_and_others_are_not(packages):
    """Finding 3 of issue 27: one tenant's uploads filled the store for everyone."""
    assert _put(packages, "mallory", "01" * 32, 600) is None
    assert _put(packages, "mallory", "02" * 32, 600) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _put(packages, "mallory", "01" * 32, 900) is None  # replacing its own: fits
    assert _put(packages, "alice", "02" * 32, 900) is None  # alice's budget is her own
    assert packages.get("alice", pb.GetPackageRequest(key="02" * 32), Context()).found
    assert not packages.get("mallory", pb.GetPackageRequest(key="02" * 32), Context()).found


def test_packages_count_in_the_cache_budget_and_expired_ones_leave_it(packages):
    assert _put(packages, "alice", "01" * 32, 700) is None
    assert _put(packages, "alice", "02" * 32, 200) is None
    assert ArtifactCache(packages.redis).used_bytes() == 900
    packages.redis.delete(Packages.redis_key("alice", "01" * 32))  # expired
    assert _put(packages, "alice", "03" * 32, 700) is None  # the expired one no longer counts
    assert ArtifactCache(packages.redis).used_bytes() == 900
