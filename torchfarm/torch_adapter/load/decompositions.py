"""The decomposition table a loaded graph names, without importing Inductor's decompositions.

Inductor keeps the function that picks its decomposition table in each compiled graph's
`fx_kwargs` (`get_decomp_fn`, for GraphLowering: a compile-time step), so the pickled entry
names `torch._inductor.decomposition.select_decomp_table`, and unpickling it imports that
module (0.1 s on the CPU box, torch 2.13) though a loaded graph never calls it. The worker
points it here instead (compiler/inductor.py, through torch_adapter/compile/light_wrapper.py);
a call still gets Inductor's table.

Uses torch._inductor.decomposition.select_decomp_table (no arguments). Verified: torch
2.11.0, 2.13.0, 2.15.0 (tests/unit/torch_adapter/test_light_wrapper.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def select_decomp_table() -> dict[Any, Callable[..., Any]]:
    """Inductor's decomposition table (its module imported on this first call)."""
    from torch._inductor.decomposition import select_decomp_table as inductors

    return inductors()
