"""Graph serialization: deterministic, metadata only (across processes and paths:
tests/integration/compiler/test_serialize.py)."""

import copyreg
import io
import os
import subprocess

import pytest
import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._graph_pickler import GraphPickler
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._sympy.functions import FloorDiv

from torchfarm.compiler import serialize
from torchfarm.contract.cache_key import public_key
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter.trace import graph_pickler


def _capture(model, x, dynamic=False):
    captured = {}

    def backend(gm, example_inputs):
        captured["payload"] = serialize.dumps(gm)
        captured["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, dynamic=dynamic)(x)
    return captured


def test_payload_carries_no_weights():
    model = torch.nn.Linear(256, 256)
    payload = _capture(model, torch.randn(4, 256))["payload"]
    weight_bytes = model.weight.detach().numpy().tobytes()
    assert len(payload) < len(weight_bytes) / 10
    assert weight_bytes[:64] not in payload
    assert b"/" + os.path.basename(__file__).encode() not in payload


def test_round_trip_rebuilds_graph_with_fake_inputs():
    captured = _capture(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()), torch.randn(3, 8), dynamic=True
    )
    gm = serialize.loads(captured["payload"])
    inputs = serialize.example_inputs(gm)
    assert [type(i).__name__ for i in inputs] == [
        type(n.meta["example_value"]).__name__
        for n in captured["gm"].graph.nodes
        if n.op == "placeholder"
    ]
    assert serialize.op_counts(gm) == serialize.op_counts(captured["gm"])


def test_loads_refuses_non_graph_pickle():
    import pickle

    with pytest.raises(ValueError, match="not a GraphModule"):
        serialize.loads(pickle.dumps({"a": 1}))


def test_size_hints_travel_beside_the_payload():
    captured = []

    def capture(gm, example_inputs):
        captured.append((serialize.dumps(gm), serialize.size_hints(gm)))
        return gm.forward

    for batch in (8, 16):
        torch._dynamo.reset()
        model = torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.ReLU())
        torch.compile(model, backend=capture, dynamic=True)(torch.randn(batch, 32))
    (first, first_hints), (second, second_hints) = captured
    assert first == second  # one key for every batch size
    assert sorted(first_hints.values()) == [8, 32] and sorted(second_hints.values()) == [16, 32]
    gm = serialize.loads(second, second_hints)
    sizes = [x for x in serialize.example_inputs(gm) if isinstance(x, torch.SymInt)]
    assert sizes and {s.node.hint for s in sizes} <= {16, 32}


def test_equal_devices_give_the_same_bytes_whether_or_not_they_are_one_object():
    # pickle memoizes by identity; a process's history decides whether two equal devices are
    # one object (on torch 2.11 with CUDA the first graph of a fresh process differed).
    one = torch.device("cpu")
    shared = serialize._PortablePickler.dumps([one, one, "x"])
    distinct = serialize._PortablePickler.dumps([torch.device("cpu"), torch.device("cpu"), "x"])
    assert shared == distinct


def test_equal_sympy_expressions_give_the_same_bytes_whether_or_not_they_are_one_object():
    # sympy's bounded cache decides whether two equal symbols are one object; on the GPU
    # three of BART's training graphs got other bytes after a longer process history.
    one = sympy.Symbol("s0", integer=True, positive=True)
    sympy.core.cache.clear_cache()
    other = sympy.Symbol("s0", integer=True, positive=True)
    assert one == other and one is not other
    values = [one + 1, FloorDiv(one, 2), sympy.Float(2.5)]
    shared = serialize._PortablePickler.dumps([*values, one, one])
    distinct = serialize._PortablePickler.dumps([*values, one, other])
    assert shared == distinct
    with graph_pickler.unpickler_class(serialize._PortableUnpickler):
        loaded = GraphPickler.loads(distinct, None)
    assert loaded == [*values, one, one] and loaded[3] is loaded[4]
    assert loaded[3].assumptions0 == one.assumptions0


@pytest.mark.parametrize(
    "rebuild, args", [(print, ("run",)), (copyreg.__newobj__, (subprocess.Popen, "true"))]
)
def test_a_payload_rebuilds_nothing_but_sympy_values(rebuild, args):
    unpickler = serialize._PortableUnpickler(io.BytesIO(b""), None)
    with pytest.raises(ValueError, match="rebuilds a sympy value"):
        unpickler.persistent_load(("sympy", 0, rebuild, args, None))


