"""The package's shape, read from its source with `ast` (issue 51): functions in the client
and the workers short, with few parameters; private torch names only behind torch_adapter/;
no import cycle, and no import from the adapter up into the code that uses it; every exception
under one root, one class per name."""

import ast
import builtins
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "torchfarm"
MAX_LINES, MAX_PARAMETERS = 60, 5
ABOVE_THE_ADAPTER = ("client", "compiler", "gateway", "workers")
# what each part of the adapter may import of the others (its own modules besides)
ADAPTER_BELOW = {
    "gate": set(),
    "trace": {"gate"},
    "compile": {"gate"},
    "load": {"gate"},
    "worker": {"gate", "compile", "load"},
}
ROOT = "TorchfarmError"
# BaseExceptions that are no errors, outside the root on purpose (errors.py says why)
NOT_ERRORS = {
    "torch_adapter/compile/concurrent_backward.py::Stopped",
    "torch_adapter/compile/concurrent_backward.py::_Restrided",
}


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function, methods and nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Its parameters, `self` and `cls` not counted; *args and **kwargs one each."""
    args = function.args
    named = [a.arg for a in (*args.posonlyargs, *args.args)]
    count = len(named) + len(args.kwonlyargs) + (args.vararg is not None)
    count += args.kwarg is not None
    return count - (named[:1] in (["self"], ["cls"]))


def _long_functions(package: str) -> set[str]:
    found = set()
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for name, node in _functions(ast.parse(path.read_text())):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_LINES or _parameters(node) > MAX_PARAMETERS:
                found.add(f"{path.relative_to(PACKAGE)}::{name}")
    return found


def test_no_function_in_workers_is_over_60_lines_or_5_parameters():
    assert _long_functions("workers") == set()


def test_no_function_in_client_is_over_60_lines_or_5_parameters():
    assert _long_functions("client") == set()


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _private_torch(name: str) -> bool:
    first, *rest = name.split(".")
    return first == "torch" and any(
        p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in rest
    )


def _private_torch_sites() -> set[str]:
    """file:line of every import or attribute of a private torch name, outside the adapter
    (and the generated protobuf code)."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE)
        if where.parts[0] in ("torch_adapter", "proto"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute):
                names = [_dotted(node)]
            else:
                continue
            if any(_private_torch(n) for n in names):
                found.add(f"{where}:{node.lineno}")
    return found


def test_private_torch_names_stay_behind_the_adapter():
    assert sorted(_private_torch_sites()) == []


def _imports() -> dict[str, set[str]]:
    """Each torchfarm module's imports of other torchfarm modules, function-level included."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for module, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    name = f"{node.module}.{a.name}"
                    found.add(name if name in modules else node.module)
        graph[module] = {m for m in found if m in modules and m != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module."""
    reach = {m: _reachable(graph, m) for m in graph}
    groups = {frozenset(n for n in reach[m] if m in reach[n]) | {m} for m in graph}
    return [set(g) for g in groups if len(g) > 1]


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_no_import_cycles():
    assert _cycles(_imports()) == []


def test_the_adapter_imports_nothing_above_it():
    upward = {
        f"{module} -> {imported}"
        for module, imports in _imports().items()
        if module.startswith("torchfarm.torch_adapter")
        for imported in imports
        if imported.split(".")[1] in ABOVE_THE_ADAPTER
    }
    assert upward == set()


def _adapter_part(module: str) -> str:
    """gate, trace, compile, load or worker: the part of the adapter `module` is in ("" for a
    module outside it, or the package itself)."""
    inside = module.startswith("torchfarm.torch_adapter.")
    return module.split(".")[2] if inside else ""


def test_the_adapters_parts_import_only_the_parts_below_them():
    sideways = {
        f"{module} -> {imported}"
        for module, imports in _imports().items()
        if _adapter_part(module) in ADAPTER_BELOW
        for imported in imports
        if _adapter_part(imported)
        and _adapter_part(imported)
        not in ADAPTER_BELOW[_adapter_part(module)] | {_adapter_part(module)}
    }
    assert sideways == set()


def _exception_classes() -> dict[str, list[tuple[str, list[str]]]]:
    """name -> [(file::name, the last part of each base's name)] of every class under
    torchfarm/ that derives, directly or through another one of them, from an exception."""
    classes: dict[str, list[tuple[str, list[str]]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [_dotted(b).rpartition(".")[2] for b in node.bases]
                where = f"{path.relative_to(PACKAGE)}::{node.name}"
                classes.setdefault(node.name, []).append((where, bases))
    exceptions = {n for n, v in vars(builtins).items() if _is_exception(v)}

    def is_exception(base: str) -> bool:  # another library's too, by its name
        return base in exceptions or base.endswith(("Error", "Exception"))

    while True:
        more = {
            name
            for name, defined in classes.items()
            if any(is_exception(b) for _, bases in defined for b in bases)
        } - exceptions
        if not more:
            return {n: d for n, d in classes.items() if n in exceptions}
        exceptions |= more


def _is_exception(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, BaseException)


def _derives_from_root(name: str, classes: dict[str, list[tuple[str, list[str]]]]) -> bool:
    return name == ROOT or any(
        _derives_from_root(base, classes)
        for _, bases in classes.get(name, [])
        for base in bases
        if base in classes
    )


def test_every_exception_derives_from_the_root():
    classes = _exception_classes()
    outside = {
        where
        for name, defined in classes.items()
        for where, _ in defined
        if not _derives_from_root(name, classes)
    }
    assert outside == NOT_ERRORS


def test_no_two_exception_classes_share_a_name():
    shared = {name: [w for w, _ in d] for name, d in _exception_classes().items() if len(d) > 1}
    assert shared == {}


def test_errors_py_imports_nothing_of_torchfarm():  # so that any layer may import it
    assert _imports()["torchfarm.errors"] == set()


def test_errors_py_draws_every_exception_class():
    tree = ast.get_docstring(ast.parse((PACKAGE / "errors.py").read_text())) or ""
    drawn = set(re.findall(r"\b\w+\b", tree))
    assert set(_exception_classes()) - drawn == set()


def _variable_keys() -> set[str]:
    """file:line of every string that is a whole TORCHFARM_* name (an environment key, not a
    message naming one), outside the settings package."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE)
        if where.parts[0] == "settings":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"TORCHFARM_[A-Z0-9_]+", node.value):
                    found.add(f"{where}:{node.lineno}")
    return found


def test_torchfarm_variables_are_read_and_written_only_through_the_settings_table():
    assert _variable_keys() == set()


def test_every_torchfarm_variable_named_in_the_package_is_in_the_table():
    from torchfarm.settings import env

    named = {
        name
        for path in PACKAGE.rglob("*.py")
        for name in re.findall(r"TORCHFARM_[A-Z0-9_]+", path.read_text())
    }
    assert named - set(env.BY_NAME) == set()
