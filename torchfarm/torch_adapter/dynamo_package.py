"""Dynamo's output per frame, kept and installed again, so that a later process skips tracing.

Uses torch._dynamo.package.CompilePackage (`initialize`, `cache_entry`, `install`, whose
backends are looked up only by their `__compiled_fn_*` ids and need `after_deserialization`),
torch._dynamo.optimize's `package` and `guard_filter_fn` arguments,
CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES, a graph's meta["backend_id"], and
ShapeEnv.create_symbol/create_symintnode, and bytecode_transformation._unique_id_counter (see
_skip_installed_ids). Stock `caching_precompile` (which uses the same
package) and `aot_compile` are not used: both failed on transformers models in 2.13 (issue 19).

Verified: torch 2.13.0 (CPU: the unit test and tests/integration/test_skip_tracing.py, fresh
processes through a real farm). On 2.11.0 and 2.15.0 every name above exists with the same
signature (read in their sources) and the unit test (record, reset, install, no frame traced,
a failed guard traced again) passes, but no farm run was made: they are not in VERIFIED, so
there `supported()` is False and every compile traces as before. Adding a release to VERIFIED
after `test_skip_tracing.py` passes on it is the whole change.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import pickle
import re
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._dynamo import bytecode_transformation
from torch._dynamo.exc import PackageError
from torch._dynamo.guards import CheckFunctionManager
from torch._dynamo.package import CompilePackage, _BackendId, _FunctionId
from torch._dynamo.source import LocalSource
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from torchfarm.torch_adapter.gate import release

VERIFIED = ("2.13.0",)
# Guards on an object's identity (a module, function, class, closure cell, dict version):
# CompilePackage cannot serialize them and bypasses the whole frame if one is present.
# Dropping them keeps every guard on values, types, shapes and tensors; what is lost is a
# recompile when a global function, class or module is rebound to another object.
_IDENTITY_GUARDS = frozenset(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)


def supported() -> bool:
    return release(torch.__version__) in VERIFIED


def keep_guard(entries: Sequence[Any]) -> list[bool]:
    """Dynamo's guard_filter_fn: drop the identity guards (see above) and guards on a
    function's `__defaults__` (transformers' wrappers: loading them raised AttributeError out
    of torch.compile in the issue's probe)."""
    return [
        not ({e.guard_type, *e.derived_guard_types} & _IDENTITY_GUARDS)
        and "__defaults__" not in e.name
        for e in entries
    ]


class _Package(CompilePackage):
    """A CompilePackage that never fails the step it records. It names a property's getter
    (transformers' `loss_function`: 2.13's _get_code_source cannot, and the cold step failed
    with PackageError in the issue's probe); a frame it still cannot name, or whose inlined
    sources it cannot read, is left out of the package (bypassed: traced in a later process)."""

    def _add_user_function(self, code: types.CodeType) -> None:
        try:
            super()._add_user_function(code)
        except PackageError:
            module = inspect.getmodule(code) or inspect.getmodule(self._innermost_fn)
            assert module is not None
            getter = _property_getter(module, code)
            if getter:
                self._add_function(
                    code, module.__name__, _FunctionId(getter), code_source="fget.__code__"
                )
            else:
                self._add_function(code, module.__name__)
                self._codes[code].bypassed = True

    def add_inlined_source(self, sources: list[types.CodeType]) -> None:
        try:
            super().add_inlined_source(sources)
        except Exception:  # e.g. OSError: no source for a code object
            self.bypass_current_entry()


def _property_getter(module: types.ModuleType, code: types.CodeType) -> str | None:
    """`Class.name` where `code` is the getter of that class's property `name`, else None."""
    owner: Any = module
    qualname: str = getattr(code, "co_qualname", "")  # Python >= 3.11
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part, None)
    prop = getattr(owner, "__dict__", {}).get(name)
    if isinstance(prop, property) and getattr(prop.fget, "__code__", None) is code:
        return qualname
    return None


def new_package() -> CompilePackage:
    return _Package(fn=None)


def entry_function(target: Callable) -> Callable:
    """The function Dynamo traces first: a module's forward, or the function itself."""
    return target.forward if isinstance(target, torch.nn.Module) else target