def test_a_graph_with_devices_in_its_arguments_round_trips():
    def f(x):
        return x + torch.ones(3, device=x.device)

    captured = {}

    def capture(gm, example_inputs):
        captured["payload"] = serialize.dumps(gm)
        return gm.forward

    torch.compile(f, backend=capture)(torch.randn(3))
    gm = serialize.loads(captured["payload"])
    devices = [v for n in gm.graph.nodes for v in n.kwargs.values() if isinstance(v, torch.device)]
    assert devices == [torch.device("cpu")]


def test_subgraphs_travel_and_weights_read_with_get_attr_are_refused():
    class Cond(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda t: self.lin(t).sin(), lambda t: t.cos(), (x,))

    captured = {}

    def capture(gm, example_inputs):
        captured["gm"] = gm
        return gm.forward

    torch.compile(Cond(), backend=capture)(torch.randn(2, 4))
    gm = captured["gm"]
    subgraphs = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    loaded = serialize.loads(serialize.dumps(gm))
    for name in subgraphs:  # torch.cond's branches (torch 2.11 and 2.13 read them by get_attr)
        assert isinstance(getattr(loaded, name), torch.fx.GraphModule)

    weights = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))  # reads weight/bias by get_attr
    with pytest.raises(ValueError, match="get_attr"):
        serialize.dumps(weights)


