"""Graph <-> payload bytes.

The client turns Dynamo's FX graph into bytes that hold FakeTensor metadata and the ShapeEnv,
never weights, and that are the same for the same model in any process, path or rank (the
cache key is their hash). Size hints (the concrete sizes behind each symbol) are left out of
the bytes and travel beside them (`size_hints`), so one dynamic graph is one key whatever
batch size a process traced it with; so do the values of the floats Dynamo lifted to inputs
(`float_hints`), so one such graph is one key whatever value a process traced it with (the
compiled code reads the value at run time). Only a sandboxed worker child ever calls `loads`.

The payload names one canonical CUDA device (index 0) whatever device the graph was traced
on, so the ranks of a job, each on its own `cuda:N`, send the same bytes and share one
compile; the client runs the artifact on its own device (`local_device_index`,
torch_adapter/load/device_remap.py). A graph on several CUDA devices keeps its indices.

Custom operators (torch.library ops of other libraries, e.g. transformers' MoE kernels)
travel by name with their schema; a worker resolves them only if its operator imported the
library that defines them (TORCHFARM_OP_LIBRARIES), and only with the same schema.
"""

from __future__ import annotations

import contextlib
import contextvars
import copyreg
import re
from collections.abc import Iterator, Mapping
from typing import Any

import sympy
import torch

from torchfarm.torch_adapter.load import device_remap
from torchfarm.torch_adapter.trace import graph_pickler, shape_env
from torchfarm.torch_adapter.trace.fake_tensors import FakeTensor, FakeTensorMode
from torchfarm.torch_adapter.trace.graph_pickler import GraphPickler, Options
from torchfarm.torch_adapter.trace.shape_env import NO_SLOC, ShapeEnv, ShapeGuard, SymNode

# Node metadata the compiler needs; everything else (stack traces, module paths, and
# "grapharg", which holds the real weights) stays home.
_KEPT_NODE_META = ("example_value",)
# A custom operator's schema, kept on its nodes: part of the payload, hence of the key.
_OP_SCHEMA = "torchfarm_op_schema"
# On an input Dynamo marked static (a parameter or buffer of the module): Inductor assumes
# what it saw of it holds at every call (its alignment), as for a local compile's
# (torch_adapter/trace/static_inputs.py). Part of the payload, hence of the key.
_STATIC_INPUT = "torchfarm_static_input"
_PICKLE_OPTIONS = Options(ops_filter=None)
# How pickle rebuilds an object of a class (copyreg's names, missing from typeshed).
_NEWOBJ = (copyreg.__newobj__, copyreg.__newobj_ex__)  # type: ignore[attr-defined]
# The hints `loads` puts back while it unpickles.
_loading_hints: contextvars.ContextVar[dict[str, int | float]] = contextvars.ContextVar("hints")
# The ShapeEnvs `loads` rebuilt from its payload, while it unpickles.
_loaded_env: contextvars.ContextVar[list] = contextvars.ContextVar("envs")
# The CUDA index that `dumps` writes as the canonical one, while it pickles (None: none).
_local_index: contextvars.ContextVar[int | None] = contextvars.ContextVar("index", default=None)
# Types that are never a persistent id (GraphPickler's is an object(); ours are devices and
# sympy values): pickle asks about every object, these are most of them.
_BY_PICKLE = frozenset({str, int, float, bool, bytes, type(None), tuple, list, dict, type})
# Containers, which pickle hands to `reducer_override` (its atoms it writes at once).
_CONTAINERS = frozenset({tuple, list, dict})
_CUDA_NAME = re.compile(r"cuda:(\d+)")
# Methods whose second positional argument may be a bare device index (`x.cuda(1)`).
_DEVICE_METHODS = ("cuda", "to")


def _hints(env: ShapeEnv | None) -> dict:
    return env.__dict__.get(shape_env.HINT_FIELD, {}) if env is not None else {}


def _integer_hints(env: ShapeEnv | None) -> dict:
    return {s: v for s, v in _hints(env).items() if isinstance(v, sympy.Integer)}


def _float_hints(env: ShapeEnv | None) -> dict:
    return {s: v for s, v in _hints(env).items() if isinstance(v, sympy.Float)}


