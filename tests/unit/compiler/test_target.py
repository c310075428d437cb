"""The target descriptor names the device kind, never an index: every rank has one target."""

import sys
import types

import torch

from torchfarm.compiler.target import local_target


def test_every_cuda_device_of_one_kind_gives_one_target(monkeypatch):
    # No GPU here: the capability each device reports and triton's version are stand-ins.
    asked = []
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda index: asked.append(index) or (9, 0)
    )
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
    targets = [local_target(f"cuda:{n}") for n in (0, 1, 7)]
    assert asked == [0, 1, 7]  # each rank describes its own GPU
    assert targets[0] == targets[1] == targets[2]
    assert targets[0].device == "cuda" and targets[0].cuda_capability == "9.0"
    assert "cuda:" not in str(targets[0])