def _graph_on_cuda(index: int, second: int | None = None) -> torch.fx.GraphModule:
    """A Dynamo-like graph on fake `cuda:index` tensors (no GPU needed), naming its device in
    every form a traced program can: tensor devices (a view's base too), "cuda:N",
    torch.device("cuda", N), and a bare N where an argument is a device; `second` adds a
    tensor on another device."""
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)

    def fake(*shape, on=index):
        return FakeTensor(mode, torch.empty(*shape, device="meta"), torch.device("cuda", on))

    graph = torch.fx.Graph()

    def node(n, value):
        n.meta["example_value"] = value
        return n

    x = node(graph.placeholder("x"), fake(4, 8))
    w = node(graph.placeholder("w"), fake(8, 3))
    flat = node(graph.call_method("view", (x, 32)), x.meta["example_value"].view(32))
    ones = node(graph.call_function(torch.ones, (8,), {"device": f"cuda:{index}"}), fake(8))
    moved = node(graph.call_method("to", (x, f"cuda:{index}")), fake(4, 8))
    zeros = graph.call_function(torch.zeros, (3,), {"device": torch.device("cuda", index)})
    node(zeros, fake(3))
    summed = node(graph.call_function(torch.add, (ones, moved)), fake(4, 8))
    product = node(graph.call_function(torch.matmul, (summed, w)), fake(4, 3))
    back = node(graph.call_method("to", (product, index)), fake(4, 3))
    empty = node(graph.call_function(torch.empty, (2,), {"device": index}), fake(2))
    outputs = [back, zeros, empty, flat]
    if second is not None:
        outputs.append(node(graph.call_method("to", (x, f"cuda:{second}")), fake(4, 8, on=second)))
    graph.output(tuple(outputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _devices_named(gm: torch.fx.GraphModule) -> set[str]:
    named = set()
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            named.add(str(value.device))
        for arg in [*node.args, *node.kwargs.values()]:
            if isinstance(arg, (torch.device, str)) and str(arg).startswith("cuda"):
                named.add(str(arg))
    return named


@pytest.mark.parametrize("index", [1, 3])
def test_a_graph_traced_on_any_cuda_device_gives_the_payload_and_key_of_cuda_0(index):
    # The ranks of a job trace one graph each on their own device: one payload, one key.
    target, options = pb.Target(device="cuda", torch_version="t"), pb.Options(mode="default")
    on_0, on_n = _graph_on_cuda(0), _graph_on_cuda(index)
    assert serialize.local_device_index(on_n) == index
    assert serialize.dumps(on_0) == serialize.dumps(on_n)
    assert public_key(serialize.dumps(on_n), target, options) == public_key(
        serialize.dumps(on_0), target, options
    )
    loaded = serialize.loads(serialize.dumps(on_n))
    assert _devices_named(loaded) == {"cuda:0"}
    moves = [n.args[1] for n in loaded.graph.nodes if n.op == "call_method" and n.target == "to"]
    (empty,) = loaded.graph.find_nodes(op="call_function", target=torch.empty)
    assert moves == ["cuda:0", 0] and empty.kwargs == {"device": 0}
    assert _devices_named(on_n) >= {f"cuda:{index}"}  # the caller's graph is left as it was


def test_a_graph_on_two_cuda_devices_keeps_its_indices():
    gm = _graph_on_cuda(1, second=2)
    assert serialize.local_device_index(gm) is None
    assert _devices_named(serialize.loads(serialize.dumps(gm))) == {"cuda:1", "cuda:2"}
    assert serialize.dumps(gm) != serialize.dumps(_graph_on_cuda(0, second=2))


def test_only_cuda_devices_and_device_arguments_name_an_index():
    assert serialize._device_index("xpu:1") is None
    assert serialize._device_index(torch.device("cpu")) is None
    assert serialize._device_index("cuda:12") == 12
    assert serialize._device_index(1) is None  # a bare int only where an argument is a device
    assert serialize._device_index(1, bare_int=True) == 1
    assert serialize._device_index(True, bare_int=True) is None


def test_a_cpu_graph_has_no_local_device_and_the_same_payload():
    model = torch.nn.Linear(4, 4)
    captured = _capture(model, torch.randn(2, 4))
    assert serialize.local_device_index(captured["gm"]) is None
    assert serialize.dumps(captured["gm"]) == captured["payload"]


def test_a_parameter_with_a_grad_serializes_as_one_without():
    """After a training step a parameter carries a grad; the inference graph traced then (under
    no_grad) failed to pickle (its fake grad holds the fake mode) and compiled locally."""
    model = torch.nn.Linear(8, 4)
    x = torch.randn(2, 8)
    with torch.no_grad():
        before = _capture(model, x)["payload"]
    model(x).sum().backward()
    with torch.no_grad():
        after = _capture(model, x)["payload"]
    assert model.weight.grad is not None
    assert after == before


def test_a_payload_is_what_graphpickler_gives_when_it_generates_the_code_again():
    """dumps keeps the code generated when its copy of the graph is built; GraphPickler would
    generate it again before pickling: the same bytes (the key) either way. Dynamic shapes
    and views: sympy values and view bases are described once per object too."""

    def f(x, w):
        return (x @ w).view(-1, 2).t().relu() * x.shape[0]

    captured = _capture(lambda x: f(x, torch.ones(4, 4)), torch.randn(3, 4), dynamic=True)
    copy = serialize.metadata_only(captured["gm"])
    regenerated = torch.fx.GraphModule(torch.nn.Module(), copy.graph)  # GraphPickler recompiles
    assert type(regenerated).recompile is torch.fx.GraphModule.recompile
    payload = serialize._PortablePickler.dumps(regenerated, serialize._PICKLE_OPTIONS)
    assert serialize.dumps(captured["gm"]) == payload


scale = 1.0


def test_lifted_floats_values_travel_beside_the_payload():
    """A float that changed between calls is a 0-d tensor input read with .item(): its value
    is neither in the ShapeEnv's hints nor in the SymFloat of the payload, so every value is
    one key; `loads` puts it back."""
    global scale
    captured = []

    def capture(gm, example_inputs):
        captured.append((serialize.dumps(gm), serialize.float_hints(gm)))
        return gm.forward

    def scaled(x):
        return (x * scale).sin()

    for value in (2.5, -0.75):
        torch._dynamo.reset()
        compiled = torch.compile(scaled, backend=capture)
        scale = 1.0
        compiled(torch.randn(4))
        scale = value  # changed: traced again, the float lifted to an input
        compiled(torch.randn(4))
    (_, _), (first, first_hints), (_, _), (second, second_hints) = captured
    assert first == second  # one key for every value
    assert list(first_hints.values()) == [2.5] and list(second_hints.values()) == [-0.75]
    gm = serialize.loads(second, second_hints)
    (item,) = [n for n in gm.graph.nodes if n.target == "item"]
    assert item.meta["example_value"].node.hint == -0.75