class _PortableShapeEnv(graph_pickler.ShapeEnvPickleData):
    """The ShapeEnv fields the payload keeps (shape_env.KEPT_FIELDS), without source
    locations, size hints or lifted floats' values."""

    def __init__(self, env: ShapeEnv) -> None:
        data = shape_env.kept_fields(env)
        data["guards"] = [ShapeGuard(g.expr, NO_SLOC, g.size_oblivious) for g in env.guards]
        data["deferred_runtime_asserts"] = {}
        if "var_to_range_sloc" in data:
            data["var_to_range_sloc"] = {
                k: shape_env.ValueRangesSLoc(NO_SLOC, NO_SLOC) for k in env.var_to_range_sloc
            }
        if "replacements_slocs" in data:
            data["replacements_slocs"] = {k: NO_SLOC for k in env.replacements_slocs}
        hinted = _integer_hints(env) | _float_hints(env)
        if shape_env.HINT_FIELD in data:
            data[shape_env.HINT_FIELD] = {
                s: v for s, v in data[shape_env.HINT_FIELD].items() if s not in hinted
            }
        data["val_to_var"] = {}
        self.data = data

    def unpickle(self, unpickle_state) -> ShapeEnv:
        env = super().unpickle(unpickle_state)
        loaded = _loaded_env.get(None)
        if loaded is not None:
            loaded.append(env)
        symbols = {str(s): s for s in env.var_to_range}
        values = {
            symbols[name]: sympy.Float(v) if isinstance(v, float) else sympy.Integer(v)
            for name, v in _loading_hints.get().items()
            if name in symbols
        }
        env.__dict__.setdefault(shape_env.HINT_FIELD, {}).update(values)
        env.val_to_var.update({int(v): s for s, v in values.items() if v.is_Integer})
        return env


class _PortableSymInt:
    """A SymInt (or a SymFloat: a lifted float's, read back with .item()) without its hint;
    `loads` recomputes the hint from the restored ShapeEnv."""

    def __init__(self, node: SymNode) -> None:
        self.expr, self.shape_env, self.pytype = (
            shape_env.expr_of(node),
            node.shape_env,
            node.pytype,
        )

    def unpickle(self, unpickle_state) -> torch.SymInt | torch.SymFloat:
        if self.pytype is float:
            hint = self.expr.xreplace(_hints(self.shape_env))
            value = float(hint) if hint.is_number else None
            return torch.SymFloat(SymNode(self.expr, self.shape_env, float, value))
        hint = self.expr.xreplace(_integer_hints(self.shape_env))
        return torch.SymInt(
            SymNode(self.expr, self.shape_env, self.pytype, int(hint) if hint.is_number else None)
        )


class _PortableTensor(graph_pickler.TensorPickleData):
    """A FakeTensor's description; also drops the fake mode of a view's base (torch 2.13
    clears it only on the view itself, and a FakeTensorMode cannot be pickled) and the
    description of its `.grad`, which compiling the graph never reads: a parameter's fake
    after a training step carries a fake grad, with its fake mode (every transformers
    model's inference graph after its training steps failed here, design.md trap 2)."""

    def __init__(self, describer, t) -> None:
        grad = t.grad if t.is_leaf else None  # a non-leaf's .grad warns, and is None
        if grad is not None:  # not described at all: its number would shift every later one
            t.grad = None
        try:
            super().__init__(describer, t)
        finally:
            if grad is not None:
                t.grad = grad
        base = self.metadata.base
        if base is not None and base.fake_mode is not None:
            # Set in place: the base's description is this one's own (described afresh for
            # it, never kept by the describer), and a dataclasses.replace of its 50 fields
            # was a tenth of the tensors' cost.
            object.__setattr__(base, "fake_mode", None)
        # A float Dynamo lifted to a tensor input (it changed between calls) is read back
        # with .item(), which a fake answers only from the symbol Dynamo memoized on it:
        # without it the worker's compile raised DataDependentOutputException. Set only
        # where there is one, so every other payload keeps its bytes (and its key).
        memo = getattr(t, "item_memo", None)
        if isinstance(memo, (torch.SymInt, torch.SymFloat)):
            self.item_memo = _PortableSymInt(memo.node)

    def unpickle(self, unpickle_state) -> FakeTensor:
        fake = super().unpickle(unpickle_state)
        if hasattr(self, "item_memo"):
            fake.item_memo = self.item_memo.unpickle(unpickle_state)
        return fake


def _fresh(value):
    """`value` with new string objects: pickle memoizes strings by identity too."""
    if isinstance(value, str):
        return value.encode().decode()
    if isinstance(value, tuple):
        return tuple(_fresh(v) for v in value)
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda item: str(item[0]))
        return {_fresh(k): _fresh(v) for k, v in items}
    return value


