"""Several gateways on one Redis (issue 29, deliverable 3): single flight, the tenant limit
and prefetch hold across them, and a gateway that dies under a client's compile hands the
client to another, with no local compile. One farm (gateways_farm): two gateways, two
workers; compiles are slowed in the worker (clients/slow_client.py) so that requests overlap
them.

Compiles that outlive the broker's visibility timeout (issue 29, deliverable 4): 3 s on this
farm, where a real farm has 1 h (Redis) or 30 min (RabbitMQ's consumer timeout) and an
exhaustive max-autotune of a large model can take longer. The broker hands such a task out
again while it runs; the copy finds the job's lease held and ends without compiling. A worker
that dies leaves its lease to lapse, and the job is compiled by another within the lease's
TTL."""

import pickle
import re
import signal
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from tests.integration.helpers import (
    TOKENS,
    compiles,
    log_of,
    result_of,
    run_client,
    running_job,
    start_slow_client,
)
from tests.integration.test_attacks import _Exploit
from torchfarm.cache.jobs import ALIVE_TTL_S
from torchfarm.compiler.target import local_target
from torchfarm.gateway.auth import hash_token
from torchfarm.local_farm import LocalFarm
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gateways_farm():
    """Two gateways on one Redis, two workers of one compile each, a broker visibility timeout
    of 3 s (every compile outlives it: the broker hands each out again while it runs) and a
    tenant limit of one compile."""
    tenants = ",".join(f"{name}:{hash_token(tok)}" for name, tok in TOKENS.items())
    with LocalFarm(
        tenants=tenants,
        gateways=2,
        workers=2,
        extra_env={
            "TORCHFARM_WORKER_CONCURRENCY": "1",
            "TORCHFARM_WARM_CHILDREN": "1",
            "TORCHFARM_REDELIVERY_TIMEOUT": "3",
            "TORCHFARM_TENANT_MAX_COMPILES": "1",
        },
    ) as f:
        yield f


def test_identical_requests_through_two_gateways_compile_once(gateways_farm):
    farm = gateways_farm
    before = compiles(farm)
    # 4 fresh processes, 2 on each gateway; the compile takes 40 s, so they all overlap it
    clients = [start_slow_client(farm.addrs[i % 2], 40) for i in range(4)]
    results = [result_of(c)[0] for c in clients]
    assert compiles(farm) == before + 1  # counted by the worker that stored it
    sources = sorted(r["sources"][0] for r in results)
    assert sources.count("miss") == 1 and set(sources) <= {"miss", "merged", "hit"}, sources
    assert all(r["out_err"] < 1e-5 for r in results)
    # each gateway waited on the compile for a client of its own: one claimed it, the
    # other merged into it
    said = [
        re.findall(r"\b(miss|merged) ([0-9a-f]{16}) for alice", log_of(farm, n))
        for n in farm.gateway_ports
    ]
    job_keys = {key for lines in said for _, key in lines}
    shared = [k for k in job_keys if all(any(key == k for _, key in lines) for lines in said)]
    assert shared, said


def _compile(addr: str, tenant: str, code: str) -> grpc.RpcError | None:
    """A Compile of a payload that runs `code` in the child (then fails: it is no graph)."""
    request = pb.CompileRequest(graph=pickle.dumps(_Exploit(code)), target=local_target())
    with grpc.insecure_channel(addr) as channel:
        try:
            list(
                pb_grpc.FarmStub(channel).Compile(
                    request, timeout=300, metadata=[("authorization", f"Bearer {TOKENS[tenant]}")]
                )
            )
        except grpc.RpcError as e:
            return e
    return None


def test_the_tenant_limit_holds_across_gateways(gateways_farm):
    farm = gateways_farm
    first: list = []
    long_one = threading.Thread(
        target=lambda: first.append(_compile(farm.addrs[0], "bob", "import time\ntime.sleep(12)"))
    )
    long_one.start()
    running_job(farm)  # bob's compile runs, through the first gateway
    refused = _compile(farm.addrs[1], "bob", "x = 1")
    assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit 1" in refused.details()
    long_one.join(120)
    assert first[0].code() == grpc.StatusCode.ABORTED  # ran, and failed: no graph in it
    later = _compile(farm.addrs[1], "bob", "x = 2")  # the slot is free again
    assert later is not None and later.code() == grpc.StatusCode.ABORTED, later.details()


def test_prefetch_holds_across_gateways(gateways_farm, tmp_path):
    farm = gateways_farm
    scale = "1.234567"
    # one graph at a time (the tenant's limit here is one compile)
    env = {"XDG_CACHE_HOME": str(tmp_path), "TORCHFARM_PARALLEL_GRAPHS": "0"}
    first = run_client(farm, "program_client.py", scale, "64", env=env)
    assert first["sources"] == ["miss", "miss", "miss"], first["whys"]
    # the program was recorded by the first gateway; the second one is asked now
    second = run_client(
        SimpleNamespace(addr=farm.addrs[1]), "program_client.py", scale, "64", env=env
    )
    assert second["sources"] == ["hit", "hit", "hit"], second["whys"]
    assert second["prefetched"] == [False, True, True]
    assert second["out_err"] < 1e-3


def test_a_gateway_killed_mid_request_hands_its_client_to_the_other(gateways_farm):
    farm = gateways_farm
    before = compiles(farm)
    logs = {name: len(log_of(farm, name)) for name in farm.gateway_ports}
    # both gateways in one address: the client's channel balances over them
    client = start_slow_client(",".join(farm.addrs), 45)
    running_job(farm)
    serving = [
        name
        for name in farm.gateway_ports
        if re.search(r"\bmiss [0-9a-f]{16} for alice", log_of(farm, name)[logs[name] :])
    ]
    assert len(serving) == 1, serving
    farm.stop_process(serving[0], signal.SIGKILL)  # dies under the client's Get stream
    try:
        result, err = result_of(client)
    finally:
        farm.start_gateway(serving[0])
    assert result["sources"] in (["merged"], ["miss"]), (result["whys"], err[-2000:])
    assert result["out_err"] < 1e-5
    assert "farm unavailable" not in err and "compiling locally" not in err
    assert compiles(farm) == before + 1  # the job went on in its worker, compiled once


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
