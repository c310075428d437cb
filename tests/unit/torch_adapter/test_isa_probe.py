"""The vector-ISA probe runs once per worker; children trust the CPU flags, and answer the
build checks it ran, only once it said they may."""

import json

from torch._inductor import cpu_vec_isa

from torchfarm.torch_adapter.worker import isa_probe


def test_children_trust_the_flags_only_after_the_probe_agreed(tmp_path, monkeypatch):
    marker, kept = tmp_path / "children-may-trust-flags", tmp_path / "kept"
    monkeypatch.setenv("TORCHFARM_ISA_PROBE_MARKER", str(marker))
    assert isa_probe.child_environment() == {}  # probe still running, or it disagreed
    assert not isa_probe.recall(str(marker), str(kept))
    kept.write_text(json.dumps({"f" * 64: True}))  # an earlier worker's agreement
    assert isa_probe.recall(str(marker), str(kept))
    assert isa_probe.child_environment() == {"TORCHINDUCTOR_VEC_ISA_OK": "1"}
    assert isa_probe.child_arguments() == ["--isa-checks", json.dumps({"f" * 64: True})]
    monkeypatch.delenv("TORCHFARM_ISA_PROBE_MARKER")
    assert isa_probe.child_environment() == {} and isa_probe.child_arguments() == []


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
