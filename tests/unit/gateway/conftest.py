import pytest
import redis

from torchfarm.cache.pools import Readiness
from torchfarm.cache.store import Store
from torchfarm.contract.pools import pool_name
from torchfarm.gateway import hit_ledger
from torchfarm.proto import torchfarm_pb2 as pb

TARGET = pb.Target(device="cpu", torch_version="2.13.0+gitabc", python_version="3.11")


@pytest.fixture
def store(redis_url):
    """A Store on the bare redis-server, emptied around the test, with a ready pool for TARGET."""
    client = redis.Redis.from_url(redis_url)
    hit_ledger.flush_all()  # earlier tests' gateways: their hits land before, not in, this one
    client.flushdb()
    farm = Store.from_clients(client)
    farm.pools.register(pool_name(TARGET), "w1", {"describe": "a test pool"}, Readiness("ready"))
    yield farm
    client.flushdb()
