"""Dynamo's output per frame, kept and installed again, so that a later process skips tracing.

Uses torch._dynamo.package.CompilePackage (`initialize`, `cache_entry`, `install`, whose
backends are looked up only by their `__compiled_fn_*` ids and need `after_deserialization`),
torch._dynamo.optimize's `package` and `guard_filter_fn` arguments,
CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES, a graph's meta["backend_id"], and
ShapeEnv.create_symbol/create_symintnode, and bytecode_transformation._unique_id_counter (see
_skip_installed_ids). Stock `caching_precompile` (which uses the same
package) and `aot_compile` are not used: both failed on transformers models in 2.13 (issue 19).

Verified (VERIFIED): the releases where the differential suite passed, fresh processes
through a real farm (tests/integration/test_skip_differential.py, test_skip_tracing.py) and in
one process (the unit tests); elsewhere `supported()` is False and every compile traces. The
internals this adds to (CompilePackage.add_guarded_code's caller's `check_fn`, the package
module's `load_guards_state`/`load_guard_manager`, guard sources' classes,
`add_lambda_guard(fn, parts, stack)`) are why a release must pass the suite to be listed.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import itertools
import logging
import pickle
import re
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._dynamo import bytecode_transformation
from torch._dynamo import package as package_module
from torch._dynamo.exc import PackageError
from torch._dynamo.guards import CheckFunctionManager
from torch._dynamo.package import CompilePackage, _BackendId, _FunctionId
from torch._dynamo.source import LocalSource
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from torchfarm.torch_adapter import identity
from torchfarm.torch_adapter.gate import release

log = logging.getLogger("torchfarm")

VERIFIED = ("2.11.0", "2.13.0", "2.15.0")
# The releases where the skip is on by default (TORCHFARM_SKIP_TRACING unset): those whose
# third-party zoo passed with it in a training loop (issue 49). None yet: on transformers'
# decoder LMs the identity checks failed on every call and Dynamo recompiled to its limit.
DEFAULT_ON: tuple[str, ...] = ()
# Guards on an object's identity (a module, function, class, closure cell, dict version) and
# guards on a function's `__defaults__`: CompilePackage cannot serialize the first (it
# bypasses the whole frame), and loading the second raised AttributeError out of
# torch.compile on transformers' wrappers (issue 19). identity.py turns each into a check
# that survives the process: see Package.keep_guard.
_IDENTITY_GUARDS = frozenset(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)


def supported() -> bool:
    return release(torch.__version__) in VERIFIED


def on_by_default() -> bool:
    return release(torch.__version__) in DEFAULT_ON


# The saved frames' format (identity checks, dispatch state), in the package key: a frame saved
# bypassed under other rules stays bypassed in every process that restores it, so packages of
# other rules are not used.
CHECKS = 3
_NO_VALUE = object()  # a guard without its object: its live check always fails (a retrace)


def _replaced(entry: Any) -> bool:
    """A guard Dynamo's package cannot save or load: identity, or on a default argument."""
    return bool({entry.guard_type, *entry.derived_guard_types} & _IDENTITY_GUARDS) or any(
        field in entry.name for field in ("__defaults__", "__kwdefaults__")
    )


