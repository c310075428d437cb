"""Compiles that outlive the broker's visibility timeout (issue 29, deliverable 4): 3 s on
this farm (conftest.gateways_farm), where a real farm has 1 h (Redis) or 30 min (RabbitMQ's
consumer timeout) and an exhaustive max-autotune of a large model can take longer. The broker
hands such a task out again while it runs; the copy finds the job's lease held and ends
without compiling. A worker that dies leaves its lease to lapse, and the job is compiled by
another within the lease's TTL."""

import re
import signal
import time

import pytest

from tests.integration.helpers import (
    compiles,
    log_of,
    result_of,
    running_job,
    start_slow_client,
)
from torchfarm.cache.jobs import ALIVE_TTL_S

pytestmark = pytest.mark.integration


def _workers(farm) -> list[str]:
    return sorted(farm.worker_names)


def _runs(farm, key: str) -> dict[str, int]:
    """Per worker: compiles of `key` started, and copies it skipped as running elsewhere."""
    logs = "".join(log_of(farm, name) for name in _workers(farm))
    return {
        "started": len(re.findall(rf"compiling {key[:16]}", logs)),
        "skipped": len(re.findall(rf"skipped {key[:16]}: \S+ runs it", logs)),
    }


def test_a_compile_longer_than_the_broker_timeout_runs_exactly_once(gateways_farm):
    farm = gateways_farm
    before, stored = compiles(farm), {row["key"] for row in farm.store().rows()}
    client = start_slow_client(farm.addr, 25)  # 25 s of compile; the broker's timeout is 3 s
    result, err = result_of(client)
    assert result["sources"] == ["miss"], (result["whys"], err[-2000:])
    assert result["out_err"] < 1e-5
    assert compiles(farm) == before + 1
    (key,) = {row["key"] for row in farm.store().rows()} - stored
    runs = _runs(farm, key)
    assert runs["started"] == 1, runs
    assert runs["skipped"] >= 1, runs  # the broker did hand it out again, and it stayed one


def test_a_killed_workers_long_compile_is_compiled_by_another_within_the_lease(gateways_farm):
    farm = gateways_farm
    before = compiles(farm)
    client = start_slow_client(farm.addr, 30)
    job = running_job(farm)
    holder = farm.store().jobs.lease_holder(job)
    pid = int(holder.rpartition(".")[2])
    victim = next(name for name in _workers(farm) if farm.procs[name].pid == pid)
    survivor = next(name for name in _workers(farm) if name != victim)
    seen = len(log_of(farm, survivor))
    farm.stop_process(victim, signal.SIGKILL)  # the worker, its pool and its sandbox
    killed = time.monotonic()
    try:
        while "compiling " not in log_of(farm, survivor)[seen:]:
            # the lease lapses within its TTL; the waiter checks every second
            assert time.monotonic() - killed < ALIVE_TTL_S + 30, "not handed to the survivor"
            time.sleep(0.5)
        result, err = result_of(client)
    finally:
        farm.start_worker(victim)
    assert result["sources"] == ["miss"], (result["whys"], err[-2000:])
    assert result["out_err"] < 1e-5
    assert compiles(farm) == before + 1  # the killed run stored nothing