class _PortablePickler(GraphPickler):
    """Pickle memoizes by identity, and whether two equal values are one object depends on
    what the process did before; the values where that was seen go by value instead:
    - devices (CUDA on torch 2.11: the first graph of a fresh process got other bytes);
    - sympy expressions, which sympy's bounded cache shares or not (BART's training graphs
      on the GPU after a longer process history), numbered by value."""

    def persistent_id(self, obj: object):
        if type(obj) in _BY_PICKLE:  # most of a payload's objects: answered first
            return None
        if type(obj) is torch.device:
            return ("device", str(canonical(obj)))
        if isinstance(obj, sympy.Basic):
            numbers = self.__dict__.setdefault("_sympy_numbers", {})
            value = self._sympy_value(obj)
            if value in numbers:
                return ("sympy", numbers[value])
            numbers[value] = len(numbers)
            rebuild, args, state = obj.__reduce_ex__(4)[:3]
            return ("sympy", numbers[value], rebuild, _fresh(args), _fresh(state))
        return super().persistent_id(obj)

    def _sympy_value(self, obj: sympy.Basic) -> tuple:
        """What numbers a sympy value, printed once per object: pickle asks about every
        occurrence (the same few symbols in most shapes of a dynamic graph), and printing
        was half of such a payload's cost. The object is kept, so its id stays its own."""
        printed = self.__dict__.setdefault("_sympy_printed", {})
        if id(obj) not in printed:
            printed[id(obj)] = (obj, (type(obj), sympy.srepr(obj)))
        return printed[id(obj)][1]

    def reducer_override(self, obj: object):
        if type(obj) in _CONTAINERS:  # GraphPickler pickles them as pickle does
            return NotImplemented
        if isinstance(obj, FakeTensor):
            return _PortableTensor.unpickle, (
                _PortableTensor(self._meta_tensor_describer, obj),
                self._unpickle_state,
            )
        if isinstance(obj, ShapeEnv):
            return _PortableShapeEnv.unpickle, (_PortableShapeEnv(obj), self._unpickle_state)
        if isinstance(obj, (torch.SymInt, torch.SymFloat)):  # a SymFloat: a lifted float's
            return _PortableSymInt.unpickle, (_PortableSymInt(obj.node), self._unpickle_state)
        if isinstance(obj, torch.Tensor) and not isinstance(obj, FakeTensor):
            raise ValueError("refusing to serialize a real tensor: the farm takes metadata only")
        return super().reducer_override(obj)


class _PortableUnpickler(graph_pickler.GraphUnpickler):
    def persistent_load(self, pid: object) -> object:
        if isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "device":
            return torch.device(pid[1])
        if isinstance(pid, tuple) and pid and pid[0] == "sympy":
            return self._sympy(*pid[1:])
        return super().persistent_load(pid)

    def _sympy(self, number: int, rebuild=None, args=(), state=None) -> sympy.Basic:
        loaded = self.__dict__.setdefault("_sympy_loaded", {})
        if rebuild is None:
            return loaded[number]
        if rebuild not in _NEWOBJ or not (
            isinstance(args[0], type) and issubclass(args[0], sympy.Basic)
        ):
            raise ValueError(f"payload rebuilds a sympy value with {rebuild!r}{args[:1]!r}")
        expr = rebuild(*args)
        if state is not None:
            expr.__setstate__(state)
        loaded[number] = expr
        return expr


class _Generated(torch.fx.GraphModule):
    """A GraphModule whose code is generated once, when it is built: GraphPickler recompiles
    every module before pickling it, and these are never edited, so that second code
    generation and compile (a sixth of a payload's cost) would give the same code."""

    def recompile(self):
        return None if "_code" in self.__dict__ else super().recompile()


def metadata_only(
    gm: torch.fx.GraphModule, module: type[torch.fx.GraphModule] = _Generated
) -> torch.fx.GraphModule:
    """The graph with only the metadata the compiler needs, as a `module` (the payload's
    generates its code once: `_Generated`); subgraphs (torch.cond branches,
    autograd.Function forward/backward) come along the same way, anything else read with
    get_attr (weights) is refused."""
    graph = torch.fx.Graph()
    root = torch.nn.Module()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = attribute(gm, node.target)
            if not isinstance(value, torch.fx.GraphModule):
                raise ValueError(
                    f"graph reads {type(value).__name__} {node.target!r} with "
                    "get_attr; the farm needs parameters lifted to inputs"
                )
            _set_attribute(root, node.target, metadata_only(value, module))
        new = graph.node_copy(node, lambda n: env[n])
        arguments = canonical_arguments(new)
        if arguments is not None:  # else left as copied: an assignment updates their users
            new.args, new.kwargs = arguments
        new.meta = {k: node.meta[k] for k in _KEPT_NODE_META if k in node.meta}
        if node.op == "placeholder" and is_static_input(node):
            new.meta[_STATIC_INPUT] = True
        schema = graph_pickler.custom_op_schema(node.target)
        if schema is not None:
            new.meta[_OP_SCHEMA] = schema
        env[node] = new
    return module(root, graph)


