"""torch_adapter/trace/dynamo_package.py and identity.py in one process: a package recorded while
Dynamo traces, then installed after Dynamo's caches are reset, runs the function with no frame
traced; a rebound global or a changed default after the install is traced again."""

import collections as _collections  # not `collections`: Dynamo names it by its id here
import contextlib
import itertools
import pickle
import re
import sys
import types
import typing

import pytest
import torch
from torch._dynamo import bytecode_transformation
from torch._dynamo.exc import PackageError
from torch._dynamo.utils import counters

from torchfarm.torch_adapter.trace import dynamo_package, identity, script_functions
from torchfarm.torch_adapter.trace.guard_text import hints, symbol_inputs

# The skip runs only on the releases it is verified on; elsewhere every compile traces.
pytestmark = pytest.mark.skipif(
    not dynamo_package.supported(), reason="the skip is off on this torch release"
)


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


def helper(x):
    return torch.relu(x)


def scaled(x, k=2.0):
    return x * k


def uses_globals(x):
    return scaled(helper(x)) + 1


def _restore(fn, *args, recording=None):
    """`fn` compiled and recorded (inside the `recording` context), then installed as a fresh
    process would: the compiled function."""
    graphs = {}

    def backend(gm, example_inputs):
        graphs[dynamo_package.backend_id(gm)] = gm.forward
        return gm.forward

    torch._dynamo.reset()
    package = dynamo_package.new_package()
    dynamo_package.record(package, fn)
    with recording or contextlib.nullcontext():
        dynamo_package.optimize(backend, package, None, False)(fn)(*args)
    saved = dynamo_package.dumps(package)
    torch._dynamo.reset()
    counters.clear()
    bytecode_transformation._unique_id_counter = itertools.count()
    for name in [n for n in globals() if re.fullmatch(r"_\d+_c\d+", n)]:  # Dynamo installed
        del globals()[name]  # them by object id: a fresh process has none
    restored = dynamo_package.new_package()
    dynamo_package.install(restored, fn, saved, graphs)
    return dynamo_package.optimize(backend, restored, None, False)(fn)


def _torch_sees_a_changed_default(monkeypatch) -> bool:
    """Whether plain torch.compile on this release traces again after a called function's
    default argument changed: 2.13 guards `G['scaled'].__defaults__[0]`; 2.11's Dynamo emits
    no such guard and runs the old default, in one process."""
    torch._dynamo.reset()
    compiled = torch.compile(uses_globals, backend="eager")
    x = torch.randn(4, 8)
    compiled(x)
    with monkeypatch.context() as m:
        m.setattr(scaled, "__defaults__", (3.0,))
        seen = torch.equal(compiled(x), uses_globals(x))
    torch._dynamo.reset()
    return seen


def test_a_rebound_global_or_changed_default_is_traced_again(monkeypatch):
    torch_sees_it = _torch_sees_a_changed_default(monkeypatch)
    x = torch.randn(4, 8)
    compiled = _restore(uses_globals, x)
    assert torch.equal(compiled(x), uses_globals(x))
    assert counters["stats"]["unique_graphs"] == 0
    monkeypatch.setitem(globals(), "helper", torch.tanh)  # a rebound global
    assert torch.equal(compiled(x), uses_globals(x))
    assert counters["stats"]["unique_graphs"] == 1
    # a default argument: the restored code does what plain torch.compile does in one process
    # (where torch misses it, the farm cannot be told either, and a fresh process is right)
    monkeypatch.setattr(scaled, "__defaults__", (3.0,))
    assert torch.equal(compiled(x), uses_globals(x)) == torch_sees_it
    assert counters["stats"]["unique_graphs"] == 1 + torch_sees_it
    torch._dynamo.reset()


def _source(name: str) -> types.FunctionType:
    scope: dict = {"__name__": "elsewhere"}
    exec(f"def fn(x, k={name!r}):\n    return x * len(k)", scope)
    return scope["fn"]


