"""The vector-ISA probe runs once per worker; children trust the CPU flags only once it
said they may."""

from torchfarm.torch_adapter import isa_probe


def test_children_trust_the_flags_only_after_the_probe_agreed(tmp_path, monkeypatch):
    marker = tmp_path / "children-may-trust-flags"
    monkeypatch.setenv("TORCHFARM_ISA_PROBE_MARKER", str(marker))
    assert isa_probe.child_environment() == {}  # probe still running, or it disagreed
    marker.touch()
    assert isa_probe.child_environment() == {"TORCHINDUCTOR_VEC_ISA_OK": "1"}
    monkeypatch.delenv("TORCHFARM_ISA_PROBE_MARKER")
    assert isa_probe.child_environment() == {}  # not a worker