def is_static_input(node: torch.fx.Node) -> bool:
    """Whether Dynamo marked the placeholder static (on a rebuilt graph: the payload's mark)."""
    return node.meta.get(_STATIC_INPUT) is True or bool(
        (node.meta.get("tensor_dict") or {}).get("_dynamo_static_input_type")
    )


def _device_index(value: object, bare_int: bool = False) -> int | None:
    """The CUDA index that an argument or example value names, if any: a device, a
    "cuda:N" string, a tensor's device, or (where the argument is a device) a bare int."""
    if isinstance(value, torch.Tensor):
        value = value.device
    if isinstance(value, torch.device):
        return value.index if value.type == "cuda" else None
    if isinstance(value, str):
        match = _CUDA_NAME.fullmatch(value)
        return int(match.group(1)) if match else None
    if bare_int and type(value) is int:
        return value
    return None


def _takes_bare_index(node: torch.fx.Node) -> bool:
    return node.op == "call_method" and node.target in _DEVICE_METHODS


def _device_arguments(node: torch.fx.Node) -> list[tuple[Any, bool]]:
    """Each argument of the node, with whether a bare int there is a device index."""
    positional = [(v, _takes_bare_index(node)) for v in node.args]
    return positional + [(v, k == "device") for k, v in node.kwargs.items()]


