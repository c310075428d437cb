"""The worker's startup self-check builds this machine's real sandbox (bwrap under prlimit)
and refuses to start where it cannot (the command's pure parts: tests/unit/workers/; a
sandboxed compile: tests/integration/test_sandbox.py)."""

import shutil

import pytest

from torchfarm.settings import WorkerSettings
from torchfarm.workers import sandbox


@pytest.mark.skipif(not shutil.which("bwrap"), reason="bubblewrap is not installed")
def test_the_worker_refuses_to_start_without_a_sandbox_that_builds():
    sandbox.check_available(WorkerSettings())  # this machine's sandbox holds
    with pytest.raises(SystemExit, match="cannot build the compile sandbox") as e:
        sandbox.check_available(WorkerSettings(sandbox_binds=("/nonexistent/toolchain",)))
    assert "\n" not in str(e.value)
