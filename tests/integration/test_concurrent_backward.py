"""A training graph's backward compiled beside its forward (issue 28): with
TORCHFARM_CONCURRENT_BACKWARD=1 each compile child has a helper in its sandbox that compiles
the backward while the child compiles the forward; the child's own backward is then a lookup
of the helper's entry (torch_adapter/concurrent_backward.py)."""

import pytest
import torch

import torchfarm
from tests.integration.helpers import log_of
from tests.models import build
from torchfarm.client import backend
from torchfarm.local_farm import LocalFarm

pytestmark = pytest.mark.integration

HELPED = "backward compiled by the helper"


@pytest.fixture(scope="module")
def helped_farm():
    # One compile at once: a compile is two processes here, on a box of two cores.
    env = {"TORCHFARM_CONCURRENT_BACKWARD": "1", "TORCHFARM_WORKER_CONCURRENCY": "1"}
    with LocalFarm(extra_env=env) as farm:
        yield farm


def test_the_backward_compiled_by_the_helper_gives_eagers_gradients(helped_farm):
    model, x = build("transformer", seed=3)
    compiled = torchfarm.compile(model, addr=helped_farm.addr)
    backend.history.clear()
    out = compiled(x)
    out.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert [r.source for r in backend.history] == ["miss"]

    model.zero_grad()
    expected = model(x)
    expected.square().mean().backward()
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, want)
    # The child's backward was the helper's entry, not a compile of its own.
    assert log_of(helped_farm, "worker0").count(HELPED) == 1


def test_an_inference_graph_compiles_and_the_helper_has_nothing_to_do(helped_farm):
    before = log_of(helped_farm, "worker0").count(HELPED)
    model, x = build("mlp", seed=4)
    compiled = torchfarm.compile(model, addr=helped_farm.addr)
    backend.history.clear()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert [r.source for r in backend.history] == ["miss"]
    assert log_of(helped_farm, "worker0").count(HELPED) == before