def test_fingerprints_name_what_a_fresh_process_can_find_again():
    fingerprint = identity.fingerprint
    # the same source read twice (two processes) is the same function; other code is not
    assert fingerprint(_source("a")) == fingerprint(_source("a"))
    assert fingerprint(_source("a")) != fingerprint(_closure(2.0))
    assert fingerprint(torch.nn.functional) == "module:torch.nn.functional"
    assert fingerprint(torch.nn.Linear) == "class:torch.nn.modules.linear.Linear"
    assert fingerprint(torch.relu) == fingerprint(torch.relu) is not None
    # a pybind11 function (bound to its function record, not to an instance)
    assert fingerprint(torch._C._get_tracing_state) == "builtin:torch._C._get_tracing_state"
    # a function's defaults and closure contents are not part of it: Dynamo guards those it
    # reads with guards of their own, and the rest (a library's caches) may change freely
    assert fingerprint(_source("a")) == fingerprint(_source("bb"))
    assert fingerprint(_closure(2.0)) == fingerprint(_closure(torch.ones(1))) is not None
    assert fingerprint(object()) is None
    # huggingface_hub's validators are keyed by typing's special forms
    assert fingerprint(typing.Union) == "typing:typing.Union" != fingerprint(typing.Literal)


def _closure(k):
    return lambda x: x * k


def _scaler(k):
    seen = []  # what a library updates on every call, outside the compiled code

    def scale(x, record=False):
        if record:
            seen.append(1)
        return x * k

    return scale


scale = _scaler(2.0)


def scaled_step(x):
    return scale(x).relu()


def test_a_closure_is_guarded_on_what_dynamo_reads_of_it(monkeypatch):
    x = torch.randn(4, 8)
    compiled = _restore(scaled_step, x)
    for _ in range(3):  # contents Dynamo does not read change between calls: no retrace
        assert torch.equal(compiled(x), scaled_step(x))
        scale(x, record=True)
    assert counters["stats"]["unique_graphs"] == 0
    monkeypatch.setitem(globals(), "scale", _scaler(3.0))  # the same code, another k
    assert torch.equal(compiled(x), scaled_step(x))
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


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


def checks_tracing(x):
    return x if torch._C._get_tracing_state() else torch.relu(x) + 1


def test_a_frame_guarded_on_a_pybind11_function_is_restored():
    # transformers' BERT guards `torch._C._get_tracing_state` (issue 26): that frame traced
    # on every hit until pybind11 functions had a fingerprint
    x = torch.randn(4, 8)
    compiled = _restore(checks_tracing, x)
    assert torch.equal(compiled(x), checks_tracing(x))
    assert counters["stats"]["unique_graphs"] == 0
    torch._dynamo.reset()


def linear_step(model, x):
    return model(x).float().square().mean()


def test_a_frame_traced_under_autocast_is_restored_under_autocast_and_only_there():
    # Tensor guards expect the dispatch keys as the thread's autocast state modifies them:
    # installed outside the caller's autocast, every hit traced again (the GPU bench's GPT).
    model, x = torch.nn.Linear(8, 8), torch.randn(4, 8)
    with torch.autocast("cpu", torch.bfloat16):
        expected = linear_step(model, x)
    compiled = _restore(linear_step, model, x, recording=torch.autocast("cpu", torch.bfloat16))
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(compiled(model, x), expected)
    assert counters["stats"]["unique_graphs"] == 0
    # without autocast the saved bfloat16 graph must not run: traced again, float32 result
    assert torch.equal(compiled(model, x), linear_step(model, x))
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_names_of_an_installed_package_are_never_made_again_in_this_process(monkeypatch):
    """A process forked from the one that saved the package has the same object ids: the
    package's `___module_collections_<id>_c4` must not be what this process's fifth compile
    names the same module (the zoo's restoring process failed: "already exists in scope")."""
    from torch._dynamo import output_graph

    module = types.ModuleType("torchfarm_installed_names")
    module.___module_collections_1234_c41 = sys.modules["collections"]
    module.__compiled_fn_57 = print
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(output_graph, "_compile_id_counter", itertools.count())
    monkeypatch.setattr(bytecode_transformation, "_unique_id_counter", itertools.count())
    dynamo_package._skip_installed_ids({module.__name__})
    assert next(output_graph._compile_id_counter) == 42
    assert next(bytecode_transformation._unique_id_counter) == 58


def ordered(x):
    return _collections.OrderedDict(y=x.relu())


