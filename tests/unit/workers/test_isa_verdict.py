"""The vector-ISA probe runs once per worker; children trust the CPU flags, and answer the
build checks it ran, only once it said they may."""

import json

from torchfarm.workers import isa_verdict


def test_children_trust_the_flags_only_after_the_probe_agreed(tmp_path, monkeypatch):
    marker, kept = tmp_path / "children-may-trust-flags", tmp_path / "kept"
    monkeypatch.setenv("TORCHFARM_ISA_PROBE_MARKER", str(marker))
    assert isa_verdict.child_environment() == {}  # probe still running, or it disagreed
    assert not isa_verdict.recall(str(marker), str(kept))
    kept.write_text(json.dumps({"f" * 64: True}))  # an earlier worker's agreement
    assert isa_verdict.recall(str(marker), str(kept))
    assert isa_verdict.child_environment() == {"TORCHINDUCTOR_VEC_ISA_OK": "1"}
    assert isa_verdict.child_arguments() == ["--isa-checks", json.dumps({"f" * 64: True})]
    monkeypatch.delenv("TORCHFARM_ISA_PROBE_MARKER")
    assert isa_verdict.child_environment() == {} and isa_verdict.child_arguments() == []
