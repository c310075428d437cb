"""Shape guards as data: produced from real ShapeEnvs, equal to PyTorch's guard text wherever
it is evaluated, installed into Dynamo's ShapeEnv, and never executed by a client. (A real
Inductor compile's guards: tests/integration/test_guard_entries.py.)"""

import builtins
import itertools
import random

import pytest
import torch
from torch._dynamo.source import LocalSource
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from torchfarm.compiler import guards
from torchfarm.contract import shape_guards
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter.trace import guard_text

Op = pb.GuardApply


def _reference(shape_env: ShapeEnv, example_inputs) -> str:
    """What the worker used to send: PyTorch's guard text (evaluated here, in tests only)."""
    symints = guard_text.symbol_inputs(example_inputs)
    return shape_env.produce_guards_expression(symints, guards=shape_env.get_pruned_guards(symints))


def _text_holds(text: str, sizes) -> bool:
    return bool(ShapeEnv().evaluate_guards_expression(text, sizes))


def _traced(fn, *args):
    """Dynamo's ShapeEnv and graph inputs for fn(*args), traced with dynamic shapes."""
    seen = []

    def capture(gm, example_inputs):
        seen.append((torch._guards.TracingContext.get().fake_mode.shape_env, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, dynamic=True)(*args)
    return seen[0]


def _sizes_and_mod(x, y):
    n = x.shape[0]
    return (x.reshape(-1, 2) * 2).sum() + y[: n // 3].sum() + x[n % 5 :].sum()


def test_guards_from_dynamos_shape_env_hold_exactly_where_its_text_holds():
    shape_env, inputs = _traced(_sizes_and_mod, torch.randn(10), torch.randn(12))
    text = _reference(shape_env, inputs)
    produced = guards.produce(shape_env, inputs)
    ops = {e.apply.op for c in produced.all for e in _walk(c) if e.WhichOneof("node") == "apply"}
    assert {Op.MOD, Op.FLOOR_DIV, Op.EQ, Op.NE, Op.LE} <= ops, shape_guards.describe(produced)
    checked = 0
    for a, b in itertools.product(range(0, 64), range(0, 40)):
        assert shape_guards.evaluate(produced, [a, b]) == _text_holds(text, [a, b]), (a, b)
        checked += shape_guards.evaluate(produced, [a, b])
    assert 0 < checked < 64 * 40  # both outcomes occur


def _walk(e: pb.GuardExpr):
    yield e
    for a in e.apply.args:
        yield from _walk(a)


def _random_expression(rng: random.Random, depth: int, truth: bool) -> str:
    if truth:
        if depth and rng.random() < 0.3:
            parts = [_random_expression(rng, depth - 1, True) for _ in range(rng.randint(2, 3))]
            return "(" + rng.choice([" and ", " or "]).join(parts) + ")"
        if depth and rng.random() < 0.1:
            return f"(not {_random_expression(rng, depth - 1, True)})"
        relation = rng.choice(["==", "!=", "<", "<=", ">", ">="])
        return (
            f"({_random_expression(rng, depth, False)} {relation} "
            f"{_random_expression(rng, depth, False)})"
        )
    if not depth or rng.random() < 0.3:
        return rng.choice(["L['t0']", "L['t1']", str(rng.randint(-9, 9))])
    left, right = (_random_expression(rng, depth - 1, False) for _ in range(2))
    kind = rng.choice(["+", "-", "*", "//", "%", "max", "min", "neg", "pow"])
    if kind in ("max", "min"):
        return f"{kind}({left}, {right})"
    if kind == "neg":
        return f"(-{left})"
    if kind == "pow":
        return f"({left} ** {rng.randint(1, 3)})"
    return f"({left} {kind} {right})"


def test_parse_and_evaluate_follow_python_semantics_on_random_expressions():
    # Negative sizes included: floor division and modulo round toward -inf, as Python does.
    rng = random.Random(0)
    for _ in range(100):
        text = _random_expression(rng, 3, True)
        tree = guards.parse(text, 2)
        for a, b in itertools.product(range(-4, 9), range(-4, 9)):
            try:
                expected = bool(eval(text, {}, {"L": {"t0": a, "t1": b}}))
            except ZeroDivisionError:
                with pytest.raises(ValueError, match="divide by zero"):
                    shape_guards.evaluate(tree, [a, b])
                continue
            assert shape_guards.evaluate(tree, [a, b]) == expected, (text, a, b)


def test_long_sums_stay_shallow():
    # A guard over many concatenated sizes is one n-ary ADD, not a chain 60 levels deep.
    text = " + ".join(["L['t0']", "L['t1']"] * 30) + " <= 3 * L['t1'] * L['t0'] * 2"
    tree = guards.parse(text, 2)
    assert len(tree.all[0].apply.args[0].apply.args) == 60
    for a, b in itertools.product(range(0, 12), range(0, 12)):
        expected = bool(eval(text, {}, {"L": {"t0": a, "t1": b}}))
        assert shape_guards.evaluate(tree, [a, b]) == expected


def _symints(*hints: int) -> tuple[ShapeEnv, list[torch.SymInt]]:
    env = ShapeEnv()
    symints = [
        env.create_symintnode(
            env.create_symbol(h, LocalSource(f"x{i}"), dynamic_dim=DimDynamic.DYNAMIC), hint=h
        )
        for i, h in enumerate(hints)
    ]
    return env, symints


GUARDS = guards.parse("2 <= L['t0'] and L['t0'] <= 4096 and (L['t0'] % 2) == 0", 1)


def test_install_records_each_guard_in_the_shape_env():
    env, inputs = _symints(8)
    assert guards.install(GUARDS, inputs)
    s = inputs[0].node.expr
    recorded = {str(g.expr) for g in env.guards}
    assert {f"{s} <= 4096", f"Eq(Mod({s}, 2), 0)"} <= recorded, recorded
    # The recorded guards now make Dynamo's own check fail outside them: a recompile.
    text = env.produce_guards_expression(inputs)
    assert _text_holds(text, [10]) and not _text_holds(text, [4098]) and not _text_holds(text, [9])


def test_install_refuses_sizes_outside_the_guards_and_records_nothing():
    for hint in (4098, 9):
        env, inputs = _symints(hint)
        assert not guards.install(GUARDS, inputs)
        assert not env.guards


def test_floor_division_and_modulo_on_symints_agree_with_ints():
    tree = guards.parse("(L['t0'] // 3) + (L['t0'] % 5) * L['t1'] == max(L['t1'], 7) - 1", 2)
    for a, b in itertools.product(range(0, 20), range(0, 8)):
        _, inputs = _symints(a, b)
        assert shape_guards.evaluate(tree, inputs) == shape_guards.evaluate(tree, [a, b])


def test_describe_is_readable():
    assert shape_guards.describe(GUARDS) == "2 <= t0 and t0 <= 4096 and (t0 % 2) == 0"
    assert shape_guards.describe(pb.ShapeGuards()) == ""


def _nested(depth: int) -> pb.GuardExpr:
    e = pb.GuardExpr(input=0)
    for _ in range(depth):
        e = pb.GuardExpr(apply=pb.GuardApply(op=Op.NEG, args=[e]))
    return e


def _apply(op, args) -> pb.GuardExpr:
    return pb.GuardExpr(apply=pb.GuardApply(op=op, args=args))


def _input(i: int) -> pb.GuardExpr:
    return pb.GuardExpr(input=i)


def _constant(c: int) -> pb.GuardExpr:
    return pb.GuardExpr(constant=c)


def _relation(left: pb.GuardExpr, op=Op.LE) -> pb.ShapeGuards:
    return pb.ShapeGuards(
        all=[pb.GuardExpr(apply=pb.GuardApply(op=op, args=[left, pb.GuardExpr(constant=1)]))]
    )


HOSTILE = {
    "deep": (_relation(_nested(shape_guards.MAX_DEPTH + 5)), "levels deep"),
    "wide": (
        _relation(_apply(Op.MAX, [_apply(Op.ADD, [_input(0), _constant(1)])] * 4000)),
        "nodes",
    ),
    "unknown operator": (_relation(pb.GuardExpr(input=0), op=99), "unknown guard operator 99"),
    "input out of range": (_relation(pb.GuardExpr(input=7)), "input t7"),
    "empty node": (_relation(pb.GuardExpr()), "empty guard expression"),
    "integer as a guard": (pb.ShapeGuards(all=[pb.GuardExpr(constant=1)]), "not a truth value"),
    "relation of truths": (_relation(_relation(pb.GuardExpr(input=0)).all[0]), "integer operands"),
    "wrong arity": (
        pb.ShapeGuards(all=[pb.GuardExpr(apply=pb.GuardApply(op=Op.LE, args=[]))]),
        "0 operands",
    ),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_messages_are_refused_before_any_evaluation(name, caplog):
    message, why = HOSTILE[name]
    with pytest.raises(ValueError, match=why):
        shape_guards.evaluate(message, [8])
    _, inputs = _symints(8)
    assert not guards.hold(message, inputs) and not guards.install(message, inputs)
    assert "malformed shape guards" in caplog.text


def test_huge_constants_and_code_are_outside_the_grammar(tmp_path):
    with pytest.raises(ValueError):
        pb.GuardExpr(constant=2**70)  # the contract's integers are 64-bit
    with pytest.raises(ValueError, match="beyond 64 bits"):
        guards.parse(f"L['t0'] <= {2**70}", 1)
    marker = tmp_path / "MARKER"
    for code in (
        f"__import__('os').system('touch {marker}')",
        "L['t0'].__class__ == 1",
        "L['t9'] <= 3",
        "L['x0'] <= 3",
        "math.floor(L['t0']) <= 3",
        "L['t0'] ** L['t0'] <= 3",
        "lambda: 1",
        "1 < L['t0'] < 3",
    ):
        with pytest.raises(ValueError, match="outside the ShapeGuards grammar"):
            guards.parse(code, 1)
    assert not marker.exists()


def test_the_client_path_never_evals(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("eval on the client path")

    guards.install(GUARDS, _symints(8)[1])  # first: torch's lazy imports (namedtuple evals)
    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(ShapeEnv, "evaluate_guards_expression", refuse)
    stored = pb.ShapeGuards.FromString(GUARDS.SerializeToString())  # as a client receives them
    env, inputs = _symints(8)
    assert guards.hold(stored, inputs) and guards.install(stored, inputs)
    assert f"{inputs[0].node.expr} <= 4096" in {str(g.expr) for g in env.guards}
    _, outside = _symints(4098)
    assert not guards.hold(stored, outside)
