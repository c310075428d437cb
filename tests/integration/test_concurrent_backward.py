"""A training graph's backward compiled beside its forward (issue 28): with
TORCHFARM_CONCURRENT_BACKWARD=1 each compile child has a helper in its sandbox that compiles
the backward while the child compiles the forward; the child's own backward is then a lookup
of the helper's entry (torch_adapter/compile/concurrent_backward.py). The GEMM candidates the helper
benchmarks are counted with the child's, the kernel cache off (the tier's default) or on.
Where the two backwards' keys differ, the child ends the helper at its key instead of waiting
for its compile; under CUDA graphs the helper sets the boxes the child's forward sets."""

import dataclasses
import json
import os

import pytest
import torch

import torchfarm
from tests.integration.helpers import log_of
from tests.integration.torch_adapter.test_forward_strides import _training_payload
from tests.models import build
from torchfarm.client import backend
from torchfarm.local_farm import LocalFarm
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter.compile.concurrent_backward import Key
from torchfarm.workers import compile_child

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
    worker logs it from the child's `fxgraph_cache_hit` count). The miss's timings say when
    the child reached its backward, how long it waited for the helper's and loaded it, and,
    on the child's clock, when the helper began, lowered and compiled that backward: in that
    order, and done by the time the child stopped waiting."""
    before = log_of(farm, "worker0").count(HELPED)
    timings = _eagers_step(farm, name, seed)
    assert log_of(farm, "worker0").count(HELPED) == before + 1
    parts = [timings[f"backward_{part}_s"] for part in ("at", "wait", "load")]
    assert parts[0] > 0 and parts[2] > 0
    assert sum(parts) <= timings["compile_s"]
    helper = [timings[f"helper_{part}_s"] for part in ("began", "lowered", "compiled")]
    assert 0 < helper[0] <= helper[1] <= helper[2] <= parts[0] + parts[1]


def _eagers_step(farm: LocalFarm, name: str, seed: int, mode: str = "default") -> dict[str, float]:
    """One training step of model `name` on the farm (a miss): eager's output and gradients;
    the miss's timings."""
    model, x = build(name, seed=seed)
    compiled = torchfarm.compile(model, mode=mode, addr=farm.addr)
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
    return backend.history[0].timings


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
    """The GEMM candidates a max-autotune compile of _Bmm benchmarked (Inductor's max_autotune
    option, without CUDA graphs), from the farm's counter."""

    def counted() -> int:
        return int(farm.store().counters.farm().get("gemm_candidates_benchmarked", 0))

    before = counted()
    a = torch.randn(8, 64, 96, requires_grad=training)
    b = torch.randn(8, 96, 64, requires_grad=training)
    torch._dynamo.reset()
    backend.history.clear()
    compiled = torchfarm.compile(_Bmm(), options={"max_autotune": True}, addr=farm.addr)
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
    # of its entry. Without the helper's report the two counts were equal.
    assert _benchmarked(helped_farm, training=True) > forward
    assert log_of(helped_farm, "worker0").count("backward compiled by the") == before + 1


def test_under_cuda_graphs_the_helpers_backward_is_the_childs(helped_farm):
    """Under reduce-overhead (and max-autotune) Inductor's `cudagraphs` box is in the backward's
    key, and the child's forward turns it off (here a CPU graph): the helper, which compiles no
    forward, sets it as that forward would, so the keys agree and the backward is the helper's
    (before, the helper had nothing to do under CUDA graphs); the step is eager's."""
    before = log_of(helped_farm, "worker0").count(HELPED)
    _eagers_step(helped_farm, "mlp", seed=6, mode="reduce-overhead")
    assert log_of(helped_farm, "worker0").count(HELPED) == before + 1


class _Helper:
    """A helper as the child sees it that never ends by itself: it records how it was ended."""

    def __init__(self, exited: int | None = None) -> None:
        self.returncode, self.ends = exited, []

    def poll(self) -> int | None:
        return self.returncode

    def wait(self) -> int:
        assert self.returncode is not None, "waited for a helper that never ends"
        return self.returncode  # reaped

    def kill(self) -> None:
        self.ends.append("killed")
        self.returncode = -9


def _compile_beside(
    helper: _Helper, name: str, caches, their_key: Key | None = None
) -> pb.Artifact:
    """The child's compile of a training step of model `name`, beside `helper`, in-process,
    the helper's key `their_key` in their cache dir, a fresh one of `caches` (the fixture)."""
    payload, options = _training_payload(*build(name, seed=5))
    request = pb.CompileChildRequest(graph=payload, options=options)
    with caches():
        if their_key is not None:
            compile_child._leave(
                os.environ["TORCHINDUCTOR_CACHE_DIR"],
                compile_child.HELPER_KEY,
                json.dumps(dataclasses.asdict(their_key)).encode(),
            )
        return compile_child._compile(
            compile_child._arguments([]), request, helper, lambda strides: None
        )


def test_where_the_helpers_key_differs_the_child_ends_it_and_compiles_the_backward(caches):
    """The helper's key is there before its compile: the child compares it with its own at
    its backward, and a different one ends the helper then, not after the helper's whole
    compile (this helper never ends by itself). The worker's log says why it missed."""
    theirs = Key("f" + "0" * 51, ["[aaaa] fx_kwargs[cudagraphs]: BoxedBool(value=True)"])
    helper = _Helper()
    artifact = _compile_beside(helper, "cnn", caches, theirs)
    assert helper.ends == ["killed"]
    assert artifact.backward == "child"
    assert "of the key's details differ" in artifact.backward_miss
    assert artifact.backward_miss.endswith("; the helper was ended at its key, not waited for")


def test_a_helper_that_exited_without_its_key_never_holds_the_child(caches):
    helper = _Helper(exited=1)
    artifact = _compile_beside(helper, "transformer", caches)
    assert helper.ends == []  # neither waited for nor killed: it had gone
    assert (artifact.backward, artifact.backward_miss) == (
        "child",
        "the helper left no key: its backward failed or bypassed the FX graph cache "
        "(its exit status 1); the helper was ended at its key, not waited for",
    )
