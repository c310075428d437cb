"""Check an Inductor Triton kernel module against Inductor's template, without running it.

A pool's Triton build (workers/kernel_builder.py) compiles kernel modules that a shared
job's compile child reported, and the child runs a tenant's graph: a module may be anything.
Importing one runs it (imports, the decorator call, annotations), and so does compiling a
`@triton.jit` body: Triton's code generator calls any Python callable a body reaches
(`getattr(triton.knobs.os, "system")("...")` runs during `triton.compile`, shown with triton
3.6 and 3.9; docs/design/triton-pool-cache.md, section 5). So `check` admits only what
Inductor writes, and refuses the rest before anything runs:
- text: printable ASCII and newlines, no coding cookie (Triton re-reads a function from its
  file with the cookie honoured, Python compiles the string: the two could differ);
- module: Inductor's fixed import lines, its one call `triton_helpers.set_driver_to_gpu()`,
  and `def`s; the kernel decorated with `triton_heuristics.<heuristic>(...)` on literal
  arguments, then `triton.jit`; helpers with `triton.jit` alone;
- bodies: assignments, calls, if/while, for over a range, return; names of arguments, locals,
  helpers and six builtins; attribute chains off the imported modules resolved now, through
  module dicts only, to a Triton builtin, a JIT function, a dtype or a constexpr; a short list
  of attributes of values. Never getattr, print, a dunder, a lambda, a comprehension.
`same_as_validated` then checks, after the module ran, that every JIT function is, as Triton
will parse it, the function that was checked. A kernel refused is only not shared: reuse
never depends on it.

Uses Inductor's kernel template (`TritonKernel.gen_common_triton_imports`, the
`triton_heuristics` decorators), Triton's `JITFunction` (`parse`), `ConstexprFunction`,
`language.core` (`dtype`, `constexpr`, `__triton_builtin__`) and the libdevice stubs.
Verified: torch 2.11.0 + triton 3.6.0 and torch 2.15.0 + triton 3.9.0 (CPU: the unit tests
check the kernels of a GPU training step recorded on an H100, and the refusals), 2.11.0 on
the GPU (bench/gpu/run.sh sibling, shared jobs).
"""

from __future__ import annotations

import ast
import types

from torchfarm.errors import BuildRefused

IMPORTS = frozenset(
    {
        "import triton",
        "import triton.language as tl",
        "from triton.compiler.compiler import AttrsDescriptor",
        "from torch._inductor.runtime import triton_helpers, triton_heuristics",
        "from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math",
        "from torch._inductor.runtime.hints import "
        "AutotuneHint, ReductionHint, TileHint, DeviceProperties",
    }
)
MODULE_CALLS = frozenset({"triton_helpers.set_driver_to_gpu()"})
HEURISTICS = frozenset(
    {
        "pointwise",
        "reduction",
        "persistent_reduction",
        "split_scan",
        "template",
        "cooperative_reduction",
        "foreach",
        "fixed_config",
        "mix_order_reduction",
    }
)
HINT_ENUMS = frozenset({"ReductionHint", "TileHint", "AutotuneHint"})
BUILTINS = frozenset({"range", "min", "max", "len", "int", "float"})
# Attributes read off kernel values (tensors, constexprs, tuples): never a module's, never "_".
VALUE_ATTRIBUTES = frozenset(
    {
        "to",
        "dtype",
        "shape",
        "T",
        "reshape",
        "broadcast_to",
        "permute",
        "trans",
        "expand_dims",
        "split",
        "item",
        "value",
        "numel",
        "element_ty",
        "ravel",
    }
)
_RANGES = ("range", "tl.range", "tl.static_range")
_CONSTRUCTORS = ("DeviceProperties", "AttrsDescriptor", "AttrsDescriptor.from_dict")


def _modules() -> dict[str, types.ModuleType]:
    import triton
    import triton.language as tl
    from torch._inductor.runtime import triton_helpers

    return {
        "tl": tl,
        "triton_helpers": triton_helpers,
        "libdevice": triton_helpers.libdevice,
        "tl_math": triton_helpers.math,
        "triton": triton,
    }


