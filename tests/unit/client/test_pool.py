"""The client's graph pool: bounded, and a graph needed before its turn never waits."""

import threading

import pytest

from torchfarm.client.pool import Pool


def test_a_job_not_started_when_needed_runs_on_the_callers_thread_while_the_pool_is_full():
    pool, release = Pool(1), threading.Event()
    busy = pool.submit(lambda: release.wait(60))  # the pool's only thread is taken
    waiting = pool.submit(lambda: threading.current_thread().name)
    assert waiting.result() == threading.current_thread().name  # no deadlock, no waiting
    release.set()
    assert busy.result() is True


def test_jobs_run_on_at_most_size_threads_and_their_errors_reach_whoever_waits():
    pool, release = Pool(2), threading.Event()
    jobs = [pool.submit(lambda: release.wait(60)) for _ in range(6)]
    failing = pool.submit(lambda: 1 / 0)
    assert len(pool._threads) == 2
    release.set()
    assert all(j.result() for j in jobs)
    with pytest.raises(ZeroDivisionError):
        failing.result()
