"""Dynamo's output per frame, kept and installed again, so that a later process skips tracing.

Uses torch._dynamo.package.CompilePackage (`initialize`, `cache_entry`, `install`, whose
backends are looked up only by their `__compiled_fn_*` ids and need `after_deserialization`),
torch._dynamo.optimize's `package` and `guard_filter_fn` arguments,
CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES, a graph's meta["backend_id"], and
ShapeEnv.create_symbol/create_symintnode, bytecode_transformation._unique_id_counter and
output_graph._compile_id_counter (see _skip_installed_ids), and torch._guards.Source (its
dataclass fields: _SourcePickler). Stock `caching_precompile` (which
uses the same package) and `aot_compile` are not used: both failed on transformers models in
2.13 (issue 19).

Verified (VERIFIED): the releases where the differential suite passed, fresh processes
through a real farm (tests/integration/test_skip_differential.py, test_skip_tracing.py) and in
one process (the unit tests); elsewhere `supported()` is False and every compile traces. The
internals this adds to (CompilePackage.add_guarded_code's caller's `check_fn`, the package
module's `load_guards_state`/`load_guard_manager`, guard sources' classes,
`add_lambda_guard(fn, parts, stack)`) are why a release must pass the suite to be listed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import io
import itertools
import logging
import pickle
import re
import sys
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._dynamo import bytecode_transformation, output_graph
from torch._dynamo import package as package_module
from torch._dynamo.exc import PackageError
from torch._dynamo.guards import CheckFunctionManager
from torch._dynamo.package import CompilePackage, _BackendId, _FunctionId
from torch._dynamo.source import LocalSource
from torch._guards import Source
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from torchfarm.torch_adapter.gate import release
from torchfarm.torch_adapter.trace import identity, script_functions

log = logging.getLogger("torchfarm")

VERIFIED = ("2.11.0", "2.13.0", "2.15.0")
# On 2.11 a default argument changed after the install runs the restored code, as plain
# torch.compile on 2.11 does in one process: its Dynamo emits no guard on a called function's
# `__defaults__` (2.13 guards `G['scaled'].__defaults__[0]`). The unit test holds the skip to
# what torch itself does there (tests/unit/torch_adapter/test_dynamo_package.py); a fresh
# process, which checks the sources Dynamo inlined (an edited default included) and every
# rebound global, is right on every release.
# The releases where the skip is on by default (TORCHFARM_SKIP_TRACING unset): those whose
# third-party zoo passed with it in a training loop (issue 49; docs/zoo.md): every model of
# the zoo that imports there, both entry points, both processes: no exception, no step off
# eager, no graph or recompile beyond inductor's, and the alternating steady step within the
# issue's 1.05 median / 1.2 max of inductor's. 2.13.0 (2026-11-28/29, CPU) and 2.11.0
# (2026-11-29, CPU; GPU zoo on the H200; docs/benchmarks.md). 2.15.0 is verified by the
# differential suite but its zoo has not run.
DEFAULT_ON: tuple[str, ...] = ("2.11.0", "2.13.0")
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
CHECKS = 5


def _replaced(entry: Any) -> bool:
    """A guard Dynamo's package cannot save or load: identity, or on a default argument."""
    return bool({entry.guard_type, *entry.derived_guard_types} & _IDENTITY_GUARDS) or any(
        field in entry.name for field in ("__defaults__", "__kwdefaults__")
    )