def optimize(
    backend: Callable, package: CompilePackage, dynamic: bool | None, fullgraph: bool
) -> Callable[[Callable], Callable]:
    """torch.compile's Dynamo wrapper, recording into `package`."""
    return torch._dynamo.optimize(
        backend, nopython=fullgraph, dynamic=dynamic, package=package, guard_filter_fn=keep_guard
    )


def record(package: CompilePackage, target: Callable) -> None:
    """Start recording a fresh package for `target`'s frames."""
    package.initialize(entry_function(target), None)


def install(
    package: CompilePackage, target: Callable, dynamo: bytes, backends: dict[str, Callable]
) -> None:
    """Install a saved package: its frames' guards and bytecode, `backends` by their ids. Raises
    (any type) if it does not fit this process: torch/Python versions, changed sources, a
    global it names missing; the caller then records a fresh package."""
    entry, modules = pickle.loads(dynamo)
    for module, names in modules.items():  # before install: its bytecode names them
        for name, imported in names.items():
            vars(sys.modules[module]).setdefault(name, importlib.import_module(imported))
    package.initialize(entry_function(target), entry)
    try:
        package.install({_BackendId(bid): _Installed(fn) for bid, fn in backends.items()})
    except BaseException:
        package.uninstall()
        raise
    _skip_installed_ids({code.python_module for code in entry.codes})


# The names Dynamo numbers with its process-wide unique_id counter and installs as globals.
_NUMBERED = re.compile(r"__(?:builtins_dict__|resume_at_\d+|compiled_fn)_(\d+)")


def _skip_installed_ids(modules: set[str]) -> None:
    """Moves Dynamo's unique_id counter past every number the installed package used: a frame
    traced later in this process (its guards failed) would otherwise install its builtins dict
    as `__builtins_dict___0` again, and Dynamo fails that trace on the name clash."""
    numbers = [
        int(m.group(1))
        for name in modules
        for key in vars(sys.modules[name])
        if (m := _NUMBERED.match(key))
    ]
    if numbers:
        current = next(bytecode_transformation._unique_id_counter)
        bytecode_transformation._unique_id_counter = itertools.count(max(current, *numbers) + 1)


def dumps(package: CompilePackage) -> bytes:
    """The package's entry, and the modules its bytecode reads through globals that Dynamo
    named by object id (`___module_collections_<id>_c3`): CompilePackage does not save them,
    and a restored frame failed with NameError on transformers' GPT-2 without them."""
    entry = package.cache_entry()
    modules: dict[str, dict[str, str]] = {}
    for code in entry.codes:
        scope = vars(sys.modules[code.python_module])
        for guarded in code.guarded_codes:
            for name in _names(guarded.dynamo_code):
                value = scope.get(name)
                if name.startswith("___module_") and isinstance(value, types.ModuleType):
                    modules.setdefault(code.python_module, {})[name] = value.__name__
    return pickle.dumps((entry, modules))


def _names(code: Any) -> set[str]:
    """Global names a SerializedCode (and the code objects nested in it) reads."""
    nested = [c for c in code.co_consts if hasattr(c, "co_names")]
    return set(code.co_names).union(*(_names(c) for c in nested))


def backend_ids(dynamo: bytes) -> set[str]:
    """The graphs the package's frames call (a bypassed frame's are never installed)."""
    entry, _ = pickle.loads(dynamo)
    return {b for code in entry.codes if not code.bypassed for b in code.backend_ids}


def backend_id(gm: torch.fx.GraphModule) -> str:
    """The `__compiled_fn_*` name Dynamo's bytecode calls this graph by."""
    return str(gm.meta.get("backend_id", ""))


def sized_symints(sizes: Sequence[int]) -> list[object]:
    """SymInts of one symbol each, with these sizes as hints: what compiler/guards.hold reads
    (the sizes of a graph's SymInt inputs t0, t1, ... in the process that traced it)."""
    env = ShapeEnv(duck_shape=False, specialize_zero_one=False)
    symints: list[object] = []
    for i, size in enumerate(sizes):
        symbol = env.create_symbol(size, LocalSource(f"t{i}"), dynamic_dim=DimDynamic.DYNAMIC)
        symints.append(env.create_symintnode(symbol, hint=size))
    return symints


class _Installed:
    """A compiled graph as CompilePackage.install expects a deserialized backend."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def after_deserialization(self) -> Callable:
        return self.fn
