"""A child answers the build checks the worker's vector-ISA probe ran, and builds any other
(how the probe's verdict reaches it: tests/unit/workers/test_isa_verdict.py)."""

import json

from torch._inductor import cpu_vec_isa

from torchfarm.torch_adapter.worker import isa_probe


def test_a_vouched_check_is_answered_and_any_other_still_built(monkeypatch):
    # monkeypatch's check_build stands in for Inductor's g++ build
    isa = cpu_vec_isa.VecAVX2()
    built = []
    monkeypatch.setattr(
        cpu_vec_isa.VecISA, "check_build", lambda self, code: built.append(code) or True
    )
    vouched = json.dumps({isa_probe.check_fingerprint(isa, "int known;"): False})
    with isa_probe.vouched_checks(vouched):
        assert isa.check_build("int known;") is False  # the probe's answer, nothing built
        assert isa.check_build("int other;") is True and built == ["int other;"]
    assert isa.check_build("int known;") is True  # outside: Inductor's own again
    with isa_probe.vouched_checks(""):  # an older worker's agreement: no checks
        assert isa.check_build("int known;") is True
