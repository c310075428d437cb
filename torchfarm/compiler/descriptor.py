"""The graph's descriptor: what a static graph's payload (compiler/serialize.py) holds,
written as text straight from what Dynamo already has, without pickling. The key hashes it
(contract/cache_key.py, key format v4), so a hit pays no payload; the payload is made only on
a miss, and the worker's sandboxed child compiles the graph only after rebuilding it with
nothing but what the descriptor covers (`serialize.loads_graph_only`) and finding its
descriptor byte for byte the client's (`verified`): no payload is stored under another
graph's key.

It covers what `serialize.metadata_only` keeps: every node (op, name, target, arguments with
the CUDA index made canonical as in the payload, type), its example value (a FakeTensor's
metadata as torch's MetaTensorDesc describes it: sizes, strides, offset, dtype, device,
layout, grad and view flags, its view base and how autograd made the view, its storage's
size and which tensors share it, Dynamo's dynamic marks), the static-input marks, custom
operators' schemas and subgraphs (torch.cond branches). Version 1 writes static graphs
only: a symbol anywhere (a ShapeEnv in the payload), or any value it cannot write exactly,
raises `Unsupported`, and the graph keeps its payload's hash as its key (format v3).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx.immutable_collections import immutable_dict, immutable_list

from torchfarm.compiler import serialize
from torchfarm.errors import TorchfarmError
from torchfarm.torch_adapter.trace import graph_pickler
from torchfarm.torch_adapter.trace.descriptor_facts import (
    creation_meta,
    dynamic_marks,
    is_operator,
    storage_id,
    view_base,
)
from torchfarm.torch_adapter.trace.fake_tensors import FakeTensor

FORMAT = b"torchfarm-descriptor-v1\n"
# Atoms, written by repr after a letter that keeps 1, 1.0, True and "1" apart.
_ATOMS = {int: "i", float: "f", bool: "b", str: "s", type(None): "n", complex: "c"}
_NAMED = (torch.dtype, torch.layout, torch.memory_format)
# Containers, by their type's name: pickle keeps the type too.
_SEQUENCES = frozenset({tuple, list, torch.Size, immutable_list})
_MAPPINGS = frozenset({dict, immutable_dict})


class Unsupported(TorchfarmError, ValueError):
    """A graph the descriptor does not write: it is keyed by its payload."""


class Mismatch(TorchfarmError, ValueError):
    """A payload whose graph is not the one its descriptor names."""


class _Writer:
    """One descriptor's text: tensors and storages numbered by first appearance, as the
    payload's pickle memo and tensor describer number them."""

    def __init__(self) -> None:
        self.tensors: dict[int, int] = {}
        self.storages: dict[int, int] = {}
        self.kept: list[object] = []  # the numbered objects, alive while their ids count

    def value(self, v: Any) -> str:
        kind = type(v)
        if kind is torch.fx.Node:
            return f"%{v.name}"
        atom = _ATOMS.get(kind)
        if atom is not None:
            return f"{atom}{v!r}"
        if kind in _SEQUENCES:
            return f"{kind.__name__}({','.join(self.value(x) for x in v)})"
        if kind in _MAPPINGS:
            inner = ",".join(f"{self.value(k)}:{self.value(x)}" for k, x in v.items())
            return f"{kind.__name__}{{{inner}}}"
        if kind is torch.device:
            return f"d{serialize.canonical(v)}"
        if isinstance(v, _NAMED):
            return f"{kind.__name__}.{v}"
        if kind is FakeTensor:
            return self.tensor(v)
        if kind is slice:
            return f"slice({self.value(v.start)},{self.value(v.stop)},{self.value(v.step)})"
        if v is Ellipsis:
            return "..."
        if isinstance(v, enum.Enum):
            return f"{kind.__module__}.{kind.__qualname__}.{v.name}"
        if isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor):
            raise ValueError("refusing to serialize a real tensor: the farm takes metadata only")
        raise Unsupported(f"a value of type {kind.__module__}.{kind.__qualname__}")

    def tensor(self, t: FakeTensor) -> str:
        number = self.tensors.get(id(t))
        if number is not None:
            return f"T{number}"
        number = self.tensors[id(t)] = len(self.tensors)
        self.kept.append(t)
        if t.is_sparse or t.is_nested or t.is_mkldnn or t.layout != torch.strided:
            raise Unsupported(f"a {t.layout} tensor")
        storage = t.untyped_storage()
        self.kept.append(storage)
        storage_number = self.storages.setdefault(storage_id(storage), len(self.storages))
        memo = getattr(t, "item_memo", None)
        sizes = (*t.size(), *t.stride(), t.storage_offset(), storage.size())
        if isinstance(memo, (torch.SymInt, torch.SymFloat)) or any(
            type(n) is not int for n in sizes
        ):
            raise Unsupported("a symbolic size or value")
        flags = (
            t.requires_grad,
            t.is_leaf,
            t.is_inference(),
            t.is_conj(),
            t.is_neg(),
            isinstance(t, torch.nn.Parameter),
        )
        facts = (
            f"{t.dtype},{self.value(t.device)},{t.dim()},{sizes},{storage_number},"
            f"{''.join('1' if f else '0' for f in flags)},{dynamic_marks(t)}"
        )
        base = view_base(t)
        view = "" if base is None else f",base={self.value(base)},{creation_meta(t)}"
        return f"T{number}<{facts}{view}>"

    def target(self, target: object) -> str:
        if isinstance(target, str):
            return f"s{target!r}"
        if is_operator(target):
            return f"{type(target).__qualname__}:{target}"
        module = getattr(target, "__module__", None)
        name = getattr(target, "__qualname__", None)
        if module is None or name is None:
            raise Unsupported(f"the call target {target!r}")
        return f"{type(target).__qualname__}:{module}.{name}"

    def graph(self, gm: torch.fx.GraphModule, out: list[str]) -> None:
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                value = serialize.attribute(gm, node.target)
                if not isinstance(value, torch.fx.GraphModule):
                    raise ValueError(
                        f"graph reads {type(value).__name__} {node.target!r} with "
                        "get_attr; the farm needs parameters lifted to inputs"
                    )
                out.append(f"subgraph {node.target}")
                self.graph(value, out)
                out.append("end")
            elif node.op == "call_module":
                raise Unsupported("a call_module node")
            arguments = serialize.canonical_arguments(node)
            args, kwargs = arguments if arguments is not None else (node.args, node.kwargs)
            line = [
                node.op,
                node.name,
                self.target(node.target),
                self.value(args),
                self.value(kwargs),
                "" if node.type is None else self.target(node.type),
            ]
            if "example_value" in node.meta:
                line.append("=" + self.value(node.meta["example_value"]))
            if node.op == "placeholder" and serialize.is_static_input(node):
                line.append("static")
            schema = graph_pickler.custom_op_schema(node.target)
            if schema is not None:
                line.append(f"schema {schema!r}")
            out.append(" ".join(line))


def describe(gm: torch.fx.GraphModule) -> bytes:
    """The descriptor of a static Dynamo graph (or of one `serialize.loads_graph_only`
    rebuilt); Unsupported for any other."""
    writer, out = _Writer(), [FORMAT.decode()]
    with serialize.canonical_device(gm):
        writer.graph(gm, out)
    return "\n".join(out).encode()


def verified(
    payload: bytes, hints: Mapping[str, int | float], descriptor: bytes
) -> torch.fx.GraphModule:
    """The payload's graph, rebuilt with only what `descriptor` covers, once its descriptor
    is that one byte for byte; Mismatch (naming the first line that differs) otherwise.
    Runs pickle: sandbox only."""
    gm = serialize.loads_graph_only(payload, hints)
    try:
        own = describe(gm)
    except Unsupported as e:
        raise Mismatch(f"the payload's graph has no descriptor ({e})") from e
    if own != descriptor:
        lines = zip(own.split(b"\n"), descriptor.split(b"\n"))
        line = next((n for n, (a, b) in enumerate(lines) if a != b), None)
        raise Mismatch(
            "the payload is not the graph its descriptor names (the key's graph): they "
            f"differ at line {line}"
            if line is not None
            else "in length"
        )
    return gm
