"""The gateway, the CLI and the package itself import neither torch nor the worker: the
gateway stays small and fast to start, and a worker's Celery task is the worker's alone."""

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["torchfarm", "torchfarm.cli", "torchfarm.gateway.server"])
def test_module_imports_neither_torch_nor_the_worker(module):
    probe = (
        f"import sys, json, {module}; "
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m == 'torch' or m.startswith(('torch.', 'torchfarm.workers')))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == []


def test_the_decorator_still_loads_on_first_use():
    probe = "import torchfarm, sys; f = torchfarm.compile; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "True"
