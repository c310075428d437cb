"""Per-toolchain work, once per worker: a compile child's sandbox gains the worker's
precompiled headers, read-only, once built."""

import json
import os
import threading
import time
from pathlib import Path

from tests.unit.workers.test_sandbox import LAYOUT
from torchfarm.settings import WorkerSettings
from torchfarm.torch_adapter.worker import isa_probe, precompiled_headers
from torchfarm.workers import isa_verdict, sandbox, toolchain

WHERE = "/tmp/torchinductor_nobody/precompiled_headers"


def test_built_headers_are_bound_read_only_over_the_childs_tmpfs(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHFARM_PRECOMPILED_HEADERS_DIR", str(tmp_path))
    before = sandbox.bwrap_args(WorkerSettings(), LAYOUT)
    assert not [a for a in before if "precompiled_headers" in a]
    (tmp_path / "k.h").write_text("#include <torch/csrc/inductor/cpp_prefix.h>\n")
    (tmp_path / "k.h.gch").write_bytes(b"gpch")
    precompiled_headers.record(str(tmp_path), ["k.h", "k.h.gch"])
    args = sandbox.bwrap_args(WorkerSettings(), LAYOUT)
    binds = [args[i : i + 3] for i, a in enumerate(args) if a in ("--bind", "--ro-bind")]
    assert ["--ro-bind", str(tmp_path / "k.h.gch"), f"{WHERE}/k.h.gch"] in binds
    assert ["--ro-bind", str(tmp_path / "k.h"), f"{WHERE}/k.h"] in binds
    assert not [b for b in binds if b[0] == "--bind"]  # nothing of the worker's writable
    # after the private /tmp, or the tmpfs would hide them
    assert args.index(f"{WHERE}/k.h.gch") > args.index(sandbox.WORK_DIR)
    env = sandbox.child_environment(sandbox.WORK_DIR, sandbox.LIB_DIR)
    assert env["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] == "1"
    assert json.loads((tmp_path / precompiled_headers.MANIFEST).read_text()) == ["k.h", "k.h.gch"]


def test_children_compile_without_headers_before_they_are_built(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHFARM_PRECOMPILED_HEADERS_DIR", str(tmp_path))
    env = sandbox.child_environment(sandbox.WORK_DIR, sandbox.LIB_DIR)
    assert env["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] == "0"


def _wait_for_headers(timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while not precompiled_headers.child_binds(sandbox.WORK_DIR, sandbox.CHILD_USER):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_worker_probes_then_builds_once_in_the_background(tmp_path, monkeypatch):
    for name in ("TORCHFARM_PRECOMPILED_HEADERS_DIR", "TORCHFARM_ISA_PROBE_MARKER"):
        monkeypatch.setenv(name, "")  # restored after the test; the worker sets them
    monkeypatch.setenv("TORCHFARM_TOOLCHAIN_CACHE", str(tmp_path / "toolchain"))
    order: list[str] = []
    monkeypatch.setattr(isa_probe, "children_may_trust_flags", lambda: order.append("isa") or {})
    built = threading.Event()

    def build(settings, directory):  # the real build runs in tests/integration
        order.append("headers")
        (Path(directory) / "k.h.gch").write_bytes(b"gpch")
        precompiled_headers.record(directory, ["k.h.gch"])
        built.set()

    monkeypatch.setattr(toolchain, "build_headers", build)
    toolchain.start_in_background(WorkerSettings())
    assert built.wait(30) and _wait_for_headers()
    assert order == ["isa", "headers"]  # the header's flags follow the ISA children pick
    env = sandbox.child_environment(sandbox.WORK_DIR, sandbox.LIB_DIR)
    assert (
        env["TORCHINDUCTOR_VEC_ISA_OK"] == env["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] == "1"
    )


def test_a_restarted_worker_binds_the_kept_headers_without_building(tmp_path, monkeypatch):
    for name in ("TORCHFARM_PRECOMPILED_HEADERS_DIR", "TORCHFARM_ISA_PROBE_MARKER"):
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("TORCHFARM_TOOLCHAIN_CACHE", str(tmp_path / "toolchain"))
    probes: list[str] = []
    checks = {"c" * 64: True}  # the probe's build checks, carried to the children
    monkeypatch.setattr(
        isa_probe, "children_may_trust_flags", lambda: probes.append("isa") or checks
    )
    builds: list[str] = []

    def build(settings, directory):
        builds.append(directory)
        (Path(directory) / "k.h.gch").write_bytes(b"gpch")
        precompiled_headers.record(directory, ["k.h.gch"])

    monkeypatch.setattr(toolchain, "build_headers", build)
    toolchain.start_in_background(WorkerSettings())
    assert _wait_for_headers()
    kept = os.environ["TORCHFARM_PRECOMPILED_HEADERS_DIR"]
    assert os.path.dirname(kept) == str(tmp_path / "toolchain")
    assert not os.path.exists(builds[0])  # built aside, then moved into place whole
    assert probes == ["isa"]
    monkeypatch.setenv("TORCHFARM_ISA_PROBE_MARKER", "")
    toolchain.start_in_background(WorkerSettings())  # the next worker of this toolchain
    # vouched at once, before its canary's child starts: the kept agreement, no probe
    assert isa_verdict.child_environment() == isa_probe.TRUST_FLAGS_ENV
    assert isa_verdict.child_arguments() == ["--isa-checks", json.dumps(checks)]
    time.sleep(1)
    assert len(builds) == 1 and os.environ["TORCHFARM_PRECOMPILED_HEADERS_DIR"] == kept
    assert probes == ["isa"]
    assert sorted(os.listdir(tmp_path / "toolchain")) == [
        os.path.basename(kept),
        os.path.basename(kept) + toolchain.ISA_VERDICT_SUFFIX,
    ]


def test_a_disagreeing_probe_is_not_kept(tmp_path, monkeypatch):
    for name in ("TORCHFARM_PRECOMPILED_HEADERS_DIR", "TORCHFARM_ISA_PROBE_MARKER"):
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("TORCHFARM_TOOLCHAIN_CACHE", str(tmp_path / "toolchain"))
    probed = threading.Event()
    monkeypatch.setattr(isa_probe, "children_may_trust_flags", lambda: probed.set() or None)
    monkeypatch.setattr(toolchain, "build_headers", lambda settings, directory: None)
    toolchain.start_in_background(WorkerSettings())
    assert probed.wait(30)
    time.sleep(0.5)
    assert isa_verdict.child_environment() == {}  # children keep probing for themselves
    assert not [n for n in os.listdir(tmp_path / "toolchain") if n.endswith(".vec-isa-ok")]