class Package(CompilePackage):
    """A CompilePackage that never fails the step it records: a frame it cannot save is left
    out of it (bypassed: traced in a later process), with one log line naming the frame.

    The process that traces keeps every guard Dynamo built, identity guards included: it
    guards exactly as Dynamo does. Only the saved guards leave out those the package cannot
    save; each is saved with its path and fingerprint (identity.py) and built again, on the
    object found in the restoring process, when the package is installed.

    It names a property's getter (transformers' `loss_function`: 2.13's _get_code_source
    cannot, and the cold step failed with PackageError in the issue's probe)."""

    def __init__(self) -> None:
        super().__init__(fn=None)
        self._pending: list[tuple[Any, str]] = []  # the frame's identity guards, fingerprinted
        self._pending_late: list[tuple[tuple[identity.Step, ...], str]] = []  # see LateChecks
        self._pending_dispatch: tuple[int, int] | None = None
        self._left_out_entries: set[int] = set()  # ids of the frames' entries left out

    def initialize(self, fn: Any, dynamo: Any = None, ignore_inlined_sources: bool = False) -> None:
        """As CompilePackage's, with the entry frame's module read from its globals: a
        `functools.wraps` wrapper (transformers' forwards) names the wrapped function's
        module, while its code runs in, and Dynamo installs its globals in, its own."""
        super().initialize(fn, dynamo, ignore_inlined_sources)
        inner: Any = self._innermost_fn
        scope = getattr(getattr(inner, "__func__", inner), "__globals__", {})
        if dynamo is None and "__name__" in scope:
            self._codes[inner.__code__].python_module = scope["__name__"]

    def keep_guard(self, entries: Sequence[Any]) -> list[bool]:
        """Dynamo's guard_filter_fn, called once per compiled frame before its guards are built:
        keeps every guard in this process, and leaves those the package cannot save out of
        the saved ones only (the caller's `serialize_guards`), each saved with its path and
        fingerprint. A guard on a local that a restoring process cannot know at install (any
        local of a frame after the first: a resume function's, a wrapper's called after a
        graph break) is checked on the frame's locals at call time instead (LateChecks). A
        guard with no path or no fingerprint leaves the frame out of the package."""
        _forget_first_build(entries)
        replaced = [e for e in entries if _replaced(e)]
        # first, so that the frame's guards save in any case (else 2.13 fails the compile)
        manager = sys._getframe(1).f_locals["self"]  # the frame's CheckFunctionManager
        left_out = {id(e.orig_guard) for e in replaced}
        manager.serialize_guards = functools.partial(self._serialize, manager, left_out)
        self._pending, self._pending_late = [], []
        try:
            self._pending_dispatch = _dispatch_state()
            known = _known_locals(self._innermost_fn) if self._in_entry_frame() else {}
            for e in replaced:
                steps = identity.path(e.orig_guard.originating_source)
                if not (steps and e.has_value):
                    return self._left_out(entries, f"the guard on {e.name} has no path")
                expected = identity.fingerprint(e.value)
                if expected is None:
                    return self._left_out(entries, f"the guard on {e.name} has no fingerprint")
                if steps[0][0] == "local" and steps[0][1] not in known:
                    self._pending_late.append((steps, expected))
                else:
                    self._pending.append((_portable(e.orig_guard), expected))
            _dumps((self._pending, self._pending_late))  # fail here, not at the save
        except Exception as e:  # never the user's step
            return self._left_out(entries, f"{type(e).__name__}: {e}")
        return [True] * len(entries)

    def _serialize(self, manager: Any, left_out: set[int], builder: Any, guards: list, graph: Any):
        """CheckFunctionManager.serialize_guards without the guards the package cannot save,
        and with module-level TorchScript functions saved by name (script_functions.py). A
        guard it still cannot save (a local class's type, a ScriptFunction no name reaches)
        leaves the frame out of the package here: Dynamo's own handling, a PackageError,
        failed the compile with "check_fn.guards_state must not be None" in 2.13."""
        try:
            kept = [script_functions.savable(g, builder) for g in guards if id(g) not in left_out]
            with script_functions.saved_by_name():
                return CheckFunctionManager.serialize_guards(manager, builder, kept, graph)
        except Exception as e:
            if self._current_entry is not None:
                self._bypass(f"its guards cannot be saved ({type(e).__name__}: {e})")
            return b""  # a bypassed frame's guards are never read

    def _left_out(self, entries: Sequence[Any], reason: str) -> list[bool]:
        self._pending, self._pending_late = [], []
        if self._current_entry is not None:
            self._bypass(reason)
        return [True] * len(entries)

    def _in_entry_frame(self) -> bool:
        entry = self._codes.get(getattr(self._innermost_fn, "__code__", None))  # type: ignore[arg-type]
        return entry is not None and entry is self._current_entry

    def add_guarded_code(self, guards_state: bytes, dynamo_code: types.CodeType) -> None:
        """Saves the frame's identity guards and dispatch state with its guards."""
        entry = self._current_entry
        saved = len(entry.guarded_codes) if entry else 0
        with self._or_bypass("its guards"):
            super().add_guarded_code(guards_state, dynamo_code)
            if entry is not None and id(entry) in self._left_out_entries:
                entry.bypassed = True  # 2.15's add_guarded_code cleared it
            if entry is not None and len(entry.guarded_codes) > saved:  # not bypassed
                added = entry.guarded_codes[-1]
                added.torchfarm_checks = self._pending  # type: ignore[attr-defined]
                added.torchfarm_late_checks = self._pending_late  # type: ignore[attr-defined]
                added.torchfarm_dispatch = self._pending_dispatch  # type: ignore[attr-defined]

    def _add_user_function(self, code: types.CodeType) -> None:
        try:
            super()._add_user_function(code)
        except Exception:
            module = inspect.getmodule(code) or inspect.getmodule(self._innermost_fn)
            getter = _property_getter(module, code) if module else None
            if getter and module:
                self._add_function(
                    code, module.__name__, _FunctionId(getter), code_source="fget.__code__"
                )
                return
            self._add_function(code, module.__name__ if module else "")
            self._codes[code].bypassed = True
            log.info("dynamo package: %s traces on every hit: no name", _name(code))

    def add_inlined_source(self, sources: list[types.CodeType]) -> None:
        with self._or_bypass("an inlined function's source"):
            super().add_inlined_source(sources)

    def add_resume_function(self, *args: Any, **kwargs: Any) -> None:
        with self._or_bypass("a resume function"):
            super().add_resume_function(*args, **kwargs)

    def add_import_source(self, alias: str, module_name: str) -> None:
        with self._or_bypass(f"the import of {module_name}"):
            super().add_import_source(alias, module_name)

    def add_backend_id(self, backend_id: str, backend: Any | None = None) -> None:
        with self._or_bypass(f"graph {backend_id}"):
            super().add_backend_id(backend_id, backend)

    @contextlib.contextmanager
    def _or_bypass(self, what: str) -> Iterator[None]:
        """Any exception while recording leaves the current frame out of the package instead
        of reaching the user's code (2.11 raised TypeError on a ScriptFunction)."""
        try:
            yield
        except Exception as e:
            if self._current_entry is None:
                log.info("dynamo package: not saved: %s (%s: %s)", what, type(e).__name__, e)
                self._broken = True
            else:
                self._bypass(f"{what} cannot be saved ({type(e).__name__}: {e})")

    _broken = False  # a failure outside any frame: the package is not saved

    def _bypass(self, reason: str) -> None:
        """Leaves the current frame out of the package, saying why (a hit will trace it).
        Marked here, not through CompilePackage's own call (2.13's `bypass_current_entry`
        is gone in 2.15), and again after add_guarded_code, which 2.15 ends by clearing it."""
        entry = self._current_entry
        assert entry is not None
        self._left_out_entries.add(id(entry))
        if not entry.bypassed:
            entry.bypassed = True
            log.info("dynamo package: %s traces on every hit: %s", self._current_name(), reason)

    def _current_name(self) -> str:
        code = next((c for c, e in self._codes.items() if e is self._current_entry), None)
        return _name(code) if code is not None else "a frame"

    def install(self, backends: dict[_BackendId, Any]) -> None:
        """CompilePackage.install, each frame's guards built in the dispatch state its frame
        was traced in, with its identity guards built again on this process's objects (the
        package module's two guard loaders, wrapped for the call: install builds the guards
        inline).

        A tensor guard expects the tensor's dispatch keys as modified by the thread's
        dispatch state when the guard is built: built outside the caller's autocast, it
        expects no Autocast key, fails inside it, and the frame traces on every hit."""
        saved = {
            id(guarded.guards_state): (
                getattr(guarded, "torchfarm_checks", None),
                getattr(guarded, "torchfarm_late_checks", None),
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
        entry_code = getattr(self._innermost_fn, "__code__", None)

        def guards_state(state: bytes) -> Any:
            loading[:] = [saved[id(state)]]
            return load_state(state)

        def guard_manager(state: Any, code: types.CodeType, scope: dict) -> Any:
            ((checks, late, dispatch),) = loading
            if None in (checks, late, dispatch):  # saved by another version of this module
                raise PackageError("a frame saved without its identity checks or dispatch state")
            known = _known_locals(self._innermost_fn) if code is entry_code else {}
            missing = _add_identity_guards(state, checks, known, scope)
            with _in_dispatch_state(dispatch):
                manager = load_manager(state, code, scope)
            if missing:  # not the traced objects: this frame is traced again
                log.info("dynamo package: %s traced: %s", _name(code), missing)
                manager.root.add_lambda_guard(_never, [repr(missing)], None)
            elif late:
                manager.root.add_lambda_guard(LateChecks(late), LateChecks.describe(late), None)
            return manager

        with _replaced_in(
            package_module, load_guards_state=guards_state, load_guard_manager=guard_manager
        ):
            super().install(backends)


def _never(frame_locals: Any) -> bool:
    return False


class LateChecks:
    """Identity guards on a frame's own locals that no process knows before the frame runs (a
    resume function's, or a wrapper's called after a graph break): each path resolved on the
    call's locals, its object's fingerprint compared with the traced one's. The object that
    matched is kept, so a later call that finds the same object costs one `is` per guard; one
    made anew with the same fingerprint matches too (no recompile storm), another fails the
    guard and Dynamo traces the frame."""

    def __init__(self, checks: Sequence[tuple[tuple[identity.Step, ...], str]]) -> None:
        self.checks = [(identity.resolver(steps), expected) for steps, expected in checks]
        self.matched: list[Any] = [_UNSEEN] * len(self.checks)

    def __call__(self, frame_locals: Any) -> bool:
        for i, (resolve, expected) in enumerate(self.checks):
            try:
                value = resolve(frame_locals, {})
            except Exception:  # the path is gone
                return False
            if value is not self.matched[i]:
                if identity.fingerprint(value) != expected:
                    return False
                self.matched[i] = value
        return True

    @staticmethod
    def describe(checks: Sequence[tuple[tuple[identity.Step, ...], str]]) -> list[str]:
        return [f"torchfarm identity of {steps}: {expected}" for steps, expected in checks]


_UNSEEN = object()


def _known_locals(fn: Any) -> dict[str, Any]:
    """The entry frame's locals a restoring process knows before any call: the module a
    method is bound to (`self`) and the function's closure."""
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    if code is None:
        return {}
    known = {}
    if hasattr(fn, "__self__") and code.co_argcount:
        known[code.co_varnames[0]] = fn.__self__
    for name, cell in zip(code.co_freevars, func.__closure__ or ()):
        with contextlib.suppress(ValueError):  # an empty cell
            known[name] = cell.cell_contents
    return known


def _portable(guard: Any) -> Any:
    """A guard as the package saves it (serialize_guards' own treatment): no weak references."""
    create_fn = guard.create_fn
    if isinstance(create_fn, functools.partial):
        deref = lambda x: x() if isinstance(x, weakref.ref) else x  # noqa: E731
        create_fn = functools.partial(
            create_fn.func,
            *map(deref, create_fn.args),
            **{k: deref(v) for k, v in create_fn.keywords.items()},
        )
    return dataclasses.replace(
        guard, obj_weakref=None, guarded_class_weakref=None, create_fn=create_fn
    )


def _add_identity_guards(
    state: Any, checks: list[tuple[Any, str]], known: dict[str, Any], scope: dict
) -> str:
    """Adds each saved identity guard to the frame's guards, built by Dynamo's own builder on
    the object its path reaches in this process (resolved once, here), if that object has the
    traced one's fingerprint; else returns which one does not."""
    guards = state.output_graph._guards.inner
    for guard, expected in checks:
        steps = identity.path(guard.originating_source)
        try:
            found = identity.fingerprint(identity.resolve(steps or (), known, scope))
        except Exception:  # the path is gone
            found = None
        if found != expected:
            return f"{guard.name} is not the traced object"
        create_fn = functools.partial(_in_scope, known, scope, guard.create_fn)
        guards.add(dataclasses.replace(guard, create_fn=create_fn))
    return ""


def _in_scope(local: dict, scope: dict, create_fn: Callable, builder: Any, guard: Any) -> None:
    """Builds `guard` with Dynamo's own builder function, reading values from this process's
    objects instead of the package's stand-ins (copies, by value, of what the trace saw).
    The dicts whose key order the frame guards are these objects too: the builder knows them
    by the stand-ins' ids, and a guard through one (`G['ACTS']['gelu']`, a function in a
    dict the frame iterates) failed the install with "DictGuardManager must guard on keys"
    (deberta-v2, issue 49)."""
    saved = builder.scope, builder.src_get_value_cache, builder.key_order_guarded_dict_ids
    builder.scope = {**saved[0], "L": local, "G": scope}
    builder.src_get_value_cache = {}
    builder.key_order_guarded_dict_ids = set(saved[2])
    for source in builder.check_fn_manager.output_graph.guard_on_key_order:
        with contextlib.suppress(Exception):  # not reachable from here: not this guard's
            builder.key_order_guarded_dict_ids.add(id(builder.get(source)))
    try:
        create_fn(builder, guard)
    finally:
        builder.scope, builder.src_get_value_cache, builder.key_order_guarded_dict_ids = saved


def _forget_first_build(entries: Sequence[Any]) -> None:
    """Clears what the guards' first build recorded on them (their export info). With a
    guard_filter_fn Dynamo builds a frame's guards twice, on the same Guard objects, reading
    every source again: a value made anew on each read (transformers 5.23's config views,
    `_PerLayerConfigView`) then fails 2.11's "Guarded object must be identical" check in the
    second build, and the compile raised into the training step."""
    for e in entries:
        guard = e.orig_guard
        guard.guard_types = guard.code_list = guard.obj_weakref = None
        guard.guarded_class_weakref = None


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
    global it names missing; the caller then records a fresh package, and the module scopes
    are as before the call.

    Every global the install added is removed on failure, not only those CompilePackage's
    uninstall knows: the modules the package's bytecode reads by Dynamo's by-id names
    (`___module_collections_<id>_c12`, `_<id>_c5`) were left behind, with Dynamo's counters
    not moved past them (_skip_installed_ids), and the fresh trace of a process forked like
    the saving one made the same names: "Name ... already exists in scope" raised into the
    user's step (deberta-v2, whose guards failed to load: issue 49)."""
    entry, modules = pickle.loads(dynamo)
    scopes = {code.python_module for code in entry.codes} | set(modules)
    before = {name: set(vars(sys.modules[name])) for name in scopes if name in sys.modules}
    try:
        for module, names in modules.items():  # before install: its bytecode names them
            for name, imported in names.items():
                vars(sys.modules[module]).setdefault(name, importlib.import_module(imported))
        package.initialize(entry_function(target), entry)
        package.install({_BackendId(bid): _Installed(fn) for bid, fn in backends.items()})
        _skip_installed_ids(scopes)
    except BaseException:
        with contextlib.suppress(Exception):  # not initialized: nothing installed
            package.uninstall()
        for name, names in before.items():  # builtins dicts too, which uninstall leaves
            scope = vars(sys.modules[name])
            for key in set(scope) - names:
                if getattr(scope[key], "__name__", None) != f"{name}.{key}":  # a submodule
                    del scope[key]  # imported meanwhile stays its package's attribute
        raise


# The names Dynamo numbers with its process-wide unique_id counter and installs as globals.
_NUMBERED = re.compile(r"__(?:builtins_dict__|resume_at_\d+|compiled_fn)_(\d+)")


def _skip_installed_ids(modules: set[str]) -> None:
    """Moves Dynamo's two process-wide counters past every number the installed package used:
    a frame traced later in this process (its guards failed, or a new one) would otherwise
    install a global under a name the package already holds, and Dynamo fails that trace on
    the clash ("Name ... already exists in scope"). `unique_id` numbers `__builtins_dict___0`
    and its kind; the compile id ends the names Dynamo gives objects by their id
    (`___module_collections_<id>_c4`), and a process forked from the one that saved the
    package (or one whose allocator placed the module at the same address) has the same ids."""
    names = [key for name in modules for key in vars(sys.modules[name])]
    numbers = [int(m.group(1)) for key in names if (m := _NUMBERED.match(key))]
    if numbers:
        current = next(bytecode_transformation._unique_id_counter)
        bytecode_transformation._unique_id_counter = itertools.count(max(current, *numbers) + 1)
    compiles = [int(m.group(1)) for key in names if (m := _BY_ID.search(key))]
    if compiles:
        current = next(output_graph._compile_id_counter)
        output_graph._compile_id_counter = itertools.count(max(current, *compiles) + 1)


# The names OutputGraph.install_global_by_id gives: f"{prefix}_{id(value)}_c{compile_id}".
_BY_ID = re.compile(r"_\d+_c(\d+)$")


def dumps(package: CompilePackage) -> bytes:
    """The package's entry, and the modules its bytecode reads through globals, among them
    those Dynamo named by object id (`___module_collections_<id>_c3`; `_<id>_c0` for torch
    itself, install_global_by_id("", torch)): CompilePackage does not save them, and a
    restored frame failed with NameError on transformers' GPT-2 without them (2.13). So are
    the modules the frame's identity checks start from: on 2.11 a guard on
    `G['_<id>_c0'].Tensor`, a name its bytecode never reads, found no such global, and
    transformers' forward wrappers traced on every hit (H200, llama and gpt2)."""
    if getattr(package, "_broken", False):
        raise PackageError("a step of the recording failed outside any frame (logged)")
    entry = package.cache_entry()
    modules: dict[str, dict[str, str]] = {}
    for code in entry.codes:
        scope = vars(sys.modules[code.python_module])
        for guarded in code.guarded_codes:
            for name in _names(guarded.dynamo_code) | _check_roots(guarded):
                value = scope.get(name)
                if isinstance(value, types.ModuleType):
                    modules.setdefault(code.python_module, {})[name] = value.__name__
    return _dumps((entry, modules))


class _SourcePickler(pickle.Pickler):
    """Dynamo's sources pickled as torch 2.13 does: their init fields only. 2.11's reduce
    passes the fields `__post_init__` derives too (DefaultsSource's `field` and `_name`), so
    the package, once loaded, raised TypeError: transformers' BERT on 2.11 (H200) was never
    saved, and each process paid the attempt."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Source) and dataclasses.is_dataclass(obj):
            fields = dataclasses.fields(obj)
            return type(obj), tuple(getattr(obj, f.name) for f in fields if f.init)
        return NotImplemented


def _dumps(obj: object) -> bytes:
    buffer = io.BytesIO()
    _SourcePickler(buffer).dump(obj)
    return buffer.getvalue()


def _check_roots(guarded: Any) -> set[str]:
    """The globals a frame's saved identity checks start from."""
    steps = [identity.path(g.originating_source) for g, _ in guarded.torchfarm_checks or ()]
    return {s[0][1] for s in steps if s and s[0][0] == "global"}


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
