"""torch_adapter/dynamo_package.py in one process: a package recorded while Dynamo traces, then
installed after Dynamo's caches are reset, runs the function with no frame traced."""

import itertools
import sys

import torch
from torch._dynamo import bytecode_transformation
from torch._dynamo.utils import counters

from torchfarm.torch_adapter import dynamo_package
from torchfarm.torch_adapter.guard_text import hints, symbol_inputs


def step(x):
    y = torch.relu(x) * 2
    print("a graph break")  # two graphs
    return torch.nn.functional.gelu(y).sum(dim=-1)


def test_an_installed_package_runs_without_tracing():
    graphs = {}

    def backend(gm, example_inputs):
        graphs[dynamo_package.backend_id(gm)] = gm.forward
        return gm.forward

    x = torch.randn(4, 8)
    torch._dynamo.reset()
    package = dynamo_package.new_package()
    dynamo_package.record(package, step)
    expected = dynamo_package.optimize(backend, package, None, False)(step)(x)
    saved = dynamo_package.dumps(package)
    assert dynamo_package.backend_ids(saved) == set(graphs) and len(graphs) == 2

    torch._dynamo.reset()
    counters.clear()
    # as in a fresh process: Dynamo numbers the globals it installs from 0 again
    bytecode_transformation._unique_id_counter = itertools.count()
    calls = []

    def counted(fn):
        return lambda *args: calls.append(1) or fn(*args)

    restored = dynamo_package.new_package()
    dynamo_package.install(
        restored,
        step,
        saved,
        {bid: counted(fn) for bid, fn in graphs.items()},
    )
    compiled = dynamo_package.optimize(backend, restored, None, False)(step)
    assert torch.equal(compiled(x), expected)
    assert counters["stats"]["unique_graphs"] == 0 and len(calls) == 2
    # inputs that fail the saved guards (another dtype) are traced as before, in this process
    # where the package's globals are installed
    compiled(x.double())
    assert counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()


def test_identity_and_defaults_guards_are_dropped():
    class Entry:
        def __init__(self, guard_type, name, derived=()):
            self.guard_type, self.name, self.derived_guard_types = guard_type, name, derived

    entries = [
        Entry("TENSOR_MATCH", "L['x']"),
        Entry("MODULE_MATCH", "G['torch']"),
        Entry("BUILTIN_MATCH", "G['iter']", ("ID_MATCH",)),
        Entry("EQUALS_MATCH", "L['fn'].__defaults__[0]"),
        Entry("EQUALS_MATCH", "G['scale']"),
    ]
    assert dynamo_package.keep_guard(entries) == [True, False, False, False, True]


def test_sized_symints_carry_their_sizes():
    assert hints(symbol_inputs(dynamo_package.sized_symints([4, 1, 0, 4]))) == [4, 1, 0, 4]


class Owner:
    @property
    def loss(self):
        return 1


def test_a_property_getter_is_named_by_its_class():
    module = sys.modules[__name__]
    assert dynamo_package._property_getter(module, Owner.loss.fget.__code__) == "Owner.loss"
    assert dynamo_package._property_getter(module, step.__code__) is None
