"""`torchfarm prepare` against a real farm: a job's first step run on fake tensors in one
process makes the job's real first process (another process, empty local caches) a farm hit
for every graph, with outputs and gradients equal to eager."""

import os
import re
import subprocess
import sys
import tempfile

import pytest

from tests.integration.helpers import HERE, TOKENS, run_client

pytestmark = pytest.mark.integration


def test_a_prepared_jobs_first_process_hits_every_graph(farm):
    env = dict(
        os.environ,
        TORCHFARM_ADDR=farm.addr,
        TORCHFARM_TOKEN=TOKENS["bob"],  # another tenant than the job's: shared entries
        TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(),
    )
    prepared = subprocess.run(
        [sys.executable, "-m", "torchfarm", "prepare", "prepared_job:first_step"],
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
    assert graphs >= 2 and int(summary.group(2)) + int(summary.group(3)) == graphs, table

    job = run_client(farm, "prepared_job.py", tenant="alice")
    assert job["sources"] == ["hit"] * graphs, job
    assert job["max_diff"] < 1e-4, job
