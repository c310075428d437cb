"""TorchScript functions (a module-level `torch.jit.script` function) in a frame's saved guards,
saved by name.

A frame that calls one (ChatGLM's `apply_rotary_pos_emb`) guards its global's type
(TYPE_MATCH), and Dynamo's guards pickler refuses both: the guard, because the type's
`__qualname__` (`torch.jit.ScriptFunction`) is not its `__name__`, as a local class's is not
(Guard._unserializable); and the object, which has no pickle support. The frame was left out of
the package and traced in every process. Here the object is saved as the module and qualified
name of the Python function it was scripted from, checked at save time to reach this very
object; the restoring process imports that module and reads the name, so the frame's guards
are built on, and check, the process's own ScriptFunction. One that no name reaches (scripted
in a function's body, rebound) still leaves its frame out, with that reason.

Uses torch._dynamo.guards.GuardsStatePickler (its reducer_override, and the module global
pickle_guards_state builds it from), Guard._unserializable (True on 2.11 and 2.13, the type on
2.15) and the `_torchdynamo_inline` attribute torch.jit.script sets to the scripted function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._dynamo import guards as guards_module
from torch._dynamo.exc import PackageError
from torch._guards import Guard

ScriptFunction = torch.jit.ScriptFunction


def name_of(fn: ScriptFunction) -> tuple[str, str]:
    """The module and qualified name that reach `fn`; PackageError if none does."""
    scripted = getattr(fn, "_torchdynamo_inline", None)
    module, qualname = getattr(scripted, "__module__", ""), getattr(scripted, "__qualname__", "")
    try:
        found = _resolve(module, qualname)
    except Exception:  # no module, or no such name (`<locals>` in a body's function)
        found = None
    if found is not fn:
        raise PackageError(f"the TorchScript function {fn.qualified_name} is not reachable by name")
    return module, qualname


def load(module: str, qualname: str) -> ScriptFunction:
    """The ScriptFunction saved as `module`.`qualname` (name_of), imported in this process."""
    fn = _resolve(module, qualname)
    if not isinstance(fn, ScriptFunction):
        raise PackageError(f"{module}.{qualname} is no longer a TorchScript function")
    return fn


def _resolve(module: str, qualname: str) -> Any:
    value: Any = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


class _Pickler(guards_module.GuardsStatePickler):  # type: ignore[misc,valid-type]
    """Dynamo's guards pickler, with ScriptFunctions by name."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, ScriptFunction):
            return load, name_of(obj)
        return super().reducer_override(obj)


@contextlib.contextmanager
def saved_by_name() -> Iterator[None]:
    """Within: Dynamo's serialize_guards pickles ScriptFunctions by name."""
    saved = guards_module.GuardsStatePickler
    setattr(guards_module, "GuardsStatePickler", _Pickler)  # noqa: B010  (a module global)
    try:
        yield
    finally:
        setattr(guards_module, "GuardsStatePickler", saved)  # noqa: B010


_SAVABLE = next(f.default for f in dataclasses.fields(Guard) if f.name == "_unserializable")


def savable(guard: Any, builder: Any) -> Any:
    """`guard`, or a copy that serialize_guards saves where it was refused only for guarding a
    ScriptFunction's type (saved by name within saved_by_name)."""
    refused = getattr(guard, "_unserializable", _SAVABLE)
    if refused is _SAVABLE or guard.create_fn_name() != "TYPE_MATCH":
        return guard
    guarded_type = refused if isinstance(refused, type) else type(builder.get(guard))
    if guarded_type is not ScriptFunction:
        return guard
    return dataclasses.replace(guard, _unserializable=_SAVABLE)
