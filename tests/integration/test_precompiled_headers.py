"""Inductor's precompiled C++ header, built once as a worker builds it and used read-only by
compile children whose /tmp is far too small to build the ~150 MB header themselves: a child
that did not get it, or got one of another key, would fail with "No space left on device"."""

import dataclasses
import json
import os
import pickle

import pytest
import torch

from tests.integration.helpers import run_client, wait_for_precompiled_headers
from tests.integration.test_attacks import _Exploit
from tests.models import build
from torchfarm.compiler import serialize
from torchfarm.compiler.inductor import load_artifact
from torchfarm.compiler.target import local_target
from torchfarm.local_farm import LocalFarm
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import WorkerSettings
from torchfarm.torch_adapter.worker import precompiled_headers
from torchfarm.workers import kernel_builder, sandbox, toolchain

pytestmark = pytest.mark.integration
SETTINGS = WorkerSettings(compile_disk_mb=64)


@pytest.fixture(scope="module")
def headers(tmp_path_factory):
    """The headers built into a worker-owned directory, as the worker does at start."""
    directory = str(tmp_path_factory.mktemp("precompiled-headers"))
    saved = dict(os.environ)
    precompiled_headers.set_store(directory)
    try:
        toolchain.build_headers(SETTINGS, directory)
        yield directory
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _cnn():
    """The CNN's inference graph, its real inputs and its eager outputs."""
    model, x = build("cnn")
    captured = {}

    def capture(gm, example_inputs):
        captured.update(graph=serialize.dumps(gm), inputs=list(example_inputs))
        captured["eager"] = gm(*example_inputs)
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=capture)(x)
    return captured


def _compile(graph: bytes, settings: WorkerSettings = SETTINGS) -> pb.Artifact:
    data = sandbox.run_compile(
        sandbox.ChildSpec(graph, local_target(), pb.Options()), settings
    ).data
    return pb.Artifact.FromString(data)


def test_a_child_sees_the_headers_read_only_and_has_them_on(headers, worker_isa_verdict):
    code = f"""
import json, os
where = {precompiled_headers.header_dir(sandbox.WORK_DIR, sandbox.CHILD_USER)!r}
found = {{"flag": os.environ.get("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS")}}
found["files"] = sorted(os.listdir(where))
try:
    open(os.path.join(where, [n for n in found["files"] if n.endswith(".gch")][0]), "ab")
    found["write"] = "written"
except OSError as e:
    found["write"] = e.strerror
raise RuntimeError("report: " + json.dumps(found))
"""
    with pytest.raises(sandbox.CompileFailed) as failed:
        _compile(pickle.dumps(_Exploit(code)))
    found = json.loads(str(failed.value).rsplit("report: ", 1)[1].strip())
    built = json.loads(open(os.path.join(headers, precompiled_headers.MANIFEST)).read())
    assert found["flag"] == "1"
    assert found["files"] == sorted(built) and any(n.endswith(".h.gch") for n in built)
    assert found["write"] == "Read-only file system"


def test_a_kernel_heavy_compile_uses_the_prebuilt_header_and_matches_eager(
    headers, worker_isa_verdict
):
    cnn = _cnn()
    artifact = _compile(cnn["graph"])
    assert len(artifact.natives) >= 2  # C++ kernels were built, each with the header
    compiled = load_artifact(artifact)
    torch.testing.assert_close(compiled(*cnn["inputs"]), cnn["eager"])


def test_a_kernel_builder_knows_each_prebuilt_header_before_its_first_build(
    headers, worker_isa_verdict
):
    # Computed once in the warm builder (kernel_builder.remember_headers): a build forked from
    # it then runs g++ on its source only, with the header bound read-only under this cap.
    with open(os.path.join(headers, precompiled_headers.MANIFEST)) as f:
        prebuilt = [n for n in json.load(f) if n.endswith(".gch")]
    code = '// at::vec:: (a kernel: the header with ISA flags)\nextern "C" int f() { return 1; }'
    source = pb.KernelSource(code_cache="CppPythonBindingsCodeCache", main_code=code)
    with kernel_builder._Builder(SETTINGS, priority="normal") as builder:
        builder.start()  # warm: what it said so far (a good build's stderr is not kept)
        told = builder._error_tail().decode()
        files = builder.build(pb.KernelBuild(cpp=source))
    assert f"kernel builder: {len(prebuilt)} precompiled headers" in told, told
    assert [n for n in files.built if n.endswith(".so")], files


def test_without_the_prebuilt_header_the_child_cannot_build_one(monkeypatch, worker_isa_verdict):
    # The control: what the child did before (headers on, nothing prebuilt) fails under this
    # cap, so the compile above can only have used the worker's header.
    monkeypatch.delenv("TORCHFARM_PRECOMPILED_HEADERS_DIR", raising=False)
    monkeypatch.setattr(
        precompiled_headers, "child_environment", lambda: {precompiled_headers.FLAG_ENV: "1"}
    )
    # A pool of its own that starts each child on demand, under this environment (the warm
    # children of the test above were started with the headers bound).
    on_demand = dataclasses.replace(SETTINGS, warm_children=0)
    with pytest.raises(sandbox.CompileFailed, match="No space left on device"):
        _compile(_cnn()["graph"], on_demand)


@pytest.fixture(scope="module")
def small_disk_farm():
    with LocalFarm(extra_env={"TORCHFARM_COMPILE_DISK_MB": str(SETTINGS.compile_disk_mb)}) as f:
        yield f


def test_a_worker_builds_the_headers_at_start_and_a_miss_uses_them(small_disk_farm):
    wait_for_precompiled_headers(small_disk_farm)
    result = run_client(small_disk_farm, "model_client.py", "cnn", "train")
    assert result["sources"] == ["miss"], result  # a failed compile would be "local"
    assert result["out_err"] < 1e-4 and result["grad_err"] < 1e-4, result
