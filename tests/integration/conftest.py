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


# The slowest files first (per-file sums of the tier's --durations on two workers, alone on the
# 2-core machine, 2026-11-25; coverage before it stopped compiling locally): `--dist loadfile`
# hands files to the two workers in collection order, so a long file collected late ran on one
# worker at the end while the other had nothing left.
SLOWEST_FIRST = (
    "test_coverage.py",  # 1088 s (now about half)
    "test_skip_tracing.py",  # 630 s
    "test_skip_differential.py",  # 598 s
    "test_farm.py",  # 549 s
    "test_gateways.py",  # with test_long_compiles.py's tests 411 s
    "test_kernel_cache.py",  # 278 s
    "test_faults.py",  # 263 s
    "test_ready.py",  # 210 s
    "test_precompiled_headers.py",  # 184 s
    "test_parallel_graphs.py",
    "test_stalls.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as before