def test_a_package_that_fails_to_install_leaves_no_name_a_later_trace_makes(monkeypatch):
    """A failed install leaves the module as it found it: the zoo's deberta-v2, whose saved
    guards failed to load in a process forked like the saving one, traced instead and made
    `___module_collections_<id>_c12` again, a name the install had left: "already exists in
    scope" raised into the user's step (issue 49)."""
    from torch._dynamo import output_graph

    x = torch.randn(4, 8)
    torch._dynamo.reset()
    monkeypatch.setattr(output_graph, "_compile_id_counter", itertools.count(1000))
    package = dynamo_package.new_package()
    dynamo_package.record(package, ordered)
    dynamo_package.optimize(lambda gm, _: gm.forward, package, None, False)(ordered)(x)
    saved = dynamo_package.dumps(package)
    by_id = [n for n in pickle.loads(saved)[1][__name__] if n.startswith("___module_")]
    assert by_id, "the package reads collections by Dynamo's by-id name"
    torch._dynamo.reset()
    for name in by_id:  # a fresh process has none of this one's trace
        globals().pop(name, None)
    monkeypatch.setattr(output_graph, "_compile_id_counter", itertools.count(1000))  # forked
    with pytest.raises(RuntimeError, match="not found"):  # a graph it cannot have
        dynamo_package.install(dynamo_package.new_package(), ordered, saved, {})
    assert not set(by_id) & set(globals())
    compiled = torch.compile(ordered, backend="eager")  # what the caller does next: trace
    assert torch.equal(compiled(x)["y"], x.relu())
    torch._dynamo.reset()


def relu_act(x):
    return x.relu()


def tanh_act(x):
    return x.tanh()


ACTS = {"relu": relu_act, "tanh": tanh_act}  # transformers' ACT2FN is one


def picks_an_act(x):
    return ACTS["relu"](x) * len(list(ACTS))  # a function from a dict whose keys it reads


def test_a_function_in_a_dict_whose_keys_the_frame_reads_is_restored(monkeypatch):
    """Its identity guard goes through a dict guarded on its key order: the install failed
    with "DictGuardManager must guard on keys" (deberta-v2's restore, issue 49)."""
    x = torch.randn(4, 8)
    compiled = _restore(picks_an_act, x)
    assert torch.equal(compiled(x), picks_an_act(x))
    assert counters["stats"]["unique_graphs"] == 0
    monkeypatch.setitem(ACTS, "relu", tanh_act)  # another function: traced again
    assert torch.equal(compiled(x), picks_an_act(x))
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_a_generic_attribute_is_found_again_past_getattr():
    """transformers' configs: `object.__getattribute__(self.config, 'get_text_config')`, a
    source 2.11 guards; without a path the whole entry frame traced on every hit there."""
    from torch._dynamo import source as sources

    class Config:
        def get_text_config(self):
            return self

        def __getattr__(self, name):
            raise AttributeError(name)

    config = Config()
    source = sources.AttrSource(
        sources.GenericAttrSource(sources.LocalSource("config"), "get_text_config"), "__func__"
    )
    steps = identity.path(source)
    assert steps == (("local", "config"), ("generic_attr", "get_text_config"), ("attr", "__func__"))
    assert identity.resolve(steps, {"config": config}, {}) is Config.get_text_config


def test_a_dicts_key_is_found_again():
    """huggingface_hub's dataclass validators: a guard on a dict's first key (a class),
    `list(dict.keys(G[...]._BASIC_TYPE_VALIDATORS))[0]`; without a path transformers'
    output wrapper was left out of bert's and vit's packages (the zoo's restoring process
    traced every frame)."""
    from torch._dynamo import source as sources

    source = sources.ConstDictKeySource(sources.GlobalSource("validators"), 1)
    steps = identity.path(source)
    assert steps == (("global", "validators"), ("dict_key", 1))
    assert identity.resolve(steps, {}, {"validators": {int: None, str: None}}) is str


def test_a_path_is_one_expression_of_literals():
    """LateChecks resolve their paths on every call, each path compiled once; a name that is
    no str or int never reaches the expression."""
    steps = (("local", "m"), ("attr", "__dict__"), ("key_at", 0), ("type", None))
    assert identity.resolver(steps) is identity.resolver(steps)
    assert identity.resolve(steps, {"m": types.SimpleNamespace(a=1.5)}, {}) is float
    with pytest.raises(TypeError):
        identity.resolver((("local", "m"), ("attr", types.SimpleNamespace())))


