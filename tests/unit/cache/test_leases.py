"""A job's lease (cache/jobs.py): the one run of a compile, whatever the broker redelivers.

On a bare redis-server: a second run of a job whose first run is alive gets no lease, for as
long as the first renews it (past its TTL); a run that ended, or died, leaves the job to the
next one."""

import time

import pytest

from torchfarm.cache import jobs as jobs_module
from torchfarm.cache import keys
from torchfarm.cache.store import Store


@pytest.fixture
def board(redis_url):
    store = Store.from_url(redis_url)
    store.jobs.redis.flushdb()
    return store.jobs


def test_a_second_run_gets_no_lease_while_the_first_renews_it_past_its_ttl(board, monkeypatch):
    monkeypatch.setattr(jobs_module, "ALIVE_TTL_S", 1.5)  # renewed every 0.5 s
    with board.lease("j1", "host.1") as first:
        assert first
        for _ in range(3):  # twice the TTL: only renewals keep it
            time.sleep(1.0)
            with board.lease("j1", "host.2") as second:
                assert not second
        assert board.lease_holder("j1") == "host.1"
    assert board.lease_holder("j1") == ""
    with board.lease("j1", "host.2") as next_run:  # the first run ended
        assert next_run


def test_a_dead_runs_lease_lapses_and_the_next_run_takes_it(board, monkeypatch):
    monkeypatch.setattr(jobs_module, "ALIVE_TTL_S", 1)
    assert board.take_lease("j2", "host.1")  # a run that never renews: its worker died
    assert board.take_lease("j2", "host.2") is None
    time.sleep(1.3)
    assert board.take_lease("j2", "host.2")
    assert board.lease_holder("j2") == "host.2"


def test_a_lapsed_lease_taken_by_another_run_is_not_renewed_over_it(board, monkeypatch):
    """The first run's broker was away past the TTL and a second run took the job: the first
    run's renewals must not take the lease back (its result is stored all the same)."""
    monkeypatch.setattr(jobs_module, "ALIVE_TTL_S", 1.5)
    with board.lease("j3", "host.1") as first:
        assert first
        board.redis.set(keys.alive("j3"), "host.2/other", ex=60)  # what a second run holds
        time.sleep(1.2)  # two renewals of the first run
        assert board.lease_holder("j3") == "host.2"
    assert board.lease_holder("j3") == "host.2"  # the first run's end dropped only its own
