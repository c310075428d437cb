"""Model coverage (bench/coverage): every architecture through the session farm, a miss and
then a hit in a fresh process, each equal to eager and to local torch.compile. The farm may
add no failure of its own; `make coverage` writes the same runs into docs/coverage.md."""

import os
import sys

import pytest

from conftest import HERE, TOKENS

sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench", "coverage"))
from suite import ARCHITECTURES, PHASES, farm_failures, run_architecture  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_the_farm_compiles_it_like_local_torch_compile(farm, name):
    row = run_architecture(name, farm.addr, TOKENS["alice"])
    assert not farm_failures(row), farm_failures(row)
    for phase in PHASES:
        local = row["first"]["phases"][phase]["local"]
        assert local["ok"], f"{phase}: local torch.compile failed: {local.get('error')}"
        assert row["first"]["phases"][phase]["farm"]["diff_to_local"] <= 1e-3
