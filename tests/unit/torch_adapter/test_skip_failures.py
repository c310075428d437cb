"""A frame the skip cannot save is traced, never an exception (issue 49 item 3): each failure
class leaves its frame out of the package (one log line naming it) while the other frames
restore, and a fault injected into every step of saving and restoring, one at a time, never
reaches the program, whose results stay those of eager."""

import itertools
import logging

import pytest
import torch
from torch._dynamo import bytecode_transformation
from torch._dynamo import package as package_module
from torch._dynamo.guards import CheckFunctionManager
from torch._dynamo.package import CompilePackage
from torch._dynamo.utils import counters

from torchfarm.torch_adapter.trace import dynamo_package, identity

# The skip runs only on the releases it is verified on; elsewhere every compile traces.
pytestmark = pytest.mark.skipif(
    not dynamo_package.supported(), reason="the skip is off on this torch release"
)


def _scripted_in_a_body():
    def doubled(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    return torch.jit.script(doubled)


scripted = _scripted_in_a_body()  # no name reaches it (a module-level one is saved by name)


def helper(x):
    return torch.relu(x)


def two_frames(x):
    y = x + 1
    torch._dynamo.graph_break()
    return helper(y).sum(dim=-1)


def calls_a_script_function(x):
    y = helper(x) + 1
    torch._dynamo.graph_break()
    return scripted(y).sum(dim=-1)


_DYNAMO_GLOBALS = ("__builtins_dict__", "__compiled_fn", "__resume_at", "__import_")


def _with_the_skip(fn, x, saved: bytes | None, graphs: dict) -> tuple[list, bytes | None]:
    """What client/packages.Skipper does around Dynamo, without a farm: install `saved` where
    it installs (else record), call three times, save after the first call where that works.
    Returns the results and the saved package (None where saving failed)."""

    def backend(gm, example_inputs):
        graphs[dynamo_package.backend_id(gm)] = gm.forward
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    # as a fresh process: Dynamo numbers from 0 again, and none of its globals are here
    torch._C._dynamo.eval_frame._reset_precompile_entries(fn.__code__)
    bytecode_transformation._unique_id_counter = itertools.count()
    for name in [n for n in globals() if n.startswith(_DYNAMO_GLOBALS)]:
        del globals()[name]
    package: dynamo_package.Package | None = None
    try:
        assert saved is not None
        package = dynamo_package.new_package()
        dynamo_package.install(package, fn, saved, graphs)
    except Exception:
        try:
            package = dynamo_package.new_package()
            dynamo_package.record(package, fn)
        except Exception:  # the decorator then compiles without a package
            package = None
    if package is None:
        compiled = torch._dynamo.optimize(backend)(fn)
    else:
        compiled = dynamo_package.optimize(backend, package, None, False)(fn)
    results = [compiled(x)]
    try:
        saved = dynamo_package.dumps(package) if package else None
    except Exception:
        saved = None
    results += [compiled(x), compiled(x)]
    return results, saved


def _equal_eager(fn, x, results):
    for result in results:
        assert torch.allclose(result, fn(x)), (result, fn(x))


def test_a_script_function_leaves_its_frame_out_and_the_other_restores(caplog):
    x, graphs = torch.randn(4, 8), {}
    with caplog.at_level(logging.INFO, logger="torchfarm"):
        results, saved = _with_the_skip(calls_a_script_function, x, None, graphs)
    _equal_eager(calls_a_script_function, x, results)
    (line,) = [r.message for r in caplog.records if "traces on every hit" in r.message]
    assert "calls_a_script_function" in line and "not reachable by name" in line, line
    results, _ = _with_the_skip(calls_a_script_function, x, saved, graphs)
    _equal_eager(calls_a_script_function, x, results)
    assert counters["stats"]["unique_graphs"] == 1  # the left-out frame only, traced once
    torch._dynamo.reset()


def test_a_guard_that_cannot_be_saved_leaves_its_frame_out(monkeypatch, caplog):
    x, graphs = torch.randn(4, 8), {}
    fingerprint = identity.fingerprint  # none for helper: the second frame is left out
    monkeypatch.setattr(identity, "fingerprint", lambda v: None if v is helper else fingerprint(v))
    with caplog.at_level(logging.INFO, logger="torchfarm"):
        results, saved = _with_the_skip(two_frames, x, None, graphs)
    _equal_eager(two_frames, x, results)
    assert any("has no fingerprint" in r.message for r in caplog.records)
    monkeypatch.undo()
    results, _ = _with_the_skip(two_frames, x, saved, graphs)
    _equal_eager(two_frames, x, results)
    assert counters["stats"]["unique_graphs"] == 1  # helper's frame traced, the first restored
    torch._dynamo.reset()


def test_a_package_error_while_recording_leaves_the_frame_out(monkeypatch):
    x, graphs = torch.randn(4, 8), {}

    add_inlined_source = CompilePackage.add_inlined_source

    def fails(package, sources):  # on the second frame only (it inlines helper)
        if helper.__code__ in sources:
            raise TypeError("Type <class 'ScriptFunction'> cannot be saved into a package")
        add_inlined_source(package, sources)

    monkeypatch.setattr(CompilePackage, "add_inlined_source", fails)
    results, saved = _with_the_skip(two_frames, x, None, graphs)
    _equal_eager(two_frames, x, results)
    monkeypatch.undo()
    results, _ = _with_the_skip(two_frames, x, saved, graphs)
    _equal_eager(two_frames, x, results)
    assert counters["stats"]["unique_graphs"] == 1  # one frame left out, one restored
    torch._dynamo.reset()


def one_frame(x):
    return helper(x) + 1


def test_an_object_that_is_not_the_traced_one_traces_again(monkeypatch):
    x, graphs = torch.randn(4, 8), {}
    _, saved = _with_the_skip(one_frame, x, None, graphs)

    def other_helper(x):  # another function where the traced one was
        return torch.sigmoid(x)

    monkeypatch.setitem(globals(), "helper", other_helper)
    results, _ = _with_the_skip(one_frame, x, saved, graphs)
    _equal_eager(one_frame, x, results)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


SAVE_STEPS = [
    (CompilePackage, "add_guarded_code"),
    (CompilePackage, "add_inlined_source"),
    (CompilePackage, "add_resume_function"),
    (CompilePackage, "add_import_source"),
    (CompilePackage, "add_backend_id"),
    (CompilePackage, "initialize"),
    (CompilePackage, "cache_entry"),
    (CheckFunctionManager, "serialize_guards"),
    (identity, "path"),
    (identity, "fingerprint"),
    (dynamo_package, "_portable"),
    (dynamo_package, "_dispatch_state"),
    (dynamo_package, "_known_locals"),
]
RESTORE_STEPS = [
    (CompilePackage, "install"),
    (package_module, "load_guards_state"),
    (package_module, "load_guard_manager"),
    (identity, "resolve"),
    (dynamo_package, "_add_identity_guards"),
    (dynamo_package, "_in_scope"),
    (dynamo_package, "_in_dispatch_state"),
]  # not _skip_installed_ids: in one process the graphs' names repeat (a per-process uuid)


def _raises(*args, **kwargs):
    raise RuntimeError("injected")


@pytest.mark.parametrize("owner, name", SAVE_STEPS + RESTORE_STEPS)
def test_a_fault_in_any_step_never_reaches_the_program(monkeypatch, owner, name):
    x, graphs = torch.randn(4, 8), {}
    restoring = (owner, name) in RESTORE_STEPS
    if restoring:  # a good package first, then the fault while it is restored and run
        _, saved = _with_the_skip(two_frames, x, None, graphs)
        assert saved is not None
    monkeypatch.setattr(owner, name, _raises)
    results, saved_now = _with_the_skip(two_frames, x, saved if restoring else None, graphs)
    _equal_eager(two_frames, x, results)
    monkeypatch.undo()
    if not restoring and saved_now is not None:  # what was saved under the fault restores
        results, _ = _with_the_skip(two_frames, x, saved_now, graphs)
        _equal_eager(two_frames, x, results)
    torch._dynamo.reset()
