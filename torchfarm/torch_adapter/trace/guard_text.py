"""PyTorch's own guard text for a compile's SymInt inputs, and those inputs' sizes.

The worker parses the text into a ShapeGuards tree (compiler/guards.py); nothing evaluates it.
Uses ShapeEnv.produce_guards_expression and get_pruned_guards, and SymInt.node (its `expr`
and `hint`). Verified: torch 2.11.0, 2.13.0, 2.15.0 (the same calls compiler/guards.py made
before they moved here; signatures re-read in the 2.13.0 and 2.15.0 sources).
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

__all__ = ["ShapeEnv", "guard_text", "hints", "symbol_inputs"]


def symbol_inputs(example_inputs: Sequence[object]) -> list[torch.SymInt]:
    """The graph's inputs that are SymInts of one symbol each (t0, t1, ... of the guards)."""
    return [
        x
        for x in example_inputs
        if isinstance(x, torch.SymInt) and isinstance(x.node.expr, sympy.Symbol)
    ]


def guard_text(shape_env: ShapeEnv, symints: Sequence[torch.SymInt]) -> str:
    """Every guard on `symints` as Python over L['t0'], L['t1'], ...; empty for none.
    produce_guards_expression decides which guards and value ranges apply (inputs that share a
    symbol included), so its text is the reference the worker parses."""
    if not symints:
        return ""
    pruned = shape_env.get_pruned_guards(symints)
    return shape_env.produce_guards_expression(symints, guards=pruned) or ""


def hints(symints: Sequence[torch.SymInt]) -> list[int]:
    """The concrete sizes behind `symints` (this trace's)."""
    return [int(s.node.hint) for s in symints]
