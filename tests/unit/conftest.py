"""The unit tier: no farm. Store tests get a bare redis-server of their own, and a real
three-master Redis Cluster (tests/redis_cluster.py) where the layout matters."""

import pytest

from torchfarm.local_farm import LocalFarm


@pytest.fixture(scope="session")
def redis_url():
    """A real redis-server (the embedded farm's, alone) on a free loopback port."""
    servers = LocalFarm()
    try:
        servers.start_redis()
        yield servers.redis_url
    finally:
        servers.stop()


@pytest.fixture(scope="session")
def redis_cluster_url():
    """TORCHFARM_REDIS_URL of a real three-master Redis Cluster on loopback ports."""
    from tests.redis_cluster import redis_cluster

    with redis_cluster() as cluster:
        yield cluster.url
