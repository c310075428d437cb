"""Which graphs the client may fetch in the background: static graphs of torch's own ops."""

import torch

from tests.unit.dynamo_graphs import captured
from torchfarm.torch_adapter.trace.deferrable import deferrable


@torch.library.custom_op("torchfarm_unit::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_graph_is_deferrable_only_without_a_symbol_in_its_inputs_or_its_values():
    def matmul(x, w):
        return torch.relu(x @ w)

    x, w = torch.randn(4, 8), torch.randn(8, 3)
    assert [deferrable(g) for g in captured(matmul, x, w, dynamic=False)] == [True]
    assert [deferrable(g) for g in captured(matmul, x, w, dynamic=True)] == [False]


def test_a_data_dependent_size_inside_a_static_graph_makes_it_symbolic():
    def nonzero(x):
        return torch.nonzero(x).sum() * 2

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        graphs = captured(nonzero, torch.tensor([0.0, 1.0, 2.0]), dynamic=False)
    assert [deferrable(g) for g in graphs] == [False]


def test_a_static_graph_calling_a_custom_operator_blocks():
    """Its local compile may raise the error on which Dynamo splits a graph."""

    def custom(x):
        return torch.ops.torchfarm_unit.twice(torch.sin(x))

    assert [deferrable(g) for g in captured(custom, torch.randn(4), dynamic=False)] == [False]


def test_calls_made_for_their_effect_leave_a_static_graph_deferrable():
    """Grad mode switched inside the graph (HF's rotary embeddings): its calls have no value."""

    def no_grad_inside(x):
        with torch.no_grad():
            scale = x.abs().amax()
        return x * scale

    graphs = captured(no_grad_inside, torch.randn(4, requires_grad=True), dynamic=False)
    assert any(n.target is torch._C._set_grad_enabled for g in graphs for n in g.graph.nodes), (
        "the graph should switch grad mode itself"
    )
    assert [deferrable(g) for g in graphs] == [True]
