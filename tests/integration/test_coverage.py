"""Model coverage (bench/coverage) in CI: architectures through the session farm, a miss and
then a hit in a fresh process, each equal to eager. The farm may add no failure of its own.

CI runs one architecture for each mechanism the farm must carry (a custom operator, in-place
buffer updates, graph breaks, an RNN), at the suite's "tiny" scale (one transformer layer,
2 RNN steps: the same mechanisms, fewer kernels), and compares the farm with eager only: local
torch.compile would double each one's compiles. `TORCHFARM_COVERAGE=all` runs all 20 here
against local torch.compile too, and `make coverage` runs all 20 into docs/coverage.md.
torch.cond and a custom autograd.Function, whose graphs PyTorch cannot save (the suite's
PYTORCH_LIMITS), are checked below on small modules of their own."""

import os
import sys

import pytest
import torch

import torchfarm
from tests.integration.helpers import HERE, OP_LIBRARIES, TOKENS, run_python, session_farm
from torchfarm.client import backend

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench", "coverage"))
from suite import ARCHITECTURES, PHASES, PYTORCH_LIMITS, farm_failures, run_architecture  # noqa: E402

pytestmark = pytest.mark.integration
IN_CI = ("mixtral-moe", "batchnorm-train", "graph-break", "lstm-lm")
ALL = os.environ.get("TORCHFARM_COVERAGE") == "all"


@pytest.fixture(scope="module")
def farm():
    """The session farm's kind whose compile children import the MoE's custom operator."""
    with session_farm(TORCHFARM_OP_LIBRARIES=OP_LIBRARIES) as f:
        yield f


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.xfail(reason=PYTORCH_LIMITS[name], strict=True))
        if name in PYTORCH_LIMITS
        else name
        for name in (ARCHITECTURES if ALL else IN_CI)
    ],
)
def test_the_farm_compiles_it_like_torch_compile(farm, name):
    row = run_architecture(
        name, farm.addr, TOKENS["alice"], scale="tiny", local=ALL, python=run_python
    )
    for phase in PHASES:  # even a fallback must give eager's results
        assert all(run["phases"][phase]["farm"]["ok"] for run in (row["first"], row["second"]))
    assert not farm_failures(row), farm_failures(row)
    if ALL:
        for phase in PHASES:
            local = row["first"]["phases"][phase]["local"]
            assert local["ok"], f"{phase}: local torch.compile failed: {local.get('error')}"
            assert row["first"]["phases"][phase]["farm"]["diff_to_local"] <= 1e-3


class Cond(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.linear(x)
        return torch.cond(h.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (h,))


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        return grad * 3


class CustomFunction(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return Scale.apply(self.linear(x)).relu()


@pytest.mark.parametrize("module", [Cond, CustomFunction])
def test_a_graph_pytorch_cannot_save_compiles_locally_and_equals_eager(farm, module):
    """The farm's artifact is a saved AOTAutograd entry, which PyTorch cannot make of a graph
    with these higher-order ops under autograd: the farm answers with an error and the client
    compiles the graph locally, with eager's results. Should PyTorch lift the limit, the graph
    comes from the farm and this test fails: then move the architecture into IN_CI."""
    torch.manual_seed(0)
    model, x = module(), torch.randn(4, 8)
    expected = model(x)
    expected.sum().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    backend.history.clear()
    out = torchfarm.compile(model, addr=farm.addr, token=TOKENS["alice"])(x)
    out.sum().backward()
    torch.testing.assert_close(out, expected)
    for got, want in zip((p.grad for p in model.parameters()), expected_grads):
        torch.testing.assert_close(got, want)
    assert "local" in {r.source for r in backend.history}, backend.history
