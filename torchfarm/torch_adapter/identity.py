"""Dynamo's guards on an object's identity (ID_MATCH on a global function, a module attribute,
a class; a closure cell) and on default arguments, as checks that hold across processes.

Dynamo's package cannot save those guards (torch_adapter/dynamo_package.py), and dropping them
served stale code: a global function rebound after the compile still ran the old graph. So each
becomes a check: the guard's path (from the frame's locals or its module's globals, through
attributes, items and defaults) and a fingerprint of the object it found there (a module or a
class by qualified name; a function by module, qualified name, a hash of its code, constants,
defaults and closure; a constant by its repr). The check runs as a guard of the frame, in the
process that traced it and in every process that restores it: an object that does not match
fails the guard, so Dynamo traces the frame again. A guard whose path or object has no
fingerprint is not replaced: Dynamo then leaves that frame out of the package (it traces on a
hit), and no other frame.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import operator
import threading
import types
from collections.abc import Mapping
from typing import Any

import torch
from torch._dynamo import source as sources

# One step of a path: ("local" | "global" | "attr" | "item" | "key_at" | "defaults" |
# "kwdefaults" | "type", name or index)
Step = tuple[str, Any]
Check = tuple[tuple[Step, ...], str]  # a path and the fingerprint of what it must reach
_DEPTH = 24  # nested closures / containers a fingerprint follows before it gives up
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)
_ATTRIBUTES = {  # sources that read one attribute
    sources.TypeDictSource: "__dict__",
    sources.TypeMROSource: "__mro__",
    sources.ClosureSource: "__closure__",
}
_BUILTINS = (
    types.BuiltinFunctionType,
    types.WrapperDescriptorType,
    types.MethodDescriptorType,
    types.MethodWrapperType,
    types.ClassMethodDescriptorType,
    types.GetSetDescriptorType,
)


def path(source: Any) -> tuple[Step, ...] | None:
    """The steps from the frame to the object `source` names, or None for a source kind whose
    value cannot be found again from the frame's locals and globals."""
    if isinstance(source, sources.LocalSource):
        return (("local", source.local_name),)
    if isinstance(source, sources.GlobalSource):
        return (("global", source.global_name),)
    if isinstance(source, sources.NNModuleSource):  # a marker around its base
        return path(source.base)
    step: Step | None = None
    if isinstance(source, sources.AttrSource):
        step = ("attr", source.member)
    elif isinstance(source, sources.DefaultsSource):
        step = ("kwdefaults" if source.is_kw else "defaults", source.idx_key)
    elif isinstance(source, sources.GetItemSource) and not source.index_is_slice:
        step = ("item", source.index)
    elif isinstance(source, (sources.DictGetItemSource, sources.DictSubclassGetItemSource)):
        index = source.index
        if isinstance(index, sources.ConstDictKeySource):  # the dict's key number i
            step = ("key_at", index.index)
        else:
            step = ("item", index)
    elif isinstance(source, sources.TypeSource):
        step = ("type", None)
    elif type(source) in _ATTRIBUTES:
        step = ("attr", _ATTRIBUTES[type(source)])
    if step is None or not isinstance(step[1], (int, str, type(None))):
        return None
    base = path(source.base)
    return None if base is None else (*base, step)


def resolve(steps: tuple[Step, ...], frame_locals: Mapping, scope: Mapping) -> Any:
    """The object at `steps`; raises (KeyError, AttributeError, ...) where the path is gone."""
    (kind, name), *rest = steps
    value = frame_locals[name] if kind == "local" else scope[name]
    for kind, name in rest:
        if kind == "attr":
            value = getattr(value, name)
        elif kind == "item":
            value = value[name]
        elif kind == "key_at":  # as Dynamo reads it: past a subclass's __getitem__
            value = dict.__getitem__(value, list(dict.keys(value))[name])
        elif kind == "defaults":
            value = value.__defaults__[name]
        elif kind == "kwdefaults":
            value = value.__kwdefaults__[name]
        else:
            value = type(value)
    return value


