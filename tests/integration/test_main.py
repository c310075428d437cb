"""`python -m torchfarm` takes the working directory off sys.path exactly once."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("where", ["checkout", "parent"])
def test_the_cli_starts_with_the_working_directory_also_on_pythonpath(where):
    # bench/gpu/run.sh runs with PYTHONPATH=$PWD: under -P that entry comes first, and the
    # CLI once re-executed itself forever on seeing it there.
    cwd = ROOT if where == "checkout" else os.path.dirname(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "torchfarm", "--help"],
        cwd=cwd,
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Usage" in proc.stdout
