"""ShapeGuards messages: checked, evaluated and shown by our own code, never by `eval`.

An entry's guards come from the farm, so they are hostile until checked: whoever could write
an index entry once made every client of that graph run code through the guard text (issue 17).
Here a guard is a small tree (torchfarm.proto ShapeGuards) of integer operators over the graph's
SymInt inputs; `evaluate` walks it with Python operators, on plain ints (does an entry apply?)
or on SymInts (the same walk records each guard in Dynamo's ShapeEnv). Torch-free, so the
cache CLI can show them without importing torch.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

from torchfarm.proto import torchfarm_pb2 as pb

# Real guards have a few dozen nodes; these bound what a hostile message may cost. (Sums and
# products are n-ary, so a long sum stays shallow; protobuf refuses nesting over 100.)
MAX_NODES = 10_000
MAX_DEPTH = 32

Op = pb.GuardApply

_INT, _BOOL = "integer", "truth value"
# Infix: operator -> (Python function, symbol, result kind), applied left to right as Python
# does; operands are integers.
_INFIX: dict[int, tuple[Callable[[Any, Any], Any], str, str]] = {
    Op.ADD: (operator.add, "+", _INT),
    Op.SUB: (operator.sub, "-", _INT),
    Op.MUL: (operator.mul, "*", _INT),
    Op.FLOOR_DIV: (operator.floordiv, "//", _INT),
    Op.MOD: (operator.mod, "%", _INT),
    Op.EQ: (operator.eq, "==", _BOOL),
    Op.NE: (operator.ne, "!=", _BOOL),
    Op.LT: (operator.lt, "<", _BOOL),
    Op.LE: (operator.le, "<=", _BOOL),
    Op.GT: (operator.gt, ">", _BOOL),
    Op.GE: (operator.ge, ">=", _BOOL),
}
# operator -> (operand kind, result kind, fewest operands, most operands)
_SIGNATURES: dict[int, tuple[str, str, int, int]] = {
    **{op: (_INT, result, 2, 2) for op, (_, _, result) in _INFIX.items()},
    Op.ADD: (_INT, _INT, 2, MAX_NODES),
    Op.MUL: (_INT, _INT, 2, MAX_NODES),
    Op.NEG: (_INT, _INT, 1, 1),
    Op.MAX: (_INT, _INT, 2, MAX_NODES),
    Op.MIN: (_INT, _INT, 2, MAX_NODES),
    Op.AND: (_BOOL, _BOOL, 2, MAX_NODES),
    Op.OR: (_BOOL, _BOOL, 2, MAX_NODES),
    Op.NOT: (_BOOL, _BOOL, 1, 1),
}


def check(guards: pb.ShapeGuards, inputs: int) -> None:
    """Raise ValueError unless `guards` is a well-typed tree over `inputs` SymInt inputs,
    within MAX_NODES and MAX_DEPTH."""
    nodes = 0

    def kind_of(e: pb.GuardExpr, depth: int) -> str:
        nonlocal nodes
        nodes += 1
        if nodes > MAX_NODES or depth > MAX_DEPTH:
            raise ValueError(f"guards over {MAX_NODES} nodes or {MAX_DEPTH} levels deep")
        node = e.WhichOneof("node")
        if node == "input":
            if e.input >= inputs:
                raise ValueError(f"guard on input t{e.input}; the graph has {inputs} SymInts")
            return _INT
        if node == "constant":
            return _INT
        if node != "apply":
            raise ValueError("empty guard expression")
        if e.apply.op not in _SIGNATURES:
            raise ValueError(f"unknown guard operator {e.apply.op}")
        operand, result, fewest, most = _SIGNATURES[e.apply.op]
        if not fewest <= len(e.apply.args) <= most:
            raise ValueError(f"{Op.Op.Name(e.apply.op)} with {len(e.apply.args)} operands")
        for arg in e.apply.args:
            if kind_of(arg, depth + 1) != operand:
                raise ValueError(f"{Op.Op.Name(e.apply.op)} needs {operand} operands")
        return result

    for condition in guards.all:
        if kind_of(condition, 1) != _BOOL:
            raise ValueError("a guard that is not a truth value")


def evaluate(guards: pb.ShapeGuards, values: Sequence[Any]) -> bool:
    """Whether every guard holds for `values`, the graph's SymInt inputs in order: plain ints,
    or SymInts (then each truth value taken is recorded as a guard in their ShapeEnv, as
    `ShapeEnv.evaluate_guards_expression` records it). Raises ValueError on a malformed tree."""
    check(guards, len(values))

    def value(e: pb.GuardExpr) -> Any:
        node = e.WhichOneof("node")
        if node == "input":
            return values[e.input]
        if node == "constant":
            return e.constant
        op, args = e.apply.op, e.apply.args
        if op == Op.AND:
            return all(truth(a) for a in args)
        if op == Op.OR:
            return any(truth(a) for a in args)
        if op == Op.NOT:
            return not truth(args[0])
        operands = [value(a) for a in args]
        if op == Op.NEG:
            return -operands[0]
        if op == Op.MAX:
            return max(operands)
        if op == Op.MIN:
            return min(operands)
        return functools.reduce(_INFIX[op][0], operands)

    def truth(e: pb.GuardExpr) -> bool:
        return bool(value(e))

    try:
        return all(truth(condition) for condition in guards.all)
    except ZeroDivisionError as e:
        raise ValueError(f"guards divide by zero: {e}") from e


def describe(guards: pb.ShapeGuards) -> str:
    """For people: e.g. `2 <= t0 and t0 <= 4096`; empty for no guards."""

    def text(e: pb.GuardExpr, nested: bool) -> str:
        node = e.WhichOneof("node")
        if node == "input":
            return f"t{e.input}"
        if node == "constant":
            return str(e.constant)
        if node != "apply" or e.apply.op not in _SIGNATURES:
            return "?"
        op, args = e.apply.op, [text(a, True) for a in e.apply.args]
        if op in (Op.MAX, Op.MIN):
            return f"{Op.Op.Name(op).lower()}({', '.join(args)})"
        if op == Op.NEG:
            shown = f"-{args[0]}"
        elif op == Op.NOT:
            shown = f"not {args[0]}"
        elif op in (Op.AND, Op.OR):
            shown = f" {Op.Op.Name(op).lower()} ".join(args)
        else:
            shown = f" {_INFIX[op][1]} ".join(args)
        return f"({shown})" if nested else shown

    return " and ".join(text(condition, False) for condition in guards.all)
