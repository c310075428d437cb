"""Fixtures: one real embedded farm (redis-server, gateway, Celery worker) per session."""

import os
import subprocess

import pytest

from tests.integration.helpers import TEST_FARM_DEFAULTS, session_farm
from torchfarm.cache.store import Store

# The tier tests the backend's own paths (a second compile in one process is a farm hit, not a
# restored package); the skip's own tests turn it on (test_skip_*.py).
os.environ.setdefault("TORCHFARM_SKIP_TRACING", "0")

# What every farm of the tier (LocalFarm, `torchfarm up`: both take this process's
# environment) runs with unless a test says otherwise, to spare the 2-core CI machine work no
# test here looks at:
# - no pool kernel cache: after each shared compile the pool builds the compile's C++ sources
#   in the background (workers/kernel_builder.py), 8% of CI's CPU, which only
#   test_kernel_cache.py asserts on (its farm turns it on: helpers.KERNEL_CACHE_ON);
# - those builds at normal priority, not idle: on the saturated CI machine an idle build waits
#   for every other process, and a test that waits for the pool's builds waited minutes
#   (test_kernel_cache.py's hostile payload to the pool: 327 s at idle, 27 s at normal, on the
#   2-core box at load 4); workers/test_idle_builds.py checks the idle default on a builder of
#   its own;
# - one warm compile child instead of one per compile slot (2 here): a farm's unused warm
#   children cost ~4.5 CPU-s each (torch's import, Inductor's ISA checks) and every farm ends
#   with them idle; test_warm_children.py and the session farm (`farm`, below) keep the
#   default (-1), test_ready.py checks it.
for _name, _value in TEST_FARM_DEFAULTS.items():
    os.environ.setdefault(_name, _value)


@pytest.fixture(scope="session")
def farm():
    # A warm compile parent for each of its 2 compile slots (the worker's default), not one:
    # this farm's clients send graphs at once (prepare, DDP's buckets), and a compile that
    # finds no parent idle starts one (~5 s; kept after it since 2026-11-29, until idle 60 s:
    # workers/child_pool.py); when it was ended after it, with one kept, every compile of such
    # a burst but the first started one (test_prepare + test_parallel_graphs: 206-218 -> 147
    # CPU-s). An idle second parent costs 4-8 CPU-s a farm.
    with session_farm(TORCHFARM_WARM_CHILDREN="-1") as f:
        yield f


@pytest.fixture
def store(farm) -> Store:
    return farm.store()


@pytest.fixture
def worker_isa_verdict(monkeypatch, tmp_path):
    """The ISA probe's verdict, handed to the children a test starts without a worker
    (workers/sandbox.child_command: compile parents, kernel builders) as a worker hands it
    (workers/isa_verdict.py): the toolchain's kept agreement, where a farm of this toolchain
    has run, else one probe here. Without it each such child probes for itself at its start
    (Inductor's ISA test programs, ~8-12 CPU-s on the 2-core box)."""
    from torchfarm.workers import isa_verdict, toolchain

    marker = str(tmp_path / "children-may-trust-flags")
    monkeypatch.setenv("TORCHFARM_ISA_PROBE_MARKER", marker)
    kept = toolchain.store_dir() + toolchain.ISA_VERDICT_SUFFIX
    if not isa_verdict.recall(marker, kept):
        isa_verdict.settle(marker, kept)


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """Fresh Inductor cache dirs for in-process compiles (`with caches():`), kept, not deleted
    on leaving: torch 2.11 keeps the C++ modules it loaded by their key, and a later compile of
    the same source in this process (another test's, another module's) finds its library in
    an earlier dir, which must still be there."""
    from torch._inductor.utils import fresh_cache

    parent = str(tmp_path_factory.mktemp("inductor"))
    return lambda: fresh_cache(dir=parent, delete=False)


@pytest.fixture
def compiler_log(tmp_path):
    """A PATH whose g++/gcc/c++ log every call before running the real compiler."""
    bindir, log = tmp_path / "bin", tmp_path / "cc.log"
    bindir.mkdir()
    for name in ("g++", "gcc", "c++", "cc"):
        real = subprocess.run(["which", name], capture_output=True, text=True).stdout.strip()
        if real:
            script = bindir / name
            script.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {real} "$@"\n')
            script.chmod(0o755)
    return str(bindir), log


# The slowest files first: `--dist loadfile` hands files to the two workers in collection order
# (with --no-loadscope-reorder, which the Makefile passes: else xdist orders them by their
# number of tests), and a worker takes its next file while its last two tests run, so the
# tier ends when its last files do: every file is here, longest first, the short ones last
# for the two workers to end together. Ordered by each file's summed durations in a run of the
# tier alone (2026-11-27, `--durations=0`; the last four from CI's durations; the files in
# folders, the unit tier's tests that start processes, from their unit-tier durations).
SLOWEST_FIRST = (
    "test_zoo.py",
    "test_skip_differential.py",
    "test_coverage.py",
    "test_farm.py",
    "test_gateways.py",
    "test_skip_tracing.py",
    "test_faults.py",
    "test_export.py",
    "test_precompiled_headers.py",
    "test_program.py",
    "test_attacks.py",
    "test_blob_store.py",
    "test_kernel_cache.py",
    "test_ready.py",
    "test_prepare.py",
    "test_stalls.py",
    "workers/test_child_pool.py",
    "workers/test_kernel_cache.py",
    "test_cluster.py",
    "test_limits.py",
    "test_sandbox.py",
    "test_concurrent_backward.py",
    "test_nowait.py",
    "test_parallel_graphs.py",
    "test_warm_children.py",
    "workers/test_warm_compile.py",
    "torch_adapter/test_load_prewarm.py",
    "torch_adapter/test_gpu_benchmark_lock.py",
    "torch_adapter/test_gemm_problems.py",
    "client/test_deferred.py",
    "test_signing.py",
    "test_operations.py",
    "test_doctor.py",
    "test_guard_entries.py",
    "test_versions.py",
    "test_up.py",
    "test_tenant_limits.py",
    "test_isa_probe.py",
    "test_availability.py",
    "torch_adapter/test_compile_workers.py",
    "compiler/test_serialize.py",
    "test_imports.py",
    "client/test_exit.py",
    "torch_adapter/test_static_inputs.py",
    "torch_adapter/test_precompiled_headers.py",
    "test_main.py",
    "workers/test_sandbox.py",
    "torch_adapter/test_triton_kernels.py",
    "test_get.py",
    "test_tls.py",
    "test_device_index.py",
    "test_cache.py",
    "test_load.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    here = os.path.dirname(__file__)
    items.sort(key=lambda item: rank.get(os.path.relpath(item.path, here), len(rank)))  # stable
