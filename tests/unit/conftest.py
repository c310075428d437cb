"""The unit tier: no farm. Store tests get a bare redis-server of their own."""

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
