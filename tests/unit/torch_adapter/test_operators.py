"""torch_adapter/trace/operators.py: torch's operators, overloads and packets, are told from every
other callable a graph node may target."""

import operator

import torch

from torchfarm.torch_adapter.trace.operators import is_operator


def test_overloads_and_packets_are_operators():
    assert is_operator(torch.ops.aten.add.Tensor)
    assert is_operator(torch.ops.aten.add)


def test_other_callables_are_not():
    assert not any(is_operator(f) for f in (torch.add, operator.add, torch.nn.functional.relu))