class Package(CompilePackage):
    """A CompilePackage that never fails the step it records, and whose frames keep their
    identity and defaults guards as identity.Guard checks.

    It names a property's getter (transformers' `loss_function`: 2.13's _get_code_source
    cannot, and the cold step failed with PackageError in the issue's probe); a frame it still
    cannot name, or whose inlined sources it cannot read, is left out of the package
    (bypassed: traced in a later process)."""

    def __init__(self) -> None:
        super().__init__(fn=None)
        self._pending: identity.Guard | None = None  # the frame whose guards are being built
        self._pending_dispatch = _dispatch_state()

    def keep_guard(self, entries: Sequence[Any]) -> list[bool]:
        """Dynamo's guard_filter_fn, called once per compiled frame before its guards are
        built: each guard it cannot save becomes an identity check (see identity.py). Where
        the guard's path or object has no fingerprint, the frame is left out of the package
        (traced on a hit) and this process checks the object's identity by Dynamo's own
        expression. (Keeping the guard is no way out: 2.13 then fails the compile with
        "check_fn.guards_state must not be None".)"""
        checks: list[identity.Check] = []
        seen: list[Any] = []
        same: list[tuple[str, Any]] = []
        for e in entries:
            if not _replaced(e):
                continue
            steps = identity.path(e.orig_guard.originating_source)
            expected = identity.fingerprint(e.value) if steps and e.has_value else None
            if steps and expected is not None:
                checks.append((steps, expected))
                seen.append(e.value)
            else:
                same.append((e.name, e.value if e.has_value else _NO_VALUE))
                if self._current_entry is not None:
                    self._bypass(f"the guard on {e.name} has no fingerprint")
        scope = vars(sys.modules[self._current_entry.python_module]) if self._current_entry else {}
        self._pending = identity.Guard(checks, scope, seen, same) if checks or same else None
        self._pending_dispatch = _dispatch_state()
        return [not _replaced(e) for e in entries]

    def add_guarded_code(self, guards_state: bytes, dynamo_code: types.CodeType) -> None:
        """Saves the frame's identity checks with its guards and adds them to the guard
        Dynamo built for this process (the caller's `check_fn`: convert_frame passes only the
        guards' bytes)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            check_fn = sys._getframe(1).f_locals["check_fn"]
            _add_guard(check_fn.guard_manager, pending)
        entry = self._current_entry
        saved = len(entry.guarded_codes) if entry else 0
        super().add_guarded_code(guards_state, dynamo_code)
        if entry is not None and len(entry.guarded_codes) > saved:  # not a bypassed frame
            added = entry.guarded_codes[-1]
            added.torchfarm_checks = pending.checks if pending else []  # type: ignore[attr-defined]
            added.torchfarm_dispatch = self._pending_dispatch  # type: ignore[attr-defined]

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
                log.info("dynamo package: %s traces on every hit: no name", _name(code))

    def add_inlined_source(self, sources: list[types.CodeType]) -> None:
        try:
            super().add_inlined_source(sources)
        except Exception as e:  # e.g. OSError: no source for a code object
            self._bypass(f"an inlined function's source is unreadable ({e})")

    def _bypass(self, reason: str) -> None:
        """Leaves the current frame out of the package, saying why (a hit will trace it)."""
        assert self._current_entry is not None
        self.bypass_current_entry()
        log.info("dynamo package: %s traces on every hit: %s", self._current_name(), reason)

    def _current_name(self) -> str:
        code = next((c for c, e in self._codes.items() if e is self._current_entry), None)
        return _name(code) if code is not None else "a frame"

    def install(self, backends: dict[_BackendId, Any]) -> None:
        """CompilePackage.install, each frame's guard extended by its identity checks and
        built in the dispatch state its frame was traced in (the package module's two guard
        loaders, wrapped for the call: install builds the guards inline).

        A tensor guard expects the tensor's dispatch keys as modified by the thread's
        dispatch state when the guard is built: built outside the caller's autocast, it
        expects no Autocast key, fails inside it, and the frame traces on every hit."""
        saved = {
            id(guarded.guards_state): (
                getattr(guarded, "torchfarm_checks", None),
                getattr(guarded, "torchfarm_dispatch", None),
            )
            for entry in self._codes.values()
            for guarded in entry.guarded_codes
        }
        loading: list = []
        load_state, load_manager = (
            package_module.load_guards_state,
            package_module.load_guard_manager,
        )

        def guards_state(state: bytes) -> Any:
            loading[:] = [saved[id(state)]]
            return load_state(state)

        def guard_manager(state: Any, code: types.CodeType, scope: dict) -> Any:
            ((found, dispatch),) = loading
            if found is None or dispatch is None:  # saved by another version of this module
                raise PackageError("a frame saved without its identity checks or dispatch state")
            with _in_dispatch_state(dispatch):
                manager = load_manager(state, code, scope)
            if found:
                _add_guard(manager, identity.Guard(found, scope))
            return manager

        with _replaced_in(
            package_module, load_guards_state=guards_state, load_guard_manager=guard_manager
        ):
            super().install(backends)


def _name(code: types.CodeType) -> str:
    return getattr(code, "co_qualname", code.co_name)  # Python >= 3.11


@contextlib.contextmanager
def _replaced_in(module: types.ModuleType, **values: Any) -> Iterator[None]:
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _dispatch_state() -> tuple[int, int]:
    """This thread's included and excluded dispatch keys (autocast among them)."""
    return (
        torch._C._dispatch_tls_local_include_set().raw_repr(),
        torch._C._dispatch_tls_local_exclude_set().raw_repr(),
    )


def _in_dispatch_state(state: tuple[int, int]) -> Any:
    include, exclude = (torch._C.DispatchKeySet.from_raw_repr(raw) for raw in state)
    return torch._C._ForceDispatchKeyGuard(include, exclude)


def _add_guard(manager: Any, guard: identity.Guard) -> None:
    manager.root.add_lambda_guard(guard, guard.describe(), None)


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


def new_package() -> Package:
    return Package()


def entry_function(target: Callable) -> Callable:
    """The function Dynamo traces first: a module's forward, or the function itself."""
    return target.forward if isinstance(target, torch.nn.Module) else target


def optimize(
    backend: Callable, package: Package, dynamic: bool | None, fullgraph: bool
) -> Callable[[Callable], Callable]:
    """torch.compile's Dynamo wrapper, recording into `package`."""
    return torch._dynamo.optimize(
        backend,
        nopython=fullgraph,
        dynamic=dynamic,
        package=package,
        guard_filter_fn=package.keep_guard,
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
