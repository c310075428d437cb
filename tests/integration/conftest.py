"""Fixtures: one real embedded farm (redis-server, gateway, Celery worker) per session."""

import os
import subprocess

import pytest

from tests.integration.helpers import ADMIN_TOKEN, OP_LIBRARIES, RECHECK_ENV, TOKENS
from torchfarm.cache.store import Store
from torchfarm.gateway.auth import hash_token
from torchfarm.local_farm import LocalFarm

# The tier tests the backend's own paths (a second compile in one process is a farm hit, not a
# restored package); the skip's own tests turn it on (test_skip_*.py).
os.environ.setdefault("TORCHFARM_SKIP_TRACING", "0")


@pytest.fixture(scope="session")
def farm():
    tenants = ",".join(f"{name}:{hash_token(tok)}" for name, tok in TOKENS.items())
    # JSON log lines: test_operations checks that a request id follows a compile in them.
    with LocalFarm(
        tenants=tenants,
        admins=f"ops:{hash_token(ADMIN_TOKEN)}",
        extra_env={
            "TORCHFARM_LOG_FORMAT": "json",
            # the coverage suite's MoE model calls transformers' custom grouped-mm operator
            "TORCHFARM_OP_LIBRARIES": OP_LIBRARIES,
            **RECHECK_ENV,
        },
    ) as f:
        yield f


@pytest.fixture
def store(farm) -> Store:
    return farm.store()


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
# number of tests), so a long file collected late runs on one worker at the end while the other
# has nothing left. Ordered by their tests' durations in CI (2026-11-27, the 25 slowest) and
# the earlier per-file sums (2026-11-25).
SLOWEST_FIRST = (
    "test_skip_differential.py",
    "test_coverage.py",
    "test_farm.py",
    "test_skip_tracing.py",
    "test_gateways.py",
    "test_kernel_cache.py",
    "test_faults.py",
    "test_ready.py",
    "test_precompiled_headers.py",
    "test_prepare.py",
    "test_stalls.py",
    "test_export.py",
    "test_parallel_graphs.py",
    "test_cluster.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as before
