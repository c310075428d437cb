"""Dynamo's guards on an object's identity (ID_MATCH on a global function, a module attribute,
a class; CLOSURE_MATCH on a function's code) and on default arguments, carried across
processes.

Dynamo's package cannot save those guards (torch_adapter/trace/dynamo_package.py), and dropping them
served stale code: a global function rebound after the compile still ran the old graph. The
process that traces keeps Dynamo's own guards; the package saves each such guard with its
path from the frame (its locals or its module's globals, through attributes, items and
defaults) and a fingerprint of the object found there: a module or a class by qualified
name, a function by module, qualified name and a hash of its code, a constant by its repr. A
process that restores the frame resolves each path once, checks the fingerprint, and builds
Dynamo's own guard on the object it found, so every later call compares identities in
Dynamo's guard code. A function's closure contents and defaults are not part of its
fingerprint: Dynamo guards those it reads with guards of their own (saved, or carried here),
and contents it does not read (a library's caches and counters) must not fail the guard.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch._dynamo import source as sources

from torchfarm.torch_adapter.trace.operators import is_operator

# One step of a path: ("local" | "global" | "attr" | "generic_attr" | "item" | "key_at" |
# "dict_key" | "defaults" | "kwdefaults" | "type", name or index)
Step = tuple[str, Any]
_DEPTH = 24  # nested containers a fingerprint follows before it gives up
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
    elif isinstance(source, sources.GenericAttrSource):  # object.__getattribute__(base, name)
        step = ("generic_attr", source.member)
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
    elif isinstance(source, sources.ConstDictKeySource):  # the dict's key number i itself
        step = ("dict_key", source.index)
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
    return resolver(steps)(frame_locals, scope)


@functools.lru_cache(maxsize=4096)
def resolver(steps: tuple[Step, ...]) -> Callable[[Mapping, Mapping], Any]:
    """`steps` as one compiled expression of the frame's locals and globals: a later frame's
    checks (dynamo_package.LateChecks) resolve their paths on every call, and gpt2's eleven
    paths of up to 13 steps took ~70 us a call step by step. Names and indices enter the
    expression only as literals (repr of a str or an int)."""
    (kind, name), *rest = steps
    expression = f"{'L' if kind == 'local' else 'G'}[{_literal(name)}]"
    for kind, name in rest:
        if kind == "type":
            expression = f"type({expression})"
            continue
        key = _literal(name)
        if kind == "attr":
            expression = f"getattr({expression}, {key})"
        elif kind == "generic_attr":  # as Dynamo reads it: past the class's __getattr__
            expression = f"_getattribute({expression}, {key})"
        elif kind == "item":
            expression = f"{expression}[{key}]"
        elif kind == "key_at":  # as Dynamo reads it: past a subclass's __getitem__
            expression = f"_value_at({expression}, {key})"
        elif kind == "dict_key":
            expression = f"_key_at({expression}, {key})"
        elif kind == "defaults":
            expression = f"{expression}.__defaults__[{key}]"
        elif kind == "kwdefaults":
            expression = f"{expression}.__kwdefaults__[{key}]"
        else:
            raise ValueError(f"no such step: {kind}")
    return eval(f"lambda L, G: {expression}", dict(_RESOLVING))  # noqa: S307


def _literal(name: Any) -> str:
    if type(name) not in (str, int):
        raise TypeError(f"a path names {type(name).__name__}, not a str or an int")
    return repr(name)


def _key_at(mapping: dict, index: int) -> Any:
    return list(dict.keys(mapping))[index]


def _value_at(mapping: dict, index: int) -> Any:
    return dict.__getitem__(mapping, _key_at(mapping, index))


_RESOLVING = {
    "__builtins__": {"getattr": getattr, "type": type},
    "_getattribute": object.__getattribute__,
    "_key_at": _key_at,
    "_value_at": _value_at,
}


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
    if isinstance(value, typing._SpecialForm):  # typing.Union, typing.Literal: singletons
        return f"typing:{value!r}"
    if isinstance(value, (tuple, list)):
        parts = [fingerprint(v, depth + 1) for v in value]
        return None if None in parts else f"{type(value).__name__}({','.join(parts)})"  # type: ignore[arg-type]
    if isinstance(value, types.FunctionType):
        return _function(value)
    if isinstance(value, types.CodeType):
        return f"code:{_digest(value)}"
    if isinstance(value, types.MethodType):
        parts = [fingerprint(value.__func__, depth + 1), fingerprint(value.__self__, depth + 1)]
        return None if None in parts else f"method:{parts[0]}@{parts[1]}"
    if isinstance(value, functools.partial):
        parts = [fingerprint(v, depth + 1) for v in (value.func, value.args, value.keywords)]
        return None if None in parts else f"partial:{parts}"
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        items = [fingerprint(v, depth + 1) for v in value.values()]
        return None if None in items else f"dict:{sorted(zip(value, items))}"  # type: ignore[type-var]
    if is_operator(value):
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


def _function(fn: types.FunctionType) -> str:
    module = fn.__globals__.get("__name__", fn.__module__)
    qualname = getattr(fn.__code__, "co_qualname", fn.__qualname__)  # Python >= 3.11
    return f"function:{module}.{qualname}:{_digest(fn.__code__)}"


@functools.lru_cache(maxsize=4096)
def _digest(code: types.CodeType) -> str:
    """Once per code object: a closure made anew on every call (a guarded local of a later
    frame, dynamo_package.LateChecks) is fingerprinted on every call, and hashing a
    transformers forward's code took 13-43 us."""
    return hashlib.sha256(_code(code).encode()).hexdigest()[:32]


def _code(code: types.CodeType) -> str:
    """The code's instructions, names and constants (nested code included), not its file and
    line numbers: the same function read from another checkout is the same function."""
    consts = [_code(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
    return repr((code.co_code, code.co_names, code.co_varnames, code.co_freevars, consts))
