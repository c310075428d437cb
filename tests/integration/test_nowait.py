"""No-wait mode (issue 20) against a real farm: a graph runs eagerly while the farm compiles
it, then switches to the farm's code between two calls; outputs and gradients match eager
before and after the switch, and a failing farm leaves the graph eager.

Each test's graph is its own (constants no other test uses), so the farm has to compile it:
the first call cannot be a hit. Tolerances as in test_farm.py.
"""

import copy
import logging
import warnings

import pytest
import torch

import torchfarm
from tests.integration.helpers import TOKENS
from tests.integration.test_farm import _closed_port
from torchfarm.client import backend, records

pytestmark = pytest.mark.integration
ATOL = 1e-4
CALLS_LIMIT = 100_000  # a loop bound, not a timing: the farm compiles these in seconds


def _nowait(fn, farm, **kwargs):
    return torchfarm.compile(fn, addr=farm.addr, token=TOKENS["alice"], wait=False, **kwargs)


def _switched(label: str) -> backend.GraphRecord | None:
    return next((r for r in backend.history if r.label == label and r.switched), None)


def _labels() -> list[str]:
    return [r.label for r in backend.history if r.source == "eager-while-compiling"]


def test_inference_runs_eagerly_until_the_farms_code_arrives_then_runs_it(farm):
    w = torch.randn(24, 7)

    def f(x):
        return torch.tanh(x @ w) * 1.2301

    compiled = _nowait(f, farm)
    calls = 0
    with torch.no_grad():
        while not (backend.history and _switched(backend.history[0].label)):
            x = torch.randn(5, 24)
            torch.testing.assert_close(compiled(x), f(x), atol=ATOL, rtol=1e-4)
            calls += 1
            assert calls < CALLS_LIMIT
        for _ in range(3):  # the farm's code now
            x = torch.randn(5, 24)
            torch.testing.assert_close(compiled(x), f(x), atol=ATOL, rtol=1e-4)
    first, switch = backend.history
    assert first.source == "eager-while-compiling" and first.label == switch.label
    assert switch.source in ("miss", "merged"), switch
    # the first call ran eagerly (a cold compile takes seconds), every later one up to the
    # switch too, and the graph was handed over between two calls
    assert 1 <= switch.eager_calls <= calls, (switch, calls)
    assert switch.switched >= switch.submitted

    # A hit in this mode is served as in wait mode: at once, no eager call (on a farm slower
    # than FIRST_WORD_S to answer, a late hit: then it switches at the next call).
    torch._dynamo.reset()
    backend.history.clear()
    again = _nowait(f, farm)
    calls = 0
    with torch.no_grad():
        while calls < 2 or all(r.source == "eager-while-compiling" for r in backend.history):
            x = torch.randn(5, 24)
            torch.testing.assert_close(again(x), f(x), atol=ATOL, rtol=1e-4)
            calls += 1
            assert calls < CALLS_LIMIT
    sources = [r.source for r in backend.history]
    assert sources in (["hit"], ["eager-while-compiling", "hit"]), backend.history


def test_a_training_loop_matches_eager_before_and_after_the_switch(farm):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 36), torch.nn.GELU(), torch.nn.Linear(36, 3), torch.nn.Softsign()
    )
    reference = copy.deepcopy(model)
    compiled = _nowait(model, farm)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference)]
    steps, after_switch = 0, 0
    while after_switch < 5:
        x = torch.randn(6, 20)
        out, expected = compiled(x), reference(x)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=1e-4)
        out.square().mean().backward()
        expected.square().mean().backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=1e-4)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        steps += 1
        after_switch += bool(_switched(_labels()[0]))
        assert steps < CALLS_LIMIT
    switch = _switched(_labels()[0])
    assert switch is not None and switch.source in ("miss", "merged"), backend.history
    # eager steps (forward and backward eager), then compiled ones (both from the artifact)
    assert 1 <= switch.eager_calls <= steps - 5, (switch, steps)


def test_a_graph_break_gives_two_graphs_that_switch_each_on_its_own(farm):
    def program(x):
        y = torch.sigmoid(x) * 3.4501
        torch._dynamo.graph_break()
        return torch.cos(y) - 0.7702

    compiled = _nowait(program, farm)
    calls = 0
    while len(_labels()) < 2 or not all(_switched(label) for label in _labels()):
        x = torch.randn(3, 9)
        torch.testing.assert_close(compiled(x), program(x), atol=ATOL, rtol=1e-4)
        calls += 1
        assert calls < CALLS_LIMIT
    assert len(_labels()) == 2
    for label in _labels():
        switch = _switched(label)
        assert switch is not None and switch.source in ("miss", "merged", "hit"), switch
        assert switch.eager_calls >= 1, switch


def test_dynamic_sizes_switch_where_the_farms_guards_cover_them_and_stay_eager_elsewhere(
    farm, caplog
):
    # Grad enabled: Inductor's C++ code guards the batch size (<= 4096), see test_farm.py.
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 40), torch.nn.ReLU(), torch.nn.Linear(40, 11))
    compiled = _nowait(model, farm, dynamic=True)
    calls = 0
    while not (_labels() and _switched(_labels()[0])):
        for batch in (8, 16, 100):
            x = torch.randn(batch, 32)
            torch.testing.assert_close(compiled(x), model(x), atol=ATOL, rtol=1e-4)
            calls += 1
        assert calls < CALLS_LIMIT
    with caplog.at_level(logging.INFO, logger="torchfarm"):
        for batch in (8, 16, 100, 5000):
            x = torch.randn(batch, 32)
            torch.testing.assert_close(compiled(x), model(x), atol=ATOL, rtol=1e-4)
    # one dynamic graph served every size; 5000 is outside the artifact's guards: eager
    assert len(_labels()) == 1, backend.history
    uncovered = [r.getMessage() for r in caplog.records if "not covered" in r.getMessage()]
    assert len(uncovered) == 1 and "5000" in uncovered[0], uncovered


def test_a_failing_farm_keeps_the_graph_eager_with_one_warning(farm):
    """A real farm that refuses this client (an unknown token), and no farm at all."""
    torch.manual_seed(2)
    w = torch.randn(13, 13)

    def f(x):
        return torch.relu(x @ w) + 0.3303

    for addr, token in ((farm.addr, "not-a-token"), (f"127.0.0.1:{_closed_port()}", "")):
        torch._dynamo.reset()
        backend.history.clear()
        records._warned.clear()
        compiled = torchfarm.compile(f, addr=addr, token=token, wait=False)
        calls = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            while len(backend.history) < 2:
                x = torch.randn(2, 13)
                torch.testing.assert_close(compiled(x), f(x), atol=ATOL, rtol=1e-4)
                calls += 1
                assert calls < CALLS_LIMIT
            for _ in range(3):
                x = torch.randn(2, 13)
                torch.testing.assert_close(compiled(x), f(x), atol=ATOL, rtol=1e-4)
        farm_warnings = [str(w.message) for w in caught if "torchfarm" in str(w.message)]
        assert len(farm_warnings) == 1 and "running eagerly" in farm_warnings[0], farm_warnings
        first, last = backend.history
        assert first.source == "eager-while-compiling", first
        assert last.source == "eager" and not last.switched and last.why, last
        # the call that found the failure was counted after its record: it ran eagerly too
        assert last.eager_calls == calls - 1, (last, calls)
