"""Regional compilation's split (torch_adapter/regions.py) on Dynamo's real graphs: blocks of
one shape become one payload whatever their position, the stitched graph computes what the
model does (forward and gradients, each region through AOTAutograd on its own), and graphs
with nothing repeated or with autocast are left whole."""

import hashlib

import torch
from torch import nn

from tests.models import Stack, build
from torchfarm.compiler import serialize
from torchfarm.torch_adapter import regions


def _graph(model: nn.Module, *inputs: torch.Tensor) -> torch.fx.GraphModule:
    captured = []

    def capture(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture)(*inputs)
    assert len(captured) == 1
    return captured[0]


def _digest(region: regions.Region) -> str:
    return hashlib.sha256(serialize.dumps(region.gm)).hexdigest()


def test_blocks_of_one_shape_become_one_payload_between_the_code_around_them():
    model, x = build("stack3")
    split = regions.split(_graph(model, x))
    assert split is not None
    assert [r.block.removeprefix("L['self'].") for r in split.regions] == [
        "",
        "layers.0",
        "layers.1",
        "layers.2",
        "",
    ]
    digests = [_digest(r) for r in split.regions]
    assert digests[1] == digests[2] == digests[3]
    assert len(set(digests)) == 3
    # a sibling of another depth has the same three payloads
    other, y = build("stack2")
    sibling = regions.split(_graph(other, y))
    assert sibling is not None
    assert {_digest(r) for r in sibling.regions} == set(digests)
    for region in split.regions:  # every region returns a tuple, as a backend's graph must
        output = next(n for n in region.gm.graph.nodes if n.op == "output")
        assert isinstance(output.args[0], tuple)


def test_the_stitched_regions_compute_the_models_outputs_and_gradients():
    model, x = build("stack3")
    model.train()
    expected = model(x)
    expected.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    def per_region(gm, example_inputs):
        split = regions.split(gm)
        assert split is not None
        # each region through AOTAutograd on its own, as the farm compiles it
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        aot = aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))
        return split.stitched([aot(r.gm, serialize.example_inputs(r.gm)) for r in split.regions])

    torch._dynamo.reset()
    out = torch.compile(model, backend=per_region)(x)
    out.sum().backward()
    torch.testing.assert_close(out, expected)
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g)


def test_torchs_own_transformer_layers_are_blocks_too():
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
    split = regions.split(_graph(encoder, torch.randn(2, 8, 32)))
    assert split is not None
    layers = [r for r in split.regions if r.block]
    assert len(layers) == 3
    # the first layer takes the graph's input, which needs no gradient: a compile of its own
    assert _digest(layers[0]) != _digest(layers[1]) == _digest(layers[2])


def test_a_graph_without_repeated_blocks_is_left_whole():
    model, x = build("transformer")
    assert regions.split(_graph(model, x)) is None
    one = Stack(depth=1)
    assert regions.split(_graph(one, torch.randn(2, 16, 16))) is None


class _Autocast(nn.Module):
    """Autocast around the blocks, or (`inside`) within the code before them only."""

    def __init__(self, inside: bool):
        super().__init__()
        self.stack, self.inside = Stack(depth=2), inside

    def forward(self, x):
        if self.inside:
            with torch.autocast("cpu", enabled=False):
                x = x * 2
            return self.stack(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.stack(x)


def test_autocast_across_blocks_leaves_the_graph_whole_and_within_one_region_does_not():
    x = torch.randn(2, 16, 16)
    assert regions.split(_graph(_Autocast(inside=False), x)) is None
    assert regions.split(_graph(_Autocast(inside=True), x)) is not None
