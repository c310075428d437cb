"""The ExportedProgram payload (compiler/exported.py, torch_adapter/trace/export_serde.py): no
weights unless asked, the same bytes for the same program whatever its weights or where it
was exported, the user's files unnamed, values exact when sent; nothing unpickled on the way
back; malformed specs and inputs refused with their name."""

import pytest
import torch

from tests.models import exported_block
from torchfarm.compiler import exported
from torchfarm.proto import torchfarm_pb2 as pb


def test_the_payload_holds_no_weights_and_names_no_file():
    model, program = exported_block(seed=0)
    _, other = exported_block(seed=1)
    payload = exported.dumps(program)
    assert payload == exported.dumps(other)  # the weights are not in the key
    message = pb.ExportedProgram.FromString(payload)
    assert not message.weights and message.weights_blob  # the client writes them (issue 52)
    assert all(not s.data for s in (*message.state_dict, *message.constants))
    assert [s.name for s in message.state_dict] == sorted(program.state_dict)
    weight = model.up.weight.detach().numpy().tobytes()
    assert weight[:64] not in payload
    assert b"models.py" not in payload and b"stack_trace" not in payload


def test_weights_sent_come_back_exact_and_nothing_is_unpickled(monkeypatch):
    _, program = exported_block(seed=0)
    payload = exported.dumps(program, weights=True)

    def refuse(*args, **kwargs):
        raise AssertionError("torch.load called on a payload")

    monkeypatch.setattr(torch, "load", refuse)
    rebuilt, weights = exported.loads(payload)
    assert weights == exported.SENT
    for name, tensor in program.state_dict.items():
        assert torch.equal(rebuilt.state_dict[name], tensor), name
        assert isinstance(rebuilt.state_dict[name], torch.nn.Parameter) == isinstance(
            tensor, torch.nn.Parameter
        )
    assert [tuple(t.shape) for t in rebuilt.example_inputs[0]] == [(4, 32)]
    assert rebuilt.range_constraints.keys() and str(program.range_constraints) == str(
        rebuilt.range_constraints
    )


def test_placeholders_are_not_uniform():
    _, program = exported_block(seed=0)
    rebuilt, weights = exported.loads(exported.dumps(program))
    assert weights == exported.BLOB
    for name, tensor in rebuilt.state_dict.items():
        assert tensor.shape == program.state_dict[name].shape
        if tensor.numel() > 1:
            assert tensor.unique().numel() > 1, name


@pytest.mark.parametrize(
    "change, error",
    [
        (lambda s: setattr(s, "dtype", "os.system"), "unknown dtype"),
        (lambda s: setattr(s, "device", "cuda:0; rm"), "unknown device"),
        (lambda s: s.strides.append(1), "malformed sizes"),
        (lambda s: setattr(s, "data", b"\0" * 3), "3 bytes of values"),
    ],
)
def test_a_malformed_tensor_spec_is_refused_by_name(change, error):
    _, program = exported_block(seed=0)
    message = pb.ExportedProgram.FromString(exported.dumps(program, weights=True))
    change(message.state_dict[0])
    with pytest.raises(ValueError, match=f"{message.state_dict[0].name}: {error}"):
        exported.loads(message.SerializeToString())


def test_inputs_other_than_tensors_are_refused():
    class Scaled(torch.nn.Module):
        def forward(self, x, factor: int):
            return x * factor

    program = torch.export.export(Scaled(), (torch.randn(2), 3))
    with pytest.raises(ValueError, match="example input 1 is a int"):
        exported.dumps(program)
