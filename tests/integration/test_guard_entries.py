"""Guards as data against real parts: a real Inductor compile's guards hold exactly where
PyTorch's text holds, and planted index entries can no longer make a client run code through
their guards (issue 17); an undecodable one is passed over."""

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import torchfarm
from tests.integration.helpers import TOKENS
from tests.models import build
from torchfarm.cache import keys
from torchfarm.cache.artifacts import index_value
from torchfarm.cache.store import entry_dict, entry_from_dict
from torchfarm.client import backend
from torchfarm.compiler import guards, inductor, serialize, trace_state
from torchfarm.contract import shape_guards
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter.trace import guard_text

pytestmark = pytest.mark.integration


def _reference(shape_env: ShapeEnv, example_inputs) -> str:
    """What the worker used to send: PyTorch's guard text (evaluated here, in tests only)."""
    symints = guard_text.symbol_inputs(example_inputs)
    return shape_env.produce_guards_expression(symints, guards=shape_env.get_pruned_guards(symints))


def _text_holds(text: str, sizes) -> bool:
    return bool(ShapeEnv().evaluate_guards_expression(text, sizes))


@pytest.fixture
def mlp_compile(monkeypatch):
    """A real worker compile of the dynamic MLP with grad enabled: (its guards, the text)."""
    model, _ = build("mlp")
    requests = []

    def capture(gm, example_inputs):
        options = pb.Options(mode="default", state=trace_state.capture())
        requests.append((serialize.dumps(gm), options, serialize.size_hints(gm)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture, dynamic=True)(torch.randn(8, 32))
    texts = []
    produce = guards.produce

    def produce_and_keep_the_text(shape_env, example_inputs):
        texts.append(_reference(shape_env, example_inputs))
        return produce(shape_env, example_inputs)

    monkeypatch.setattr(guards, "produce", produce_and_keep_the_text)
    payload, options, hints = requests[0]
    artifact = inductor.compile_payload(payload, options, torch.get_num_threads(), dict(hints))
    return artifact.guards, texts[0]


def test_a_real_compiles_guards_hold_exactly_where_its_text_holds(mlp_compile):
    produced, text = mlp_compile
    # Inductor's C++ codegen guards the batch of a training graph (a sum over it) at 4096.
    assert shape_guards.describe(produced) == "2 <= t0 and t0 <= 4096", text
    for batch in [*range(0, 70), 4095, 4096, 4097, 5000, 2**40]:
        assert shape_guards.evaluate(produced, [batch]) == _text_holds(text, [batch]), batch
    # It survives the contract and the entry's metadata (its JSON form: `cache ls --json`).
    assert pb.ShapeGuards.FromString(produced.SerializeToString()) == produced
    assert entry_from_dict(entry_dict(pb.EntryMeta(guards=produced))).guards == produced


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field, written by hand: the contract no longer has the
    old text field (EntryMeta 5, `guards_expr`), and a planted `guards` may be any bytes."""

    def varint(n: int) -> bytes:
        out = b""
        while n >= 0x80:
            out, n = out + bytes([n & 0x7F | 0x80]), n >> 7
        return out + bytes([n])

    return varint(number << 3 | 2) + varint(len(payload)) + payload


def test_a_planted_entry_cannot_make_a_client_run_code_through_its_guards(farm, store, tmp_path):
    marker = tmp_path / "MARKER"
    code = f"__import__('os').system('touch {marker}')"
    # The old client ran an entry's `guards_expr` through this call, on every candidate:
    ShapeEnv().evaluate_guards_expression(code, [8])
    assert marker.exists()  # so the planted text below is live code
    marker.unlink()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 20), torch.nn.ReLU())  # no other test's key
    torch._dynamo.reset()
    backend.history.clear()
    compiled = torchfarm.compile(model, addr=farm.addr, token=TOKENS["alice"], dynamic=True)
    x = torch.randn(8, 32)
    torch.testing.assert_close(compiled(x), model(x))
    [record] = backend.history
    [honest] = store.artifacts.entries(record.key)
    assert honest.guards.all  # a training graph: guarded at <= 4096

    # Whoever writes Redis rewrites the honest entry's guards and plants two more entries,
    # each also carrying the old text field.
    unknown_operator = pb.ShapeGuards(
        all=[pb.GuardExpr(apply=pb.GuardApply(op=99, args=[pb.GuardExpr(input=0)]))]
    )
    out_of_range = pb.ShapeGuards(
        all=[
            pb.GuardExpr(
                apply=pb.GuardApply(
                    op=pb.GuardApply.LE, args=[pb.GuardExpr(input=7), pb.GuardExpr(constant=9)]
                )
            )
        ]
    )
    guards_field = pb.EntryMeta.DESCRIPTOR.fields_by_name["guards"].number
    old_text = _field(5, code.encode())
    planted = {
        honest.digest: unknown_operator.SerializeToString(),
        "0" * 64: code.encode(),  # `guards` that do not decode: the entry is not offered
        "f" * 64: out_of_range.SerializeToString(),
    }
    for digest, planted_guards in planted.items():
        meta = pb.EntryMeta()
        meta.CopyFrom(honest)
        meta.digest = digest
        for name in ("guards", "hits", "last_hit"):
            meta.ClearField(name)
        value = meta.SerializeToString() + old_text + _field(guards_field, planted_guards)
        store.artifacts.redis.hset(keys.index(record.key), digest, index_value(value))

    # A fresh trace at another batch: no candidate holds, so the farm compiles a new entry.
    torch._dynamo.reset()
    backend.history.clear()
    compiled = torchfarm.compile(model, addr=farm.addr, token=TOKENS["alice"], dynamic=True)
    x = torch.randn(16, 32)
    torch.testing.assert_close(compiled(x), model(x))
    assert [r.source for r in backend.history] == ["miss"]
    assert not marker.exists()
    entries = store.artifacts.entries(record.key)
    fresh = [e for e in entries if code.encode() not in e.SerializeToString()]
    assert len(fresh) == 1 and fresh[0].guards.all
    store.artifacts.drop(record.key)  # planted entries stay out of the other tests' cache
