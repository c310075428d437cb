"""A training graph's backward compiled beside its forward (issue 28): with
TORCHFARM_CONCURRENT_BACKWARD=1 each compile child has a helper in its sandbox that compiles
the backward while the child compiles the forward; the child's own backward is then a lookup
of the helper's entry (torch_adapter/compile/concurrent_backward.py). The GEMM candidates the helper
benchmarks are counted with the child's, the kernel cache off (the tier's default) or on."""

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


def _helped_step(farm: LocalFarm, name: str, seed: int) -> None:
    """One training step of model `name` on the farm (a miss): eager's output and gradients,
    and the child's backward the helper's entry, not a compile of its own (a lookup: the
    worker logs it from the child's `fxgraph_cache_hit` count)."""
    before = log_of(farm, "worker0").count(HELPED)
    model, x = build(name, seed=seed)
    compiled = torchfarm.compile(model, addr=farm.addr)
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
    assert log_of(farm, "worker0").count(HELPED) == before + 1


def test_the_backward_compiled_by_the_helper_gives_eagers_gradients(helped_farm):
    _helped_step(helped_farm, "transformer", seed=3)


def test_activations_the_forward_stores_channels_last_reach_the_helper(helped_farm):
    """Inductor's layout optimization stores the activations a convolution's backward needs
    channels-last (here oneDNN's CPU; on a GPU a graph of fewer than 300 nodes per
    convolution: a ViT's patch embedding), and AOTAutograd restrides the backward's inputs to
    them: the child sends the helper its forward's strides, so the keys still agree."""
    _helped_step(helped_farm, "cnn", seed=5)


def test_an_inference_graph_compiles_and_the_helper_has_nothing_to_do(helped_farm):
    before = log_of(helped_farm, "worker0").count(HELPED)
    model, x = build("mlp", seed=4)
    compiled = torchfarm.compile(model, addr=helped_farm.addr)
    backend.history.clear()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert [r.source for r in backend.history] == ["miss"]
    assert log_of(helped_farm, "worker0").count(HELPED) == before


class _Bmm(torch.nn.Module):
    def forward(self, a, b):
        return torch.bmm(a, b).relu()


def _benchmarked(farm, training: bool) -> int:
    """The GEMM candidates a max-autotune compile of _Bmm benchmarked, from the farm's counter."""

    def counted() -> int:
        return int(farm.store().counters.farm().get("gemm_candidates_benchmarked", 0))

    before = counted()
    a = torch.randn(8, 64, 96, requires_grad=training)
    b = torch.randn(8, 96, 64, requires_grad=training)
    torch._dynamo.reset()
    backend.history.clear()
    compiled = torchfarm.compile(_Bmm(), mode="max-autotune", addr=farm.addr)
    with torch.set_grad_enabled(training):
        out = compiled(a, b)
    if training:
        out.sum().backward()
    assert [r.source for r in backend.history] == ["miss"]
    return counted() - before


def test_the_gemm_candidates_the_helper_benchmarked_are_counted(helped_farm):
    forward = _benchmarked(helped_farm, training=False)  # the helper has nothing to do
    assert forward > 0
    before = log_of(helped_farm, "worker0").count("backward compiled by the")
    # The backward's bmm is benchmarked by the helper only: the child's backward is a lookup
    # of its entry or (as here, max-autotune on the CPU: the lookup misses) a compile that
    # finds the helper's timings in their shared cache dir. Without the helper's report the
    # two counts were equal.
    assert _benchmarked(helped_farm, training=True) > forward
    assert log_of(helped_farm, "worker0").count("backward compiled by the") == before + 1


def test_where_the_childs_lookup_missed_the_log_says_which_key_details_differed(helped_farm):
    """Under reduce-overhead (and max-autotune) Inductor's `cudagraphs` flag is on, in the
    backward's key too, and the child's forward turns it off (a CPU graph): the helper, which
    compiled no forward, keyed its backward with it on. The worker's log says so."""
    before = log_of(helped_farm, "worker0").count("backward compiled by the child")
    model, x = build("mlp", seed=6)
    compiled = torchfarm.compile(model, mode="reduce-overhead", addr=helped_farm.addr)
    backend.history.clear()
    compiled(x).sum().backward()
    assert [r.source for r in backend.history] == ["miss"]
    log = log_of(helped_farm, "worker0")
    assert log.count("backward compiled by the child") == before + 1
    said = log.split("backward compiled by the child")[-1].split(" [request")[0]
    assert said == (
        " (its lookup missed: 1 of the key's details differ: fx_kwargs[cudagraphs]; "
        "fx_kwargs[cudagraphs]: helper 'BoxedBool(value=True)', child 'BoxedBool(value=False)')"
    )
