"""The pool registry on a bare redis-server: a pool's state from its workers' readiness,
how long each kind of entry is believed, and the one-line reason a pool cannot compile."""

import pytest
import redis

from torchfarm.cache import keys, pools
from torchfarm.cache.pools import PoolRegistry, Readiness, summary

INFO = {"describe": "cpu test pool", "target": {"device": "cpu"}}
ERROR = (
    "CompileFailed: compile child failed (exit 1):\nTraceback (most recent call last):\n"
    "  File \"x.py\", line 1\nModuleNotFoundError: No module named 'no_such_ops'"
)


@pytest.fixture
def registry(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield PoolRegistry(client)
    client.flushdb()


def test_a_pool_is_ready_when_any_worker_is_starting_while_any_is_else_failed(registry):
    registry.register("p", "a", INFO, Readiness(), pid=11, host="h")
    assert registry.live()["p"].state == "starting"
    assert registry.live()["p"].cannot_compile() == ""
    registry.register("p", "a", INFO, Readiness("failed", ERROR, 5.0), pid=11, host="h")
    pool = registry.live()["p"]
    assert pool.state == "failed" and pool.error == ERROR
    assert pool.describe == "cpu test pool" and pool.workers["a"].pid == 11
    assert pool.cannot_compile() == (
        "pool p cannot compile: CompileFailed: compile child failed (exit 1): ... "
        "ModuleNotFoundError: No module named 'no_such_ops'"
    )
    registry.register("p", "b", INFO, Readiness())
    assert registry.live()["p"].state == "starting"
    registry.register("p", "b", INFO, Readiness("ready", "", 6.0))
    assert registry.live()["p"].state == "ready"
    assert registry.live()["p"].error == ERROR  # still told, but the pool serves


def test_a_silent_worker_is_forgotten_after_the_pool_ttl_a_failed_one_after_longer(
    registry, monkeypatch
):
    registry.register("p", "live", INFO, Readiness("ready"))
    registry.register("p", "failed", INFO, Readiness("failed", ERROR, 1.0))
    registry.register("q", "gone", INFO, Readiness("ready"))
    now = registry._now()
    monkeypatch.setattr(registry, "_now", lambda: now + pools.POOL_TTL_S + 1)
    assert registry.live()["p"].state == "failed"  # its ready worker fell silent
    assert "q" not in registry.live()
    assert registry.redis.ttl(keys.pool("p")) > pools.POOL_TTL_S  # kept for the failure
    registry.register("p", "new", INFO, Readiness())  # a heartbeat prunes the silent ones
    assert set(registry.redis.hkeys(keys.pool("p"))) == {b"failed", b"new"}
    monkeypatch.setattr(registry, "_now", lambda: now + pools.FAILURE_TTL_S + 1)
    assert "p" not in registry.live()


def test_summary_keeps_what_failed_and_the_final_exception_within_bounds():
    assert summary("one line") == "one line"
    assert summary("first\n\n  middle\nlast  \n") == "first ... last"
    long = summary("x" * 5000, chars=100)
    assert len(long) == 105 and long.startswith("x" * 50) and " ... " in long