def _kernel_object(value: object) -> bool:
    """What a body may reach through a module: Triton builtins, JIT functions (Triton's and
    Inductor's helpers), constexpr functions, dtypes and constexpr values."""
    from triton.language import core
    from triton.runtime.jit import JITFunction

    kinds: tuple[type, ...] = (JITFunction, core.dtype, core.constexpr)
    try:
        from triton.runtime.jit import ConstexprFunction  # triton 3.5+

        kinds += (ConstexprFunction,)
    except ImportError:
        pass
    if isinstance(value, kinds) or value is core.constexpr:
        return True
    if callable(value) and getattr(value, "__module__", "") == "triton.language.extra.libdevice":
        return True  # a stub: the code generator maps it to the backend's libdevice
    return callable(value) and bool(getattr(value, "__triton_builtin__", False))


def _resolved(node: ast.expr, modules: dict[str, types.ModuleType]) -> bool:
    """Whether `node` is a chain `module.a.b` (then checked: through module dicts only, no
    `__getattr__`, ending on a kernel object), or else an attribute of a value."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in modules:
        return False
    value: object = modules[node.id]
    for name in reversed(names):
        if name.startswith("_") or not isinstance(value, types.ModuleType):
            raise BuildRefused(f"attribute {name!r} off a non-module")
        if name not in vars(value):
            raise BuildRefused(f"{name!r} is not in {value.__name__}")
        value = vars(value)[name]
    if isinstance(value, types.ModuleType) or not _kernel_object(value):
        raise BuildRefused(f"{ast.unparse(node)}.{'.'.join(reversed(names))}: not a Triton builtin")
    return True


def _literal(node: ast.expr, file_allowed: bool = False) -> None:
    """A decorator argument: a literal, `__file__` (for `filename=`), `set()`, a float's
    infinity or NaN, a hint enum member, or Inductor's DeviceProperties / AttrsDescriptor of
    literals."""
    if isinstance(node, ast.Constant):
        return
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for element in node.elts:
            _literal(element)
        return
    if isinstance(node, ast.Dict):
        for key, value in zip(node.keys, node.values, strict=True):
            if key is None:
                raise BuildRefused("** in a dict")
            _literal(key)
            _literal(value)
        return
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        if isinstance(node.operand, ast.Constant):
            return
    if isinstance(node, ast.Name) and node.id == "__file__" and file_allowed:
        return
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        if node.value.id in HINT_ENUMS and node.attr.isupper():
            return
    if isinstance(node, ast.Call):
        called = ast.unparse(node.func)
        if called == "set" and not node.args and not node.keywords:
            return
        infinite = ("inf", "-inf", "nan")
        if called == "float" and not node.keywords and len(node.args) == 1:
            if isinstance(node.args[0], ast.Constant) and node.args[0].value in infinite:
                return
        if called in _CONSTRUCTORS:
            for argument in node.args:
                _literal(argument)
            for keyword in node.keywords:
                if keyword.arg is None:
                    raise BuildRefused("**kwargs")
                _literal(keyword.value)
            return
    raise BuildRefused(f"decorator argument not literal: {ast.unparse(node)[:80]}")


class _Body:
    """One `@triton.jit` function's signature and body, walked statement by statement."""

    def __init__(
        self, fn: ast.FunctionDef, helpers: set[str], modules: dict[str, types.ModuleType]
    ) -> None:
        self.helpers, self.modules = helpers, modules
        self.locals: set[str] = set()
        args = fn.args
        if args.vararg or args.kwarg or args.kwonlyargs or args.posonlyargs or args.defaults:
            raise BuildRefused("only plain positional arguments")
        for arg in args.args:
            if arg.annotation is not None and ast.unparse(arg.annotation) != "tl.constexpr":
                raise BuildRefused(f"annotation {ast.unparse(arg.annotation)[:60]}")
            self._bind(arg.arg)
        for statement in fn.body:
            self._statement(statement)

    def _bind(self, name: str) -> None:
        reserved = name in self.modules or name in self.helpers or name in BUILTINS
        if name.startswith("__") or reserved or name in HINT_ENUMS:
            raise BuildRefused(f"name {name!r} may not be bound")
        self.locals.add(name)

    def _target(self, target: ast.expr) -> None:
        if isinstance(target, ast.Name):
            self._bind(target.id)
        elif isinstance(target, ast.Tuple):
            for element in target.elts:
                self._target(element)
        else:
            raise BuildRefused(f"assignment to {ast.unparse(target)[:60]}")

    def _statement(self, s: ast.stmt) -> None:
        if isinstance(s, ast.Assign):
            self._expression(s.value)
            for target in s.targets:
                self._target(target)
        elif isinstance(s, ast.AnnAssign):
            if ast.unparse(s.annotation) != "tl.constexpr" or s.value is None:
                raise BuildRefused("an annotated assignment other than NAME: tl.constexpr = ...")
            self._expression(s.value)
            self._target(s.target)
        elif isinstance(s, ast.AugAssign):
            self._expression(s.value)
            if not isinstance(s.target, ast.Name) or s.target.id not in self.locals:
                raise BuildRefused("augmented assignment to a non-local")
        elif isinstance(s, ast.Expr):
            if not isinstance(s.value, (ast.Call, ast.Constant)):
                raise BuildRefused("an expression statement that is no call")
            self._expression(s.value)
        elif isinstance(s, (ast.If, ast.While)):
            self._expression(s.test)
            for inner in s.body + s.orelse:
                self._statement(inner)
        elif isinstance(s, ast.For):
            loop = s.iter
            if not isinstance(loop, ast.Call) or ast.unparse(loop.func) not in _RANGES:
                raise BuildRefused("a for loop over something other than a range")
            if s.orelse or any(k.arg is None for k in loop.keywords):
                raise BuildRefused("a for loop with else, or **kwargs")
            for argument in (*loop.args, *(k.value for k in loop.keywords)):
                self._expression(argument)  # tl.range is a class: only its arguments are
            self._target(s.target)
            for inner in s.body:
                self._statement(inner)
        elif isinstance(s, ast.Return):
            if s.value is not None:
                self._expression(s.value)
        elif not isinstance(s, (ast.Pass, ast.Break, ast.Continue)):
            raise BuildRefused(f"statement {type(s).__name__}")

    def _expression(self, e: ast.expr) -> None:
        if isinstance(e, ast.Constant):
            if not isinstance(e.value, (int, float, bool, str, type(None))):
                raise BuildRefused(f"constant of type {type(e.value).__name__}")
        elif isinstance(e, ast.Name):
            if e.id not in self.locals and e.id not in self.helpers and e.id not in BUILTINS:
                raise BuildRefused(f"name {e.id!r}")
        elif isinstance(e, ast.Attribute):
            if e.attr.startswith("_"):
                raise BuildRefused(f"attribute {e.attr!r}")
            if not _resolved(e, self.modules):  # an attribute of a value
                if e.attr not in VALUE_ATTRIBUTES or isinstance(e.value, ast.Constant):
                    raise BuildRefused(f"attribute .{e.attr} of a value")
                self._expression(e.value)
        elif isinstance(e, ast.Call):
            if isinstance(e.func, ast.Name):
                if e.func.id not in self.helpers and e.func.id not in BUILTINS:
                    raise BuildRefused(f"call of {e.func.id!r}")
            else:
                self._expression(e.func)
            for argument in e.args:
                if isinstance(argument, ast.Starred):
                    raise BuildRefused("*args")
                self._expression(argument)
            for keyword in e.keywords:
                if keyword.arg is None:
                    raise BuildRefused("**kwargs")
                self._expression(keyword.value)
        elif isinstance(e, (ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp)):
            for child in ast.iter_child_nodes(e):
                if isinstance(child, ast.expr):
                    self._expression(child)
        elif isinstance(e, ast.Subscript):
            self._expression(e.value)
            self._expression(e.slice)
        elif isinstance(e, ast.Slice):
            for part in (e.lower, e.upper, e.step):
                if part is not None:
                    self._expression(part)
        elif isinstance(e, (ast.Tuple, ast.List)):
            for element in e.elts:
                self._expression(element)
        else:
            raise BuildRefused(f"expression {type(e).__name__}")