def fingerprint(value: Any, depth: int = 0) -> str | None:
    """What must be equal for a fresh process's object to stand for the traced one; None for
    an object with no such description (an instance, a tensor, ...)."""
    if depth > _DEPTH:
        return None
    if isinstance(value, _PLAIN):
        return f"{type(value).__qualname__}:{value!r}"
    if isinstance(value, types.ModuleType):
        return f"module:{value.__name__}"
    if isinstance(value, type):
        return f"class:{value.__module__}.{value.__qualname__}"
    if isinstance(value, (tuple, list)):
        parts = [fingerprint(v, depth + 1) for v in value]
        return None if None in parts else f"{type(value).__name__}({','.join(parts)})"  # type: ignore[arg-type]
    if isinstance(value, types.FunctionType):
        return _function(value, depth)
    if isinstance(value, types.CodeType):
        return f"code:{hashlib.sha256(_code(value).encode()).hexdigest()[:32]}"
    if isinstance(value, types.MethodType):
        parts = [fingerprint(value.__func__, depth + 1), fingerprint(value.__self__, depth + 1)]
        return None if None in parts else f"method:{parts[0]}@{parts[1]}"
    if isinstance(value, functools.partial):
        parts = [fingerprint(v, depth + 1) for v in (value.func, value.args, value.keywords)]
        return None if None in parts else f"partial:{parts}"
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        items = [fingerprint(v, depth + 1) for v in value.values()]
        return None if None in items else f"dict:{sorted(zip(value, items))}"  # type: ignore[type-var]
    if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"op:{value}"
    if isinstance(value, _BUILTINS):
        owner = getattr(value, "__self__", None)
        if type(owner).__name__.startswith("pybind11_detail_function_record"):
            # a pybind11 module function (torch._C's): bound to its own record, which also
            # prefixes its __qualname__
            return f"builtin:{value.__module__}.{value.__name__}"
        if owner is not None and not isinstance(owner, (types.ModuleType, type)):
            return None  # a method bound to some instance
        module = getattr(value, "__module__", None) or getattr(owner, "__name__", "")
        return f"builtin:{module}.{value.__qualname__}"
    return None


def _function(fn: types.FunctionType, depth: int) -> str | None:
    within = _local.__dict__.setdefault("within", [])  # being fingerprinted, on this thread
    if fn in within:  # a closure that reaches itself (a recursive inner function)
        return f"recursion:{fn.__qualname__}"
    within.append(fn)
    try:
        return _function_parts(fn, depth)
    finally:
        within.pop()


_local = threading.local()


def _function_parts(fn: types.FunctionType, depth: int) -> str | None:
    cells = [c.cell_contents for c in fn.__closure__ or () if _filled(c)]
    parts = [
        fingerprint(fn.__defaults__, depth + 1),
        fingerprint(fn.__kwdefaults__, depth + 1),
        fingerprint(cells, depth + 1),
    ]
    if None in parts:
        return None
    digest = hashlib.sha256(_code(fn.__code__).encode()).hexdigest()[:32]
    return f"function:{fn.__module__}.{fn.__qualname__}:{digest}:{parts}"


def _filled(cell: types.CellType) -> bool:
    try:
        return cell.cell_contents is not _filled  # reading it is the test
    except ValueError:  # an empty cell (a name not bound yet)
        return False


def _code(code: types.CodeType) -> str:
    """The code's instructions, names and constants (nested code included), not its file and
    line numbers: the same function read from another checkout is the same function."""
    consts = [_code(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
    return repr((code.co_code, code.co_names, code.co_varnames, code.co_freevars, consts))


def _state(value: Any) -> tuple:
    """What a later call compares by identity once `value` matched: the object, and for a
    function what can change in place (its defaults, its closure's contents)."""
    if not isinstance(value, types.FunctionType):
        return (value,)
    cells = tuple(c.cell_contents if _filled(c) else None for c in value.__closure__ or ())
    return (value, value.__defaults__, value.__kwdefaults__, *cells)


class Guard:
    """The checks of one compiled frame, run by Dynamo as a guard with the frame's locals. An
    object that matched once is remembered, so a later call compares identities only."""

    def __init__(
        self,
        checks: list[Check],
        scope: Mapping,
        matched: list | None = None,
        same: list[tuple[str, Any]] | None = None,
    ):
        self.checks, self.scope = checks, scope
        self.matched: dict[int, tuple] = {i: _state(v) for i, v in enumerate(matched or [])}
        # in the tracing process only, never saved: Dynamo's own guard expressions (`G[...]`,
        # `L[...]`) whose object has no fingerprint, and that object (an identity guard)
        self.same = [(compile(expr, "<guard>", "eval"), value) for expr, value in same or []]

    def __call__(self, frame_locals: Mapping) -> bool:
        names = {"G": self.scope, "L": frame_locals}
        for expr, value in self.same:
            try:
                if eval(expr, names) is not value:  # Dynamo's expression, of this process
                    return False
            except Exception:
                return False
        for index, (steps, expected) in enumerate(self.checks):
            try:
                value = resolve(steps, frame_locals, self.scope)
            except Exception:  # the path is gone: not the traced program
                return False
            state = _state(value)
            known = self.matched.get(index)
            if known and len(known) == len(state) and all(map(operator.is_, known, state)):
                continue
            if fingerprint(value) != expected:
                return False
            self.matched[index] = state
        return True

    def describe(self) -> list[str]:
        """Dynamo evaluates these when the guard fails, to say why it recompiles: a literal."""
        paths = ", ".join(".".join(str(name) for _, name in steps) for steps, _ in self.checks)
        return [repr(f"torchfarm identity checks (one no longer matches): {paths}")]
