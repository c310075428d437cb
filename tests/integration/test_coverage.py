"""Model coverage (bench/coverage) in CI: architectures through the session farm, a miss and
then a hit in a fresh process, each equal to eager and to local torch.compile. The farm may
add no failure of its own.

CI runs one architecture for each mechanism the farm must carry (a custom operator, torch.cond
subgraphs, a custom autograd.Function, in-place buffer updates, graph breaks, an RNN), which
keeps the suite inside CI's time; TORCHFARM_COVERAGE=all runs all 20 here, and `make
coverage` runs all 20 into docs/coverage.md."""

import os
import sys

import pytest

from tests.integration.helpers import HERE, TOKENS

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench", "coverage"))
from suite import ARCHITECTURES, PHASES, PYTORCH_LIMITS, farm_failures, run_architecture  # noqa: E402

pytestmark = pytest.mark.integration
IN_CI = (
    "mixtral-moe",
    "torch-cond",
    "custom-function",
    "batchnorm-train",
    "graph-break",
    "lstm-lm",
)
CHOSEN = list(ARCHITECTURES) if os.environ.get("TORCHFARM_COVERAGE") == "all" else IN_CI


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.xfail(reason=PYTORCH_LIMITS[name], strict=True))
        if name in PYTORCH_LIMITS
        else name
        for name in CHOSEN
    ],
)
def test_the_farm_compiles_it_like_local_torch_compile(farm, name):
    row = run_architecture(name, farm.addr, TOKENS["alice"])
    for phase in PHASES:  # even a fallback must give eager's results
        assert all(run["phases"][phase]["farm"]["ok"] for run in (row["first"], row["second"]))
    assert not farm_failures(row), farm_failures(row)
    for phase in PHASES:
        local = row["first"]["phases"][phase]["local"]
        assert local["ok"], f"{phase}: local torch.compile failed: {local.get('error')}"
        assert row["first"]["phases"][phase]["farm"]["diff_to_local"] <= 1e-3