def _plain_text(source: str) -> None:
    if any(not (" " <= ch <= "~" or ch == "\n") for ch in source):
        raise BuildRefused("characters other than printable ASCII")
    for line in source.split("\n")[:2]:
        if line.lstrip().startswith("#") and "coding" in line:
            raise BuildRefused("a coding cookie")


def _kernel_decorators(fn: ast.FunctionDef) -> None:
    decorators = fn.decorator_list
    if len(decorators) != 2 or ast.unparse(decorators[1]) != "triton.jit":
        raise BuildRefused("the kernel's decorators are not a heuristic, then triton.jit")
    heuristic = decorators[0]
    if not (
        isinstance(heuristic, ast.Call)
        and isinstance(heuristic.func, ast.Attribute)
        and ast.unparse(heuristic.func.value) == "triton_heuristics"
        and heuristic.func.attr in HEURISTICS
    ):
        raise BuildRefused(f"heuristic {ast.unparse(heuristic)[:60]}")
    if heuristic.args:
        raise BuildRefused("positional arguments to the heuristic")
    for keyword in heuristic.keywords:
        if keyword.arg is None:
            raise BuildRefused("**kwargs")
        _literal(keyword.value, file_allowed=keyword.arg == "filename")


def check(source: str, kernel_name: str) -> None:
    """BuildRefused unless `source` is an Inductor Triton kernel module defining `kernel_name`."""
    modules = _modules()
    _plain_text(source)
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise BuildRefused(f"not Python: {e}") from None
    functions = [s for s in tree.body if isinstance(s, ast.FunctionDef)]
    helpers = {f.name for f in functions if f.name != kernel_name}
    found = False
    for statement in tree.body:
        text = ast.unparse(statement)
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            if text not in IMPORTS:
                raise BuildRefused(f"import {text[:80]}")
        elif isinstance(statement, ast.Expr) and text in MODULE_CALLS:
            pass
        elif isinstance(statement, ast.FunctionDef):
            if statement.returns is not None or statement.name.startswith("__"):
                raise BuildRefused(f"function {statement.name[:60]}")
            if statement.name == kernel_name:
                _kernel_decorators(statement)
                found = True
            elif [ast.unparse(d) for d in statement.decorator_list] != ["triton.jit"]:
                raise BuildRefused(
                    f"helper {statement.name[:60]}: decorators other than triton.jit"
                )
            _Body(statement, helpers, modules)
        else:
            raise BuildRefused(f"module statement {text[:60]}")
    if not found:
        raise BuildRefused(f"no kernel named {kernel_name[:60]!r}")


def _dump(fn: ast.FunctionDef) -> str:
    return ast.dump(
        ast.FunctionDef(name=fn.name, args=fn.args, body=fn.body, decorator_list=[]),
        include_attributes=False,
    )


def same_as_validated(module: types.ModuleType, source: str) -> None:
    """After the checked `source` ran as `module`: BuildRefused unless each of its JIT functions
    is, as Triton will parse it, the function that was checked."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    from triton.runtime.jit import JITFunction

    checked = {s.name: _dump(s) for s in ast.parse(source).body if isinstance(s, ast.FunctionDef)}
    for name, value in vars(module).items():
        fn = value.fn if isinstance(value, CachingAutotuner) else value
        if isinstance(fn, JITFunction):
            parsed = fn.parse().body[0]
            if not isinstance(parsed, ast.FunctionDef) or checked.get(name) != _dump(parsed):
                raise BuildRefused(
                    f"{name}: Triton would compile another function than the checked"
                )
