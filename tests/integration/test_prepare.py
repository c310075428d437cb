"""`torchfarm prepare` against a real farm: a job's first step run on fake tensors in one
process makes the job's real first process (another process, empty local caches) a farm hit
for every graph, with outputs and gradients equal to eager; for a 2-rank DDP job (gloo,
torchrun), prepared as rank 0 of 2, both real ranks hit every bucket graph and the farm
compiles nothing more."""

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

from tests.integration.helpers import HERE, TOKENS, run_client
from torchfarm.local_farm import free_port

pytestmark = pytest.mark.integration


def _prepare(farm, entry: str, *args: str, env: dict | None = None) -> int:
    """`torchfarm prepare ENTRY ARGS` as tenant bob (another tenant than the job's: shared
    entries); the number of graphs it prepared, every one of them."""
    env = dict(
        os.environ,
        TORCHFARM_ADDR=farm.addr,
        TORCHFARM_TOKEN=TOKENS["bob"],
        TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(),
        **(env or {}),
    )
    prepared = subprocess.run(
        [sys.executable, "-m", "torchfarm", "prepare", entry, *args],
        cwd=os.path.join(HERE, "clients"),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr[-3000:]
    table = prepared.stdout
    summary = re.search(r"(\d+) graphs: (\d+) hits, (\d+) compiled, 0 failed", table)
    assert summary and "stopped early" not in table, table
    graphs = int(summary.group(1))
    assert int(summary.group(2)) + int(summary.group(3)) == graphs, table
    return graphs


def test_a_prepared_jobs_first_process_hits_every_graph(farm):
    graphs = _prepare(farm, "prepared_job:first_step")
    assert graphs >= 2

    job = run_client(farm, "prepared_job.py", tenant="alice")
    assert job["sources"] == ["hit"] * graphs, job
    assert job["max_diff"] < 1e-4, job


def test_a_prepared_ddp_jobs_ranks_compile_nothing(farm, tmp_path):
    # torchrun gives each rank OMP_NUM_THREADS=1, and the CPU target's threads are part of
    # the key (Inductor's C++ code depends on them): prepared with the ranks' threads
    graphs = _prepare(farm, "ddp_job:first_step", "--world-size", "2", env={"OMP_NUM_THREADS": "1"})
    assert graphs >= 6  # one per bucket: BlockMLP's 6 blocks
    compiles = farm.store().counters.farm().get("compiles", 0)

    env = dict(
        os.environ,
        TORCHFARM_ADDR=farm.addr,
        TORCHFARM_TOKEN=TOKENS["alice"],
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),  # the ranks share it, as on a machine
        OUT_DIR=str(tmp_path),
    )
    job = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            f"--master-port={free_port()}",
            os.path.join(HERE, "clients", "ddp_job.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["sources"] == ["hit"] * graphs, (rank, result)
        assert result["max_diff"] < 1e-4, (rank, result)
    assert farm.store().counters.farm().get("compiles", 0) == compiles
