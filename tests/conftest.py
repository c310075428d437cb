"""Shared by both tiers: a private, empty local Inductor cache, and Dynamo reset per test.
torch is imported by the tests, not here: pytest-xdist's controller loads this file and runs
no test, and importing torch there delayed the start of its workers by its import (~2.5 s)."""

import os
import tempfile

# The test process's own local Inductor cache starts empty and is private to the run.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchfarm-test-inductor-")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo():
    import torch

    from torchfarm.client import backend

    torch._dynamo.reset()
    backend.history.clear()
    yield
    torch._dynamo.reset()
