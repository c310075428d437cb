"""A farm whose cache's index lives on a real three-master Redis Cluster (Debian's
redis-server, tests/redis_cluster.py), its broker on a server of its own: a miss is compiled
once and stored, hits are served and counted, the operators' CLI works through the gateway,
and eviction leaves nothing behind on any master."""

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from tests.integration.helpers import ADMIN_TOKEN, TOKENS, direct_request, run_client
from tests.redis_cluster import redis_cluster
from torchfarm.cache import keys
from torchfarm.cli import app
from torchfarm.client import remote
from torchfarm.gateway.auth import hash_token
from torchfarm.local_farm import LocalFarm
from torchfarm.settings import ClientSettings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster_farm():
    tenants = ",".join(f"{name}:{hash_token(tok)}" for name, tok in TOKENS.items())
    with (
        redis_cluster() as cluster,
        LocalFarm(
            cache_url=cluster.url, tenants=tenants, admins=f"ops:{hash_token(ADMIN_TOKEN)}"
        ) as farm,
    ):
        yield farm, cluster


def _cli(*args: str) -> dict | list:
    result = CliRunner().invoke(app, ["cache", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_a_farm_on_a_redis_cluster_compiles_once_and_serves_hits(cluster_farm, monkeypatch):
    farm, cluster = cluster_farm
    store = farm.store()
    compiles = store.counters.farm().get("compiles", 0)
    miss = run_client(farm, "model_client.py", "mlp", "infer")
    assert miss["sources"] == ["miss"] and miss["out_err"] < 1e-5
    hit = run_client(farm, "model_client.py", "mlp", "infer")
    assert hit["sources"] == ["hit"] and hit["out_err"] < 1e-5
    settings = dataclasses.replace(ClientSettings(token=TOKENS["bob"]), addr=farm.addr)
    requests = [
        direct_request(
            torch.nn.Sequential(torch.nn.Linear(8, w), torch.nn.GELU()), torch.randn(2, 8)
        )
        for w in (5, 9, 17, 33)
    ]
    headers = [remote.fetch(r, settings)[0] for r in requests]
    assert [h.source for h in headers] == ["miss"] * 4
    assert [remote.fetch(r, settings)[0].source for r in requests] == ["hit"] * 4
    assert store.counters.farm()["compiles"] == compiles + 5  # one per distinct graph

    # The operators' CLI through the gateway, with an admin token only.
    monkeypatch.setenv("TORCHFARM_ADDR", farm.addr)
    monkeypatch.setenv("TORCHFARM_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.delenv("TORCHFARM_REDIS_URL", raising=False)
    rows = {r["key"]: r for r in _cli("ls", "--tenant", "bob", "--limit", "0")}
    assert {h.key for h in headers} <= set(rows) and all(rows[h.key]["hits"] >= 1 for h in headers)
    stats = _cli("stats")
    assert stats["entries"] == 5 and stats["hits"] >= 5 and stats["misses"] >= 5

    # Each key's index and usage (written by the hit ledger, which the admin RPCs above
    # flushed) live together on the master of the key's slot (that the keys spread over the
    # masters, test_cluster.py of the unit tier shows with fixed keys); the broker's server
    # holds none of it.
    stored = [k for k, _ in store.artifacts.keys()]
    assert len(stored) == 5
    for key in stored:
        port = store.artifacts.redis.get_node_from_key(keys.index(key)).port
        assert cluster.node(port).exists(keys.index(key), keys.usage(key)) == 2
    assert not list(store.jobs.redis.scan_iter(match=f"{keys.FORMAT}:index:*"))

    assert _cli("rm", headers[0].key)["entries_removed"] == 1
    assert remote.fetch(requests[0], settings)[0].source == "miss"  # rebuilt

    # Eviction (the workers' own, budget 1 byte) removes every entry from every master.
    dropped = store.artifacts.evict(max_bytes=1)
    assert len(dropped) == 5 and store.artifacts.keys() == []
    assert store.artifacts.totals()["entries"] == 0
    for port in cluster.ports:  # no index or usage of any key left on any master
        node = cluster.node(port)
        assert not list(node.scan_iter(match=f"{keys.FORMAT}:index:*")), port
        assert not list(node.scan_iter(match=f"{keys.FORMAT}:usage:*")), port
