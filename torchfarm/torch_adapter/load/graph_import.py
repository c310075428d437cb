"""A loaded graph's post-compile without importing Inductor's graph lowering.

`FxGraphCache.cache_hit_post_compile`, which the load runs for every graph of an artifact,
imports `torch._inductor.graph` right after loading the output code, for one class
attribute: `GraphLowering.save_output_code`, a hook of torch's tests (None unless a test
sets it). That import brings in the lowerings, every kernel template (jinja compiles them
at import) and Inductor's code generators, which the loaded code never uses: on the CPU
box, 0.8 s of a 1.1 s load and 143 of its 178 modules (an MLP's artifact, torch 2.13).

While `left_out` is entered, each loaded output code is followed by a stand-in module in
`sys.modules`, until the import above takes it: on the loading thread its `GraphLowering`
has `save_output_code` None and nothing else. Any other use (another thread, another name)
imports the real module, which replaces it. Where Inductor's graph module is already
imported (a local compile ran in this process), nothing changes.

Uses torch._inductor.output_code.CompiledFxGraph.after_deserialization (wrapped while the
block runs) and the `from .graph import GraphLowering` that follows that call in
torch._inductor.codecache.FxGraphCache.cache_hit_post_compile.
Verified (sources read): torch 2.11.0, 2.13.0, 2.15.0.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import types
from collections.abc import Iterator

from torch._inductor.output_code import CompiledFxGraph

_GRAPH = "torch._inductor.graph"


class _GraphLowering:
    """What cache_hit_post_compile reads of GraphLowering."""

    save_output_code = None


class _StandIn(types.ModuleType):
    """torch._inductor.graph for the one import that follows a loaded output code."""

    def __init__(self) -> None:
        super().__init__(_GRAPH)
        self._thread = threading.get_ident()

    def __getattr__(self, name: str) -> object:
        if name == "GraphLowering" and threading.get_ident() == self._thread:
            _remove(self)  # taken: any later import gets the real module
            return _GraphLowering
        if name.startswith("__"):  # the import system's probes (__path__, ...)
            raise AttributeError(name)
        _remove(self)
        return getattr(importlib.import_module(_GRAPH), name)


@contextlib.contextmanager
def left_out() -> Iterator[None]:
    """In the block, loading a graph does not import torch._inductor.graph."""
    if _GRAPH in sys.modules:
        yield
        return
    original = CompiledFxGraph.after_deserialization
    stand_ins: list[_StandIn] = []

    def after_deserialization(self, constants):
        path = original(self, constants)
        if _GRAPH not in sys.modules:
            stand_ins.append(_StandIn())
            sys.modules[_GRAPH] = stand_ins[-1]
        return path

    setattr(CompiledFxGraph, "after_deserialization", after_deserialization)  # noqa: B010
    try:
        yield
    finally:
        setattr(CompiledFxGraph, "after_deserialization", original)  # noqa: B010
        for stand_in in stand_ins:
            _remove(stand_in)


def _remove(stand_in: _StandIn) -> None:
    if sys.modules.get(_GRAPH) is stand_in:
        del sys.modules[_GRAPH]
