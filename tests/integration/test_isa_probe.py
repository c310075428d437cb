"""Inductor's vector-ISA probe, run as a worker runs it (it builds test programs with g++)."""

import os

import pytest

from torchfarm.torch_adapter import isa_probe

pytestmark = pytest.mark.integration


def test_the_probe_agrees_on_this_machine():
    # Inductor's own probe (it builds test programs) and the CPU flags give the same ISAs here;
    # where they do not, children keep probing, which costs time, never correctness.
    assert isa_probe.children_may_trust_flags()
    assert "TORCHINDUCTOR_VEC_ISA_OK" not in os.environ
