"""key_parts names what a key is made of: a change to one part changes that part's digest
only; the structure digest groups traces of one program whatever their shapes or constants."""

import torch

from torchfarm.compiler import structure
from torchfarm.contract.cache_key import STRUCTURE, key_parts, key_values
from torchfarm.proto import torchfarm_pb2 as pb

TARGET = pb.Target(device="cpu", torch_version="2.13.0", python_version="3.11", threads=2)
OPTIONS = pb.Options(mode="default", state=pb.TraceState(grad_enabled=True))


def _copy(message):
    copied = type(message)()
    copied.CopyFrom(message)
    return copied


def _changed(a: dict, b: dict) -> set[str]:
    return {p for p in a.keys() | b.keys() if a.get(p) != b.get(p)}


def test_each_part_changes_alone():
    base = key_parts(b"payload", TARGET, OPTIONS, "s" * 64)
    other_target = _copy(TARGET)
    other_target.torch_version = "2.11.0"
    max_autotune = _copy(OPTIONS)
    max_autotune.mode = "max-autotune"
    no_grad = _copy(OPTIONS)
    no_grad.state.grad_enabled = False
    patched = _copy(OPTIONS)
    patched.config_patches_json = '{"max_fusion_size": 8}'
    assert _changed(base, key_parts(b"other", TARGET, OPTIONS, "s" * 64)) == {"graph"}
    assert _changed(base, key_parts(b"payload", other_target, OPTIONS, "s" * 64)) == {
        "target.torch_version"
    }
    assert _changed(base, key_parts(b"payload", TARGET, max_autotune, "s" * 64)) == {"options.mode"}
    assert _changed(base, key_parts(b"payload", TARGET, no_grad, "s" * 64)) == {
        "trace_state.grad_enabled"
    }
    assert _changed(base, key_parts(b"payload", TARGET, patched, "s" * 64)) == {
        "options.config_patches"
    }
    assert STRUCTURE not in key_parts(b"payload", TARGET, OPTIONS)
    assert all(len(h) == 64 for h in base.values())


def test_readable_values_are_the_target_mode_and_trace_state_only():
    values = key_values(TARGET, OPTIONS)
    assert values["target.torch_version"] == "2.13.0"
    assert values["options.mode"] == "default"
    assert values["trace_state.grad_enabled"] == "true"
    assert values["target.threads"] == "2"
    assert not {"graph", STRUCTURE, "options.config_patches"} & values.keys()


class Scaled(torch.nn.Module):
    def __init__(self, factor: float, width: int):
        super().__init__()
        self.factor, self.width = factor, width

    def forward(self, x):
        return torch.relu(x.view(-1, self.width) * self.factor).sum(1)


class Other(torch.nn.Module):
    def forward(self, x):
        return torch.sigmoid(x.view(-1, 4) * 2.0).sum(1)


def test_structure_ignores_constants_and_shapes_not_ops():
    a = structure.digest(torch.fx.symbolic_trace(Scaled(2.0, 4)))
    b = structure.digest(torch.fx.symbolic_trace(Scaled(3.0, 8)))
    c = structure.digest(torch.fx.symbolic_trace(Other()))
    assert a == b
    assert a != c
    assert len(a) == 64
