"""Operating the farm: Prometheus metrics, gRPC server reflection, request ids in (JSON) logs,
progress streamed to the client."""

import dataclasses
import json
import logging
import os
import urllib.request
import uuid

import grpc
import pytest
import torch
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.integration.helpers import TOKENS, direct_request
from torchfarm import logs
from torchfarm.client import remote
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import ClientSettings

pytestmark = pytest.mark.integration


def _metrics(farm, port: int = 0) -> str:
    """The gateway's metrics, or those served on `port` (a worker's)."""
    url = f"http://127.0.0.1:{port or farm.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _sum(text: str, name: str, label: str) -> float:
    """Sum of the series of `name` whose labels contain `label`, e.g. result="compiled"."""
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + "{") and label in line
    )


def _value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def test_metrics_count_requests_results_and_bytes(farm):
    # A model no other test compiles, so that its first request is a miss.
    request = direct_request(
        torch.nn.Sequential(torch.nn.Linear(12, 28), torch.nn.Softsign()), torch.randn(3, 12)
    )
    settings = dataclasses.replace(ClientSettings(token=TOKENS["alice"]), addr=farm.addr)
    before = _metrics(farm)
    worker_port = farm.worker_metrics_ports["worker0"]
    worker_before = _metrics(farm, worker_port)
    remote.fetch(request, settings)  # miss
    header, _ = remote.fetch(request, settings)  # hit
    with pytest.raises(remote.FarmError):
        remote.fetch(request, dataclasses.replace(settings, token="wrong"))
    after = _metrics(farm)
    for series, grew_by in [
        ('torchfarm_cache_results_total{result="miss"}', 1),
        ('torchfarm_cache_results_total{result="hit"}', 1),
        ('torchfarm_requests_total{rpc="Compile",status="OK"}', 2),
        ('torchfarm_requests_total{rpc="Compile",status="UNAUTHENTICATED"}', 1),
    ]:
        assert _value(after, series) - _value(before, series) == grew_by, series
    assert (
        _value(after, "torchfarm_bytes_served_total")
        - _value(before, "torchfarm_bytes_served_total")
        == 2 * header.size
    )
    assert "torchfarm_compile_seconds_bucket" in after
    assert "torchfarm_queue_depth{pool=" in after
    # The worker's own metrics, summed over its Celery pool processes: one compile, stored.
    worker_after = _metrics(farm, worker_port)
    for name, label, grew_by in [
        ("torchfarm_worker_compiles_total", 'result="compiled"', 1),
        ("torchfarm_worker_compile_seconds_count", 'mode="default"', 1),
        ("torchfarm_worker_bytes_stored_total", "pool=", header.size),
    ]:
        assert _sum(worker_after, name, label) - _sum(worker_before, name, label) == grew_by, name


def test_server_reflection_lists_the_farm_service(farm):
    with grpc.insecure_channel(farm.addr) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(
            stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
        )
    names = {s.name for s in reply.list_services_response.service}
    assert {"torchfarm.v1.Farm", "grpc.health.v1.Health"} <= names


def test_request_id_follows_a_compile_from_client_to_worker(farm):
    # A model no other test compiles, so that the request reaches a worker.
    request = direct_request(
        torch.nn.Sequential(torch.nn.Linear(10, 18), torch.nn.Hardswish()), torch.randn(3, 10)
    )
    settings = dataclasses.replace(ClientSettings(token=TOKENS["alice"]), addr=farm.addr)
    rid = f"req-{uuid.uuid4().hex[:12]}"
    remote.fetch(request, settings, request_id=rid)
    for log, messages in (("gateway.log", {"miss"}), ("worker0.log", {"compiling", "stored"})):
        with open(os.path.join(farm.log_dir, log)) as f:
            lines = [json.loads(line) for line in f if line.startswith("{")]
        about = [line for line in lines if line.get("request_id") == rid]
        said = {line["message"].split()[0] for line in about}
        # the pool's kernel builds for the job (workers/kernel_builder.py) follow its end
        assert messages <= said <= messages | {"kernel"}, log
        assert all(line["tenant"] == "alice" for line in about if "tenant" in line)


def test_text_log_lines_carry_the_request_and_job_ids_too():
    record = logging.LogRecord(
        "torchfarm.gateway", logging.INFO, __file__, 1, "miss %s", ("abc",), None
    )
    record.request_id = "req-1"
    assert logs.TextFormatter().format(record).endswith("miss abc [request req-1]")
    record.job_id = "f00d"
    assert logs.TextFormatter().format(record).endswith("miss abc [request req-1 job f00d]")
    entry = json.loads(logs.JsonFormatter().format(record))
    assert entry["message"] == "miss abc" and entry["request_id"] == "req-1"
    assert entry["job_id"] == "f00d"


def test_one_job_id_in_the_client_gateway_and_worker_logs_of_a_compile(farm, caplog):
    """The gateway's job id reaches the client (progress and header) and the worker (the
    Job): the client's line about the graph, the gateway's and the worker's lines about its
    compile, and the exemplar of the gateway's compile-seconds histogram all name it."""
    import torchfarm

    model = torch.nn.Sequential(torch.nn.Linear(6, 22), torch.nn.Tanhshrink())  # a miss
    x = torch.randn(2, 6)
    with caplog.at_level(logging.INFO, logger="torchfarm"):
        compiled = torchfarm.compile(model, addr=farm.addr, token=TOKENS["alice"])
        torch.testing.assert_close(compiled(x), model(x))
    from torchfarm.client.backend import history

    record = history[-1]
    assert record.source == "miss" and len(record.job_id) == 64, record
    client_lines = [r.getMessage() for r in caplog.records if record.job_id in r.getMessage()]
    assert client_lines and "farm miss" in client_lines[0], caplog.text
    for log, messages in (("gateway.log", {"miss"}), ("worker0.log", {"compiling", "stored"})):
        with open(os.path.join(farm.log_dir, log)) as f:
            lines = [json.loads(line) for line in f if line.startswith("{")]
        about = [line for line in lines if line.get("job_id") == record.job_id]
        said = {line["message"].split()[0] for line in about}
        # the pool's kernel builds for the job (workers/kernel_builder.py) follow its end
        assert messages <= said <= messages | {"kernel"}, log
        assert all(line["key"] == record.key for line in about), log
    request = urllib.request.Request(
        f"http://127.0.0.1:{farm.metrics_port}/metrics",
        headers={"Accept": "application/openmetrics-text; version=1.0.0"},
    )
    with urllib.request.urlopen(request, timeout=5) as r:
        exposition = r.read().decode()
    assert f'# {{job_id="{record.job_id}"}}' in exposition


def test_progress_streams_each_stage_of_a_max_autotune_compile(farm):
    """On a CPU, max-autotune benchmarks C++ and ATen choices for a bmm (about 4 s here):
    the worker's child reports it, and the client hears it while it waits."""

    class Bmm(torch.nn.Module):
        def forward(self, a, b):
            return torch.bmm(a, b).relu()

    request = direct_request(
        Bmm(), torch.randn(8, 64, 96), torch.randn(8, 96, 64), mode="max-autotune"
    )
    stages = []
    header, data = remote.fetch(
        request,
        ClientSettings(addr=farm.addr, token=TOKENS["alice"]),
        on_progress=lambda p: stages.append(pb.Progress.Stage.Name(p.stage)),
    )
    assert header.source == "miss" and data
    seen = [s for i, s in enumerate(stages) if i == 0 or stages[i - 1] != s]
    assert "AUTOTUNING" in seen and seen[-1] == "DOWNLOADING", stages
    assert seen.index("COMPILING") < seen.index("AUTOTUNING"), stages
