"""Regional compilation: a graph of repeated blocks is compiled as one graph per block.

A model's blocks (the children of one ModuleList or Sequential that run at least _MIN_OPS
operations each: transformer layers, ResNet stages' units) trace to the same code at the
same shapes. Compiled as one graph, Inductor lowers every block again, and a sibling of the
model (another depth) is a new graph whose compile starts over. Split at block boundaries,
with every node renamed canonically, each block of one shape is the same graph (the same
payload, the same farm key): compiled once for the model, and found by its siblings, by a
next version of the model, and by other tenants.

The price: Inductor fuses nothing across a block boundary, and each region is its own
autograd Function. Static graphs only (their regions' example values need no ShapeEnv of
their own); graphs that change autocast or grad mode in more than one region, or that read
modules or attributes, are left whole.

Uses: node.meta["nn_module_stack"] (Dynamo's module paths, "L['self'].blocks.3"),
torch.fx.passes.split_module (its partitions' placeholders carry the original nodes' meta).
Verified: torch 2.11.0, 2.13.0, 2.15.0.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from torch.fx.passes.split_module import split_module

from torchfarm.torch_adapter.fake_tensors import FakeTensor

# A module path ending in an index: a ModuleList's (or Sequential's) child.
_INDEXED = re.compile(r"^(?P<list>.+?)(?:\.(?P<dot>\d+)|\[(?P<bracket>\d+)\])$")
# Calls that change state Dynamo tracks across the graph (autocast, grad mode): a split
# between entering and leaving one would change what the regions compute.
_STATEFUL = re.compile(r"autocast|grad_enabled|set_grad|_functorch|inference_mode")
_KINDS = frozenset({"placeholder", "call_function", "call_method", "output"})
# Operations a block must run to be a region of its own: a list's transformer layers or
# residual units, not the single layers of a Sequential (Linear, GELU, Linear).
_MIN_OPS = 8


@dataclasses.dataclass(frozen=True)
class Region:
    """One partition of the graph, renamed canonically (placeholders arg0..., nodes n0...)
    and returning a tuple; `single` if the outer graph takes its one output bare."""

    gm: torch.fx.GraphModule
    single: bool
    block: str  # the block it computes ("L['self'].blocks.3"), or "" for the code between


@dataclasses.dataclass(frozen=True)
class Split:
    """The graph as an outer graph that calls `regions` in order (its `submod_<i>`)."""

    outer: torch.fx.GraphModule
    regions: list[Region]

    def stitched(self, compiled: Sequence[Callable]) -> torch.fx.GraphModule:
        """The outer graph, each region's call going to its compiled code."""
        for number, (region, code) in enumerate(zip(self.regions, compiled, strict=True)):
            setattr(self.outer, f"submod_{number}", _Compiled(code, region.single))
        return self.outer


class _Compiled(torch.nn.Module):
    """A region's compiled code where the outer graph calls the region (a module call)."""

    def __init__(self, code: Callable, single: bool):
        super().__init__()
        self.code, self.single = code, single

    def forward(self, *args):
        out = self.code(*args)
        return out[0] if self.single else tuple(out)


def _block(node: torch.fx.Node) -> tuple[str, int] | None:
    """The outermost indexed module the node runs in: (the list's path, the index)."""
    for path, *_ in (node.meta.get("nn_module_stack") or {}).values():
        match = _INDEXED.match(str(path))
        if match:
            return match["list"], int(match["dot"] or match["bracket"])
    return None


def _stateful(node: torch.fx.Node) -> bool:
    target = node.target
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", "")
    module = getattr(target, "__module__", None) or ""
    return node.op == "call_function" and bool(_STATEFUL.search(f"{module}.{name}"))


def split(gm: torch.fx.GraphModule) -> Split | None:
    """`gm` as a chain of regions, one per block of a list with at least two blocks (of
    _MIN_OPS operations or more) and one for each run of code between them; None where
    nothing repeats or the graph is not one to split (see the module's docstring)."""
    if any(node.op not in _KINDS for node in gm.graph.nodes):
        return None
    blocks = {n: _block(n) for n in gm.graph.nodes if n.op in ("call_function", "call_method")}
    big = {b for b, count in Counter(filter(None, blocks.values())).items() if count >= _MIN_OPS}
    lists = Counter(name for name, _ in big)
    labels = {n: (b if b in big and lists[b[0]] >= 2 else None) for n, b in blocks.items()}
    if not any(labels.values()):
        return None
    partition, numbers, previous = -1, {}, object()
    for node, label in labels.items():  # in graph order: each run of one label is a region
        if label != previous:
            partition, previous = partition + 1, label
        numbers[node] = partition
    # Dynamo restores autocast and grad mode before a graph ends: if every change and
    # restore is in one region, every region starts and ends in the graph's own state.
    if len({numbers[node] for node in numbers if _stateful(node)}) > 1:
        return None
    # A placeholder or output never reaches the callback; split_module puts them outside.
    outer = split_module(gm, gm, lambda node: numbers[node])
    regions = []
    for number in range(partition + 1):
        first = next(n for n, p in numbers.items() if p == number)
        label = labels[first]
        sub = getattr(outer, f"submod_{number}")
        region_gm, single = _canonical(sub)
        regions.append(Region(region_gm, single, f"{label[0]}.{label[1]}" if label else ""))
    return Split(outer, regions)


def _canonical(sub: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, bool]:
    """`sub` with canonical names (two blocks of one shape give one graph, whatever their
    source names), activations as plain inputs (`_plain`) and a tuple output; whether the
    original returned one value bare."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    fresh = not _aliased(sub)
    inputs = counted = 0
    for node in sub.graph.nodes:
        if node.op == "output":
            out = node.args[0]
            single = not isinstance(out, (tuple, list))
            values = (out,) if single else tuple(out)
            graph.output(tuple(torch.fx.map_arg(v, env.__getitem__) for v in values))
            return torch.fx.GraphModule(torch.nn.Module(), graph), single
        meta = dict(node.meta)
        if node.op == "placeholder":
            new = graph.placeholder(f"arg{inputs}")
            inputs += 1
            if fresh:
                meta["example_value"] = _plain(meta["example_value"])
        else:
            new = graph.create_node(
                node.op,
                node.target,
                torch.fx.map_arg(node.args, env.__getitem__),
                torch.fx.map_arg(node.kwargs, env.__getitem__),
                name=f"n{counted}",
            )
            counted += 1
        new.meta = meta
        env[node] = new
    raise ValueError("a region without an output")


def _aliased(sub: torch.fx.GraphModule) -> bool:
    """Whether two of the region's inputs share memory (their aliasing is then part of what
    the region compiles)."""
    storages = [
        node.meta["example_value"].untyped_storage()._cdata
        for node in sub.graph.nodes
        if node.op == "placeholder" and isinstance(node.meta.get("example_value"), torch.Tensor)
    ]
    return len(storages) != len(set(storages))


def _plain(value: object) -> object:
    """An activation coming from the previous region as a tensor of the same layout with no
    history: whether the previous region made it by a view or an add says nothing about this
    region, but the payload would carry it. Leaves (weights, the graph's own inputs) stay."""
    if (
        not isinstance(value, FakeTensor)
        or value.storage_offset()
        or (value.is_leaf and not value._is_view())
    ):
        return value
    with value.fake_mode:
        plain = torch.empty_strided(
            value.shape, value.stride(), dtype=value.dtype, device=value.device
        )
    return plain.requires_grad_(value.requires_grad)
