"""The compile task against a redis-server at its memory limit (the broker on the same server,
as `torchfarm up` once ran it): the task ends without raising and gives its job's claim back,
so the job's waiters queue it again and its tenant's slot is free (issue 27, finding 2)."""

import dataclasses
import types

import redis

from torchfarm.cache.store import Store
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.queue import job_to_json
from torchfarm.settings import WorkerSettings
from torchfarm.workers.app import compile_graph


def _task(settings: WorkerSettings) -> types.SimpleNamespace:
    """What compile_graph reads of its Celery task: the worker's settings and the queue."""
    conf = types.SimpleNamespace(torchfarm_worker=dataclasses.asdict(settings))
    return types.SimpleNamespace(
        app=types.SimpleNamespace(conf=conf),
        request=types.SimpleNamespace(delivery_info={"routing_key": "pool"}),
    )


def test_a_task_on_a_full_broker_gives_its_claim_back_and_the_worker_lives_on(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    store = Store.from_url(redis_url, redis_url)
    job = pb.Job(key="k" * 64, job_id="a-job-on-a-full-broker", tenant="alice")
    token = store.jobs.claim(job.job_id, 600)
    assert token is not None and store.jobs.post(job.job_id, token, b"payload")
    used = client.info("memory")["used_memory"]
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", used // 2)
    try:
        result = compile_graph(
            _task(WorkerSettings(redis_url=redis_url, broker_url=redis_url, sandbox="none")),
            job_to_json(job),
        )
        assert result == "error"  # no outcome could be written: no exception either
        assert not store.jobs.state(job.job_id).claimed
    finally:
        client.config_set("maxmemory", 0)
        client.flushdb()
