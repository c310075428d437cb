"""The warm parents' policy (workers/child_pool.py, with `reuse`): a parent started for a request
that found none idle is kept, so that steady overlap starts no more; one the pool no longer
needs is ended once idle past SURPLUS_IDLE_S. No process starts here: the parents are
stand-ins (the real fork server: tests/integration/workers/test_child_pool.py)."""

from __future__ import annotations

import threading
import time

import pytest

from torchfarm.workers import child_pool


class StandInParent:
    """A warm parent that is ready at once; its `fork` hands back what the pool's `done`
    needs, for the test to end the request."""

    def __init__(self, number: int, command: object) -> None:
        self.number, self.private_dir = number, f"parent-{number}"
        self.started = self.idle_since = time.monotonic()
        self.is_ready, self.ended = True, False
        self.settled = threading.Event()
        self.settled.set()

    def wait_ready(self) -> bool:
        return True

    def alive(self) -> bool:
        return not self.ended

    def kill(self) -> None:
        self.ended = True

    def close(self) -> int:
        self.ended = True
        return 0

    def fork(self, done):
        return Request(self, done)


class Request:
    def __init__(self, parent: StandInParent, done) -> None:
        self.parent, self._done = parent, done

    def end(self) -> None:
        self._done(self.parent, True)


def _until(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.fixture
def pool(monkeypatch):
    monkeypatch.setattr(child_pool, "WarmParent", StandInParent)
    made = child_pool.ChildPool(1, lambda n, d: ([], {}, ""), 60, reuse=lambda d: True)
    _until(lambda: len(made.idle()) == 1)
    yield made
    made.close()


def numbers(pool: child_pool.ChildPool) -> list[int]:
    return [parent.number for parent in pool.idle()]


def test_under_steady_overlap_the_parents_come_back_and_no_more_start(pool):
    first = pool.take()
    for _ in range(5):  # each request starts while the one before still runs
        second = pool.take()
        first.end()
        first = second
    first.end()
    assert pool._started == 2 and sorted(numbers(pool)) == [0, 1]


def test_a_request_takes_the_parent_idle_the_shortest(pool):
    one, two = pool.take(), pool.take()
    two.end()
    one.end()  # idle now: 1, then 0
    assert pool.take().parent.number == 0


def end_surplus(pool: child_pool.ChildPool) -> None:
    """What the keeper does every _CHECK_EVERY_S, now."""
    with pool._lock:
        pool._end_surplus()


def test_a_parent_over_the_size_is_ended_once_idle_past_surplus_idle_s(pool, monkeypatch):
    one, two = pool.take(), pool.take()
    one.end()
    two.end()
    end_surplus(pool)  # nothing has idled past SURPLUS_IDLE_S (60 s)
    assert numbers(pool) == [0, 1]
    monkeypatch.setattr(child_pool, "SURPLUS_IDLE_S", 0.0)
    end_surplus(pool)
    assert numbers(pool) == [1] and one.parent.ended and not two.parent.ended
    end_surplus(pool)
    assert numbers(pool) == [1]  # the pool's size is kept


def test_a_busy_parent_counts_toward_the_size(pool, monkeypatch):
    monkeypatch.setattr(child_pool, "SURPLUS_IDLE_S", 0.0)
    one, two = pool.take(), pool.take()
    one.end()  # idle beside a busy one: two parents for a size of 1
    end_surplus(pool)
    assert pool.idle() == [] and one.parent.ended
    two.end()
    end_surplus(pool)
    assert numbers(pool) == [1]