def _leaves(value: object) -> list:
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _leaves(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return [value]


def canonical(device: torch.device) -> torch.device:
    """`device` as the payload names it (inside `canonical_device`)."""
    index = _local_index.get()
    if index is not None and device.type == "cuda" and device.index == index:
        return torch.device("cuda", device_remap.CANONICAL_INDEX)
    return device


def canonical_arguments(node: torch.fx.Node) -> tuple[tuple, dict] | None:
    """The node's arguments with the local CUDA index, in any form, made canonical; None
    where they name no local CUDA index."""
    index = _local_index.get()

    def one(value: object, bare_int: bool) -> object:
        if index is None or _device_index(value, bare_int) != index:
            return value
        if isinstance(value, torch.device):
            return canonical(value)
        if isinstance(value, str):
            return f"cuda:{device_remap.CANONICAL_INDEX}"
        return device_remap.CANONICAL_INDEX

    def mapped(value: object, bare_int: bool) -> object:
        if not isinstance(value, (tuple, list)):
            return one(value, bare_int)
        items = [one(v, False) for v in value]
        changed = any(new is not old for new, old in zip(items, value, strict=True))
        return type(value)(items) if changed else value

    if index is None:
        return None
    args = tuple(mapped(v, _takes_bare_index(node)) for v in node.args)
    kwargs = {k: mapped(v, k == "device") for k, v in node.kwargs.items()}
    if all(a is b for a, b in zip(args, node.args, strict=True)) and all(
        kwargs[k] is v for k, v in node.kwargs.items()
    ):
        return None
    return args, kwargs


def _cuda_indices(gm: torch.fx.GraphModule) -> set[int]:
    """Every CUDA index the graph (and its subgraphs) names in values or arguments."""
    found: set[int] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = attribute(gm, node.target)
            if isinstance(value, torch.fx.GraphModule):
                found |= _cuda_indices(value)
        values = [(v, False) for v in _leaves(node.meta.get("example_value"))]
        for value, bare_int in _device_arguments(node):
            if isinstance(value, (tuple, list)):
                values += [(v, False) for v in value]
            else:
                values.append((value, bare_int))
        for value, bare_int in values:
            index = _device_index(value, bare_int)
            if index is not None:
                found.add(index)
    return found


def local_device_index(gm: torch.fx.GraphModule) -> int | None:
    """The one CUDA device the graph runs on, which its payload names as the canonical
    index: the client runs the artifact there. None for a CPU graph, a graph on several
    devices, or a torch without a device remap (their payloads keep their indices)."""
    indices = _cuda_indices(gm)
    if len(indices) == 1 and device_remap.SUPPORTED:
        return indices.pop()
    return None


def attribute(module: torch.nn.Module, path: str):
    for name in path.split("."):
        module = getattr(module, name)
    return module


def _set_attribute(root: torch.nn.Module, path: str, value: torch.nn.Module) -> None:
    *parents, name = path.split(".")
    for parent in parents:
        if not hasattr(root, parent):
            root.add_module(parent, torch.nn.Module())
        root = getattr(root, parent)
    root.add_module(name, value)


@contextlib.contextmanager
def canonical_device(gm: torch.fx.GraphModule) -> Iterator[None]:
    """Within the block, `canonical` and `canonical_arguments` write the graph's local CUDA
    index as the canonical one (see `local_device_index`)."""
    token = _local_index.set(local_device_index(gm))
    try:
        yield
    finally:
        _local_index.reset(token)


def dumps(gm: torch.fx.GraphModule) -> bytes:
    """Serialize a Dynamo graph (parameters lifted to inputs) deterministically, without
    weights, on the canonical CUDA device (see `local_device_index`)."""
    with canonical_device(gm):
        return _PortablePickler.dumps(metadata_only(gm), _PICKLE_OPTIONS)


def shape_env_of(inputs: list) -> ShapeEnv | None:
    """The ShapeEnv behind a graph's inputs (FakeTensors or SymInts), if any."""
    for value in inputs:
        env = (
            value.node.shape_env
            if isinstance(value, torch.SymInt)
            else getattr(getattr(value, "fake_mode", None), "shape_env", None)
        )
        if env is not None:
            return env
    return None


def size_hints(gm: torch.fx.GraphModule) -> dict[str, int]:
    """The concrete size behind each symbol of the graph's ShapeEnv (empty if static)."""
    env = shape_env_of(example_inputs(gm))
    return {str(s): int(v) for s, v in _integer_hints(env).items()}


def float_hints(gm: torch.fx.GraphModule) -> dict[str, float]:
    """The value behind each float symbol of the graph's ShapeEnv (a float Dynamo lifted to
    an input; empty if none)."""
    env = shape_env_of(example_inputs(gm))
    return {str(s): float(v) for s, v in _float_hints(env).items()}


def loads(payload: bytes, hints: Mapping[str, int | float] | None = None) -> torch.fx.GraphModule:
    """Rebuild the graph with fresh FakeTensors and a ShapeEnv holding `hints` (size hints
    and float hints: an int or a float each). Runs pickle: sandbox only."""
    fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    token = _loading_hints.set(dict(hints or {}))
    try:
        with graph_pickler.unpickler_class(_PortableUnpickler):
            gm = GraphPickler.loads(payload, fake_mode)
    except AttributeError as e:
        if "_OpNamespace" not in str(e):
            raise
        raise ValueError(
            f"the graph calls a custom operator this worker does not have ({e}); "
            "its operator adds the Python module that defines it to "
            "TORCHFARM_OP_LIBRARIES"
        ) from e
    finally:
        _loading_hints.reset(token)
    if not isinstance(gm, torch.fx.GraphModule):
        raise ValueError(f"payload holds {type(gm).__name__}, not a GraphModule")
    for node in gm.graph.nodes:
        if _OP_SCHEMA not in node.meta:
            continue
        schema = graph_pickler.op_schema(node.target)
        if schema != node.meta[_OP_SCHEMA]:
            raise ValueError(
                f"custom operator {node.target} differs on this worker: client "
                f"{node.meta[_OP_SCHEMA]!r}, worker {schema!r}"
            )
    return gm


def loads_graph_only(
    payload: bytes, hints: Mapping[str, int | float] | None = None
) -> torch.fx.GraphModule:
    """`loads`, then the graph rebuilt with only what `metadata_only` keeps (what the graph's
    descriptor covers: whatever else a payload carries is dropped, never compiled); refuses a
    payload that rebuilds a ShapeEnv (a static graph's holds none). Runs pickle: sandbox only."""
    envs: list[ShapeEnv] = []
    token = _loaded_env.set(envs)
    try:
        gm = loads(payload, hints)
    finally:
        _loaded_env.reset(token)
    if envs:
        raise ValueError("the payload holds a ShapeEnv: its descriptor names a static graph")
    return metadata_only(gm, torch.fx.GraphModule)


def example_inputs(gm: torch.fx.GraphModule) -> list:
    """The placeholders' example values (FakeTensors and SymInts), in call order."""
    return [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]


def static_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """The positions of the inputs the client's Dynamo marked static (its module's
    parameters and buffers)."""
    placeholders = (n for n in gm.graph.nodes if n.op == "placeholder")
    return [i for i, n in enumerate(placeholders) if n.meta.get(_STATIC_INPUT) is True]


def op_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    """A readable summary of what the graph computes: call targets and how often."""
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            name = (
                node.target
                if isinstance(node.target, str)
                else getattr(node.target, "__name__", str(node.target))
            )
            counts[name] = counts.get(name, 0) + 1
    return counts
