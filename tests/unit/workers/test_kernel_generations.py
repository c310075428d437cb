"""The compile task and `cache drop-kernels` (a bare redis-server, the child faked): a job
stages nothing of what was kept before the pool's generation changed, a compile the generation
changed under keeps nothing, and the GEMM candidates a child benchmarked are counted, the
kernel cache on or off."""

import os

import redis

from tests.unit.workers.test_full_store import _task
from torchfarm.cache.store import Store
from torchfarm.compiler.target import local_target
from torchfarm.contract.cache_key import private_key, public_key
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.queue import job_to_json
from torchfarm.settings import WorkerSettings
from torchfarm.workers import app, kernel_cache, run_kernels, sandbox

OBJ = "ab/cab" + "c" * 49 + ".so"  # C++ objects' names, as Inductor gives them
OTHER = "ab/cab" + "d" * 49 + ".so"


def _compile(store: Store, settings: WorkerSettings, n: int, child) -> None:
    """One private job of alice's through the task, its child `child(kernels_from)`."""
    payload, target, options = f"graph {n}".encode(), local_target(), pb.Options()
    key = private_key(public_key(payload, target, options), "alice")
    job = pb.Job(key=key, job_id=f"job-{n}", tenant="alice", private=True, target=target)
    token = store.jobs.claim(job.job_id, 600)
    assert token is not None and store.jobs.post(job.job_id, token, payload)
    store.jobs.join(job.job_id, "a waiting client", 600)

    def run_compile(spec: sandbox.ChildSpec, settings: WorkerSettings) -> sandbox.ChildResult:
        artifact = pb.Artifact(inductor=b"compiled").SerializeToString()
        return sandbox.ChildResult(artifact, 0.0, child(spec.kernels_from))

    original, sandbox.run_compile = sandbox.run_compile, run_compile
    try:
        assert app.compile_graph(_task(settings), job_to_json(job)) == "compiled"
    finally:
        sandbox.run_compile = original


def _names(dirs) -> list[str]:
    return sorted(n for d in dirs for n in kernel_cache._names(d))


def test_a_drop_empties_every_slice_before_the_next_job_and_keeps_nothing_it_overtook(
    redis_url, tmp_path
):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    store = Store.from_url(redis_url, redis_url)
    settings = WorkerSettings(
        redis_url=redis_url, broker_url=redis_url, kernel_cache_dir=str(tmp_path), sandbox="none"
    )
    built = pb.KernelFiles(built={OBJ: b"lib"}, gemm_candidates_benchmarked=3)
    seen = []

    def child(kernels_from):
        seen.append(_names(kernels_from))
        return built

    _compile(store, settings, 1, child)
    _compile(store, settings, 2, child)  # finds the first's object

    def dropped_meanwhile(kernels_from):
        store.pools.drop_kernels("pool")  # `routing_key` of test_full_store's task
        child(kernels_from)
        return pb.KernelFiles(built={OTHER: b"lib"}, gemm_candidates_benchmarked=3)

    cache = run_kernels.kernel_cache_of(settings)
    assert cache is not None
    tenant = cache.tenant_dir("pool", "alice")
    _compile(store, settings, 3, dropped_meanwhile)
    assert _names([tenant]) == [OBJ]  # nothing kept (and nothing dropped before the next job)
    built.built[OBJ] = b"rebuilt"
    _compile(store, settings, 4, child)  # stages nothing, keeps what it built
    assert seen == [[], [OBJ], [OBJ], []]
    with open(os.path.join(tenant, OBJ), "rb") as f:
        assert f.read() == b"rebuilt"
    assert store.counters.per_pool()["pool"]["gemm_candidates_benchmarked"] == 12
    client.flushdb()


def test_gemm_candidates_are_counted_with_the_kernel_cache_off(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    store = Store.from_url(redis_url, redis_url)
    settings = WorkerSettings(
        redis_url=redis_url, broker_url=redis_url, kernel_cache_mb=0, sandbox="none"
    )
    _compile(store, settings, 1, lambda _: pb.KernelFiles(gemm_candidates_benchmarked=5))
    assert store.counters.per_pool()["pool"]["gemm_candidates_benchmarked"] == 5
    client.flushdb()
