"""client/remote.py `connect_early`: the connection and the farm's verify keys (an Info call,
which checks the token) are done on a thread while Dynamo traces, so that the first graph's
ask is one round trip (issue 27, finding 7)."""

import time

import pytest
import redis

from torchfarm import signing
from torchfarm.cache.store import Store
from torchfarm.client import remote
from torchfarm.gateway import auth
from torchfarm.gateway.server import build_server
from torchfarm.settings import ClientSettings, GatewaySettings

TOKEN = auth.make_token()


@pytest.fixture
def addr(redis_url, tmp_path):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    key = signing.generate(str(tmp_path / "signing.key")).public_key
    settings = GatewaySettings(
        port=0,
        redis_url=redis_url,
        tenants=f"alice:{auth.hash_token(TOKEN)}",
        metrics_port=0,
        threads=8,
        verify_keys=key,
    )
    server, port = build_server(settings, Store.from_clients(client))
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def _settings(addr: str, token: str = TOKEN) -> ClientSettings:
    return ClientSettings.from_env(addr=addr, token=token)


def test_the_connection_and_the_keys_are_ready_before_the_first_graph(addr):
    settings = _settings(addr)
    remote.connect_early(settings)
    deadline = time.monotonic() + 10
    farm = (settings.addr, settings.tls_ca, settings.token)
    while farm not in remote._farm_keys:
        assert time.monotonic() < deadline, "the keys were never fetched"
        time.sleep(0.01)
    assert remote.channel(settings.addr, settings.tls_ca) in remote._connected
    assert remote.verifier(settings)  # now answered from memory


def test_an_early_failure_is_left_to_the_first_real_call(addr):
    settings = _settings(addr, token="wrong")
    remote.connect_early(settings)  # raises nothing, on no thread
    time.sleep(0.5)
    with pytest.raises(remote.FarmError, match="UNAUTHENTICATED"):
        remote.verifier(settings)
    remote.connect_early(_settings(""))  # no farm: nothing started
