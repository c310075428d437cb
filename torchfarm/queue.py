"""The Celery configuration and the compile task's name, shared by the gateway (which sends
jobs) and the worker (which registers the task). Only the worker imports the task itself,
so the gateway needs neither torch nor torchfarm.workers.

Tasks carry JSON only (never pickle): one argument, the Job as protobuf JSON.
acks_late + reject_on_worker_lost: a worker killed mid-compile leaves its message
unacknowledged, and the broker hands it to another worker.
"""

from __future__ import annotations

from celery import Celery
from google.protobuf import json_format

from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import broker_url

TASK_NAME = "torchfarm.compile"


def make_celery(redis_url: str, broker: str = "", visibility_timeout_s: float = 3600) -> Celery:
    app = Celery("torchfarm", broker=broker_url(redis_url, broker))
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_backend=None,
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        # Unacknowledged tasks of a dead worker are swept back to their queue this long after
        # delivery; the sweep runs every tenth of that (at most every 10 s).
        broker_transport_options={
            "visibility_timeout": visibility_timeout_s,
            "unacked_restore_interval": max(1, min(10, int(visibility_timeout_s / 10))),
            "unacked_restore_throttle": 1,
        },
        worker_hijack_root_logger=False,
    )
    return app


def send_job(app: Celery, job: pb.Job, pool: str) -> None:
    """Queue `job` on `pool`'s queue."""
    app.send_task(TASK_NAME, args=[job_to_json(job)], queue=pool, routing_key=pool)


def job_to_json(job: pb.Job) -> dict:
    return json_format.MessageToDict(job, preserving_proto_field_name=True)


def job_from_json(fields: dict) -> pb.Job:
    return json_format.ParseDict(fields, pb.Job())
