"""Inductor's debug flags for a loaded graph's calls, without importing its debug module.

Every call of a compiled graph (CompiledFxGraph.__call__) reads three flags through the
attribute `torch._inductor.debug` of the `torch._inductor` package, which exists once that
module is imported. Importing it imports AOTAutograd's compile path (functorch.compile and
its partitioners), Inductor's IR and scheduler: 0.16 s and 350 modules of a CPU skip hit,
where the loaded graph uses none of them (torch 2.13).

`provide` sets that attribute, where the module is not imported, to a stand-in that reads as
the module: the three flags are the module's own once it is imported, and its defaults
before (only its functions set them, and nothing of it ran); any other attribute, and any
write, goes to the module, imported then. An import of the module (`import
torch._inductor.debug` anywhere: it is not in `sys.modules`) puts the module itself in the
attribute.

Uses torch._inductor.debug's RECORD_GRAPH_EXECUTION, GRAPH_EXECUTION_ORDER and
GRAPH_COMPILE_IDS and their defaults, read by CompiledFxGraph.__call__. Verified (sources
read): torch 2.11.0, 2.13.0, 2.15.0.
"""

from __future__ import annotations

import importlib
import sys

import torch._inductor

_MODULE = "torch._inductor.debug"
_DEFAULTS = {
    "RECORD_GRAPH_EXECUTION": False,
    "GRAPH_EXECUTION_ORDER": None,
    "GRAPH_COMPILE_IDS": None,
}


class _StandIn:
    """`torch._inductor.debug` until the module is imported."""

    def __getattr__(self, name: str) -> object:
        module = sys.modules.get(_MODULE)
        if module is None and name in _DEFAULTS:
            return _DEFAULTS[name]
        return getattr(module or importlib.import_module(_MODULE), name)

    def __setattr__(self, name: str, value: object) -> None:
        setattr(importlib.import_module(_MODULE), name, value)


def provide() -> None:
    """Make `torch._inductor.debug` readable without importing the module (once)."""
    if _MODULE not in sys.modules and not hasattr(torch._inductor, "debug"):
        torch._inductor.debug = _StandIn()  # type: ignore[assignment]