def calls_a_local_after_a_break(x):
    act = helper  # a local of the resume function that runs the rest after the break
    y = x * 2
    print("a graph break")
    return act(y)


def test_a_later_frames_local_is_checked_when_the_frame_runs(monkeypatch):
    """A guard on a local of a frame after the first (a resume function's, transformers'
    output wrapper called after a graph break) cannot be built at install: no process knows
    that local before the frame runs. It is checked at call time (LateChecks); before, the
    frame was left out of the package and traced on every hit (the differential suite's gpt2)."""
    x = torch.randn(4, 8)
    compiled = _restore(calls_a_local_after_a_break, x)
    assert torch.equal(compiled(x), calls_a_local_after_a_break(x))
    assert counters["stats"]["unique_graphs"] == 0
    monkeypatch.setitem(globals(), "helper", torch.tanh)  # the local is another function now
    assert torch.equal(compiled(x), calls_a_local_after_a_break(x))
    assert counters["stats"]["unique_graphs"] >= 1
    torch._dynamo.reset()


def test_late_checks_pass_the_traced_object_or_its_twin_and_fail_any_other():
    checks = dynamo_package.LateChecks([((("local", "act"),), identity.fingerprint(helper))])
    assert checks({"act": helper}) and checks({"act": helper})  # the second: one `is`
    # made anew with the same code (a wrapper built on every call): no recompile
    assert checks({"act": types.FunctionType(helper.__code__, globals())})
    assert not checks({"act": torch.tanh})
    assert not checks({})  # the path is gone


def tensor_type_check(x):
    return x.relu() if type(x) in (torch.Tensor, list) else x


def test_a_global_only_an_identity_check_reads_is_saved():
    """2.11 guards `type(x)` through torch installed under its id (`G['_<id>_c0'].Tensor`), a
    global the frame's bytecode never reads; a fresh process, which has no such global, traced
    transformers' forward wrappers on every hit (H200, llama and gpt2)."""
    x = torch.randn(4, 8)
    compiled = _restore(tensor_type_check, x)
    assert torch.equal(compiled(x), tensor_type_check(x))
    assert counters["stats"]["unique_graphs"] == 0
    torch._dynamo.reset()


def test_a_source_with_derived_fields_survives_the_package_pickle():
    """2.11 pickles a DefaultsSource with the fields its __post_init__ derives, and loading
    it raised TypeError: transformers' BERT never saved a package on 2.11 (H200)."""
    import pickle

    from torch._dynamo.source import DefaultsSource, GlobalSource

    source = DefaultsSource(GlobalSource("f"), 0, is_kw=False)
    restored = pickle.loads(dynamo_package._dumps([source]))[0]
    assert restored == source and restored.name == source.name


@torch.jit.script
def rotate(x: torch.Tensor) -> torch.Tensor:  # ChatGLM's apply_rotary_pos_emb is one
    return torch.cat([-x[..., 4:], x[..., :4]], dim=-1)


@torch.jit.script
def flip(x: torch.Tensor) -> torch.Tensor:
    return -x


def calls_script(x):
    return torch.relu(rotate(x)) + 1


def test_a_frame_that_calls_a_module_level_torchscript_function_is_restored(monkeypatch):
    """Dynamo guards the ScriptFunction's type, which its package refused: the frame was left
    out and chatglm-encoder's skip hit traced its one graph (H200, 1.09-1.22x PyTorch's warm
    start). Saved by name, it is restored; another function bound to the name is traced."""
    x = torch.randn(4, 8)
    compiled = _restore(calls_script, x)
    assert torch.equal(compiled(x), calls_script(x))
    assert counters["stats"]["unique_graphs"] == 0
    monkeypatch.setitem(globals(), "rotate", flip)
    assert torch.equal(compiled(x), calls_script(x))
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_a_torchscript_function_is_saved_by_the_name_that_reaches_it():
    def tripled(x: torch.Tensor) -> torch.Tensor:  # scripted in a body: no name reaches it
        return x * 3

    assert script_functions.name_of(rotate) == (__name__, "rotate")
    assert script_functions.load(__name__, "rotate") is rotate
    with pytest.raises(PackageError, match="not reachable by name"):
        script_functions.name_of(torch.jit.script(tripled))
    with pytest.raises(PackageError, match="no longer a TorchScript function"):
        script_functions.load(__name__, "calls_script")
