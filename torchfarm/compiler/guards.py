"""Shape guards that a compile adds, carried from worker to client as data.

Inductor adds guards while compiling (e.g. `64*s77 <= 4096` from C++ codegen). A remote
compile loses them and `CompiledArtifact.load` checks none, so the worker returns them and the
client installs them into Dynamo's ShapeEnv (as FxGraphCache does on a hit). They travel as a
ShapeGuards tree (see contract/shape_guards.py), never as text a client evaluates: the farm is
not trusted to run code on clients. Torch's side (its guard text, the SymInts' sizes) is
torch_adapter/trace/guard_text.py.
"""

from __future__ import annotations

import ast
import functools
import logging
from collections.abc import Sequence

from torchfarm.contract import shape_guards
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter.trace.guard_text import ShapeEnv, guard_text, hints, symbol_inputs

log = logging.getLogger("torchfarm")

Op = pb.GuardApply
_INT64 = range(-(2**63), 2**63)
_LARGEST_POWER = 8  # `x ** k` becomes k factors
_BINARY = {
    ast.Add: Op.ADD,
    ast.Sub: Op.SUB,
    ast.Mult: Op.MUL,
    ast.FloorDiv: Op.FLOOR_DIV,
    ast.Mod: Op.MOD,
}
_RELATIONS = {
    ast.Eq: Op.EQ,
    ast.NotEq: Op.NE,
    ast.Lt: Op.LT,
    ast.LtE: Op.LE,
    ast.Gt: Op.GT,
    ast.GtE: Op.GE,
}
_CALLS = {"max": Op.MAX, "min": Op.MIN}


def produce(shape_env: ShapeEnv, example_inputs: Sequence[object]) -> pb.ShapeGuards:
    """Worker: every guard on the graph's SymInt inputs. Raises ValueError for a guard
    outside the ShapeGuards grammar (the compile then fails rather than ship it unguarded)."""
    symints = symbol_inputs(example_inputs)
    text = guard_text(shape_env, symints)
    guards = parse(text, len(symints))
    shape_guards.check(guards, len(symints))
    return guards


def parse(text: str, inputs: int) -> pb.ShapeGuards:
    """produce_guards_expression's Python text over L['t0'], L['t1'], ... as a ShapeGuards;
    ValueError for anything outside the grammar."""
    if not text:
        return pb.ShapeGuards()
    try:
        body = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"unparsable shape guards {text!r}: {e}") from e
    parts = body.values if isinstance(body, ast.BoolOp) and isinstance(body.op, ast.And) else [body]
    try:
        return pb.ShapeGuards(all=[_tree(part, inputs) for part in parts])
    except ValueError as e:
        raise ValueError(f"shape guards {text!r} outside the ShapeGuards grammar: {e}") from e


def _apply(op: pb.GuardApply.Op.ValueType, args: list[pb.GuardExpr]) -> pb.GuardExpr:
    return pb.GuardExpr(apply=pb.GuardApply(op=op, args=args))


def _tree(node: ast.expr, inputs: int) -> pb.GuardExpr:
    """One Python expression node as a GuardExpr."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        if node.value not in _INT64:
            raise ValueError(f"constant {node.value} beyond 64 bits")
        return pb.GuardExpr(constant=node.value)
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        index = node.slice.value if isinstance(node.slice, ast.Constant) else None
        if node.value.id == "L" and isinstance(index, str) and index[1:].isdigit():
            if index[0] == "t" and int(index[1:]) < inputs:
                return pb.GuardExpr(input=int(index[1:]))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):  # -3 is a constant
        if isinstance(node.operand, ast.Constant) and type(node.operand.value) is int:
            return _tree(ast.Constant(-node.operand.value), inputs)
        return _apply(Op.NEG, [_tree(node.operand, inputs)])
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return _apply(Op.NOT, [_tree(node.operand, inputs)])
    if isinstance(node, ast.BoolOp):
        op = Op.AND if isinstance(node.op, ast.And) else Op.OR
        return _apply(op, [_tree(v, inputs) for v in node.values])
    if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Mult):  # a + b + c: one ADD
        chain, terms = type(node.op), []
        while isinstance(node, ast.BinOp) and type(node.op) is chain:
            terms.append(node.right)
            node = node.left
        terms.append(node)
        return _apply(_BINARY[chain], [_tree(t, inputs) for t in reversed(terms)])
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _apply(_BINARY[type(node.op)], [_tree(node.left, inputs), _tree(node.right, inputs)])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):  # PowByNatural
        k = node.right.value if isinstance(node.right, ast.Constant) else None
        if type(k) is int and 1 <= k <= _LARGEST_POWER:
            factor = _tree(node.left, inputs)
            return functools.reduce(lambda x, y: _apply(Op.MUL, [x, y]), [factor] * k)
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _RELATIONS:
        sides = [_tree(node.left, inputs), _tree(node.comparators[0], inputs)]
        return _apply(_RELATIONS[type(node.ops[0])], sides)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        if node.func.id in _CALLS and len(node.args) >= 2:
            return _apply(_CALLS[node.func.id], [_tree(a, inputs) for a in node.args])
    raise ValueError(f"{ast.unparse(node)!r}")


def hold(guards: pb.ShapeGuards, example_inputs: Sequence[object]) -> bool:
    """Client: whether the guards hold for these inputs' concrete sizes (records nothing).
    A malformed message holds nowhere: the entry is skipped, with a log line."""
    sizes = hints(symbol_inputs(example_inputs))
    try:
        return shape_guards.evaluate(guards, sizes)
    except ValueError as e:
        log.warning("ignoring a cache entry with malformed shape guards: %s", e)
        return False


def install(guards: pb.ShapeGuards, example_inputs: Sequence[object]) -> bool:
    """Client: False if the guards fail for these sizes; else record them in Dynamo's
    ShapeEnv, by evaluating them on the SymInts themselves."""
    if not hold(guards, example_inputs):
        return False
    return shape_guards.evaluate(guards, symbol_inputs(example_inputs))
