"""torch_adapter/trace/named_backend.py: `torch.compile(fn, backend=NAME)` is offered to the
backend's take_over before Dynamo traces anything, with the compile's arguments; compiles with
other backends, or with arguments take_over cannot pass on, are torch's own; a take_over that
declines or fails leaves torch's compile, with one log line for a failure."""

import logging

import pytest
import torch
from torch._dynamo.backends.registry import register_backend
from torch._dynamo.utils import counters

from torchfarm.torch_adapter.trace import named_backend

offered = []


def farmish(gm, example_inputs):
    """Stands for the farm's backend: what it compiles runs eagerly."""
    return gm.forward


register_backend(farmish, name="named_backend_test")


def double(x):
    return torch.relu(x) * 2


@pytest.fixture
def take_over(monkeypatch):
    """intercept() with a take_over that records what it is offered and returns `answer[0]`."""
    answer: list = [None]

    def take(fn, compile):
        offered.append((fn, compile))
        if isinstance(answer[0], Exception):
            raise answer[0]
        return answer[0]

    offered.clear()
    named_backend.intercept(farmish, take)
    yield answer
    monkeypatch.delitem(named_backend._take_overs, farmish)


def test_the_compile_is_offered_with_its_arguments(take_over):
    take_over[0] = stand_in = object()
    model = torch.nn.Linear(4, 4)
    compiled = torch.compile(
        model, backend="named_backend_test", mode="max-autotune", dynamic=True, fullgraph=True
    )
    assert compiled is stand_in
    assert offered == [(model, named_backend.Compile("max-autotune", None, True, True))]
    offered.clear()
    assert torch.compile(double, backend=farmish, options={"a": 1}) is stand_in
    assert offered == [(double, named_backend.Compile(None, {"a": 1}, None, False))]


def test_a_declined_compile_is_torchs_own(take_over):
    x = torch.randn(3, 4)
    counters.clear()
    compiled = torch.compile(double, backend="named_backend_test")
    assert len(offered) == 1
    assert torch.equal(compiled(x), double(x))
    assert counters["stats"]["unique_graphs"] == 1  # traced by Dynamo as always


def test_a_failing_take_over_is_one_log_line(take_over, caplog):
    take_over[0] = RuntimeError("no farm")
    x = torch.randn(3, 4)
    with caplog.at_level(logging.INFO, logger="torchfarm"):
        compiled = torch.compile(double, backend="named_backend_test")
        assert torch.equal(compiled(x), double(x))
    (line,) = [r.getMessage() for r in caplog.records if "traces as always" in r.getMessage()]
    assert "RuntimeError: no farm" in line


@pytest.mark.parametrize(
    "arguments",
    [
        dict(options={"guard_filter_fn": lambda entries: [True] * len(entries)}),
        dict(recompile_limit=2),
        dict(isolate_recompiles=True),
    ],
)
def test_arguments_take_over_cannot_pass_on_are_torchs(take_over, arguments):
    if "guard_filter_fn" not in arguments.get("options", {}):
        pytest.importorskip("torch", minversion="2.13")  # 2.11's torch.compile has neither
    take_over[0] = object()
    x = torch.randn(3, 4)
    compiled = torch.compile(double, backend="named_backend_test", **arguments)
    assert offered == [] and torch.equal(compiled(x), double(x))


def test_other_backends_are_never_offered(take_over):
    take_over[0] = object()
    x = torch.randn(3, 4)
    for backend in ("eager", "aot_eager", lambda gm, inputs: gm.forward):
        assert torch.equal(torch.compile(double, backend=backend)(x), double(x))
    assert torch.equal(torch._dynamo.optimize("eager")(double)(x), double(x))
    assert offered == []


def test_torchs_own_functions_are_never_offered(take_over):
    """`module.compile()` compiles torch's `Module._call_impl`; a module that take_over
    declined is compiled by torch through the module's call, which must not be offered again."""
    take_over[0] = RuntimeError("declined")
    model = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)
    compiled = torch.compile(model, backend="named_backend_test")
    assert offered == [(model, named_backend.Compile(None, None, None, False))]
    assert torch.equal(compiled(x), model(x))
    offered.clear()
    model.compile(backend="named_backend_test")
    assert offered == [] and torch.equal(model(x), compiled(x))
