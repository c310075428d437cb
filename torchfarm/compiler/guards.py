"""Shape guards that a compile adds, carried from worker to client.

Inductor adds guards while compiling (e.g. `64*s77 <= 4096` from C++ codegen). A remote
compile loses them and `CompiledArtifact.load` checks none, so the worker returns them as
one Python expression over the graph's SymInt inputs, and the client evaluates it against
its own SymInts, which records each guard in Dynamo's ShapeEnv (as FxGraphCache does on a hit).
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv


def _symbol_inputs(example_inputs: Sequence[object]) -> list[torch.SymInt]:
    return [
        x
        for x in example_inputs
        if isinstance(x, torch.SymInt) and isinstance(x.node.expr, sympy.Symbol)
    ]


def produce(shape_env: ShapeEnv, example_inputs: Sequence[object]) -> str:
    """Worker: every guard on the graph's size inputs, as an expression over L['t0'], ..."""
    symints = _symbol_inputs(example_inputs)
    if not symints:
        return ""
    guards = shape_env.get_pruned_guards(symints)
    return shape_env.produce_guards_expression(symints, guards=guards) or ""


def hold(guards_expr: str, example_inputs: Sequence[object]) -> bool:
    """Client: whether the guards hold for these inputs' concrete sizes (records nothing)."""
    if not guards_expr:
        return True
    symints = _symbol_inputs(example_inputs)
    if not symints:
        return False
    shape_env = symints[0].node.shape_env
    return bool(shape_env.evaluate_guards_expression(guards_expr, [s.node.hint for s in symints]))


def install(guards_expr: str, example_inputs: Sequence[object]) -> bool:
    """Client: False if the guards fail for these sizes; else record them in Dynamo's ShapeEnv."""
    if not hold(guards_expr, example_inputs):
        return False
    if not guards_expr:
        return True
    symints = _symbol_inputs(example_inputs)
    return bool(symints[0].node.shape_env.evaluate_guards_expression(guards_expr, symints))
