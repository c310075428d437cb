"""Kernel caches on a real farm, the file's own (the session farm's kind, the pool kernel cache
on; workers/kernel_cache.py, kernel_builder.py): a private compile reuses the C++ objects the
tenant's earlier private compiles built; a shared compile reuses the objects the pool built from
another tenant's shared compile. A hostile payload can plant objects under the names of another
graph's kernels in its own tenant's cache only; what it reports to the pool enters it only
through the pool's own build of a source, so neither another tenant's compile nor a shared
entry ever loads a planted object. A private max-autotune compile finds the GEMM timings its
tenant's earlier one kept and benchmarks no candidate, until `cache drop-kernels`; a shared one
finds those the pool measured for the GEMMs another tenant's compile benchmarked."""

import glob
import json
import os
import pickle

import grpc
import pytest
import torch
from typer.testing import CliRunner

import torchfarm
from tests.integration.helpers import (
    ADMIN_TOKEN,
    KERNEL_CACHE_ON,
    TOKENS,
    direct_request,
    kernel_log,
    past_gateway_memory,
    pool_builds,
    session_farm,
    wait_for_compile_builders,
    wait_for_pool_builds,
)
from torchfarm.cli import app
from torchfarm.client import backend
from torchfarm.compiler.target import local_target
from torchfarm.contract.pools import pool_name
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration
PLANTED = b"PLANTED by another tenant's compile"


@pytest.fixture(scope="module")
def farm():
    """The file's own farm, with the pool kernel cache on: the tier's other farms run without
    it (conftest), which spares them the pool's background builds after every compile."""
    with session_farm(**KERNEL_CACHE_ON) as f:
        yield f


def _tenant_dir(farm, tenant: str) -> str:
    """The worker's kernel directory for `tenant` on this machine's pool."""
    from torchfarm.workers import kernel_cache, toolchain

    root = os.path.join(farm.workdir, "kernels")
    cache = kernel_cache.KernelCache(root, toolchain.toolchain_id(), 1)
    return cache.tenant_dir(pool_name(local_target()), tenant)


def _objects(directory: str) -> dict[str, bytes]:
    found = {}
    for path in glob.glob(os.path.join(directory, "??", "*")):
        with open(path, "rb") as f:
            found[os.path.relpath(path, directory)] = f.read()
    return found


def _pool_dir(farm) -> str:
    from torchfarm.workers import kernel_cache, toolchain

    root = os.path.join(farm.workdir, "kernels")
    cache = kernel_cache.KernelCache(root, toolchain.toolchain_id(), 1)
    return cache.pool_dir(pool_name(local_target()))


def _run(model, x, tenant: str, private: bool, monkeypatch, farm):
    """Compile `model` through the farm for `tenant` in this process; (source, max error)."""
    monkeypatch.setenv("TORCHFARM_PRIVATE", "1" if private else "0")
    torch._dynamo.reset()
    backend.history.clear()
    compiled = torchfarm.compile(model, addr=farm.addr, token=TOKENS[tenant])
    with torch.no_grad():
        error = (compiled(x) - model(x)).abs().max().item()
    return [r.source for r in backend.history], error


def _block(width: int, depth: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def test_a_private_compile_reuses_the_kernels_of_the_tenants_earlier_model(farm, monkeypatch):
    torch.manual_seed(0)
    a, b = _block(24, 2), _block(24, 3)  # siblings: B is A one block deeper
    x = torch.randn(4, 24)
    assert _run(a, x, "bob", True, monkeypatch, farm)[0] == ["miss"]
    before = len(kernel_log(farm))
    kept = _objects(_tenant_dir(farm, "bob"))
    assert kept  # A's objects are bob's now
    sources, error = _run(b, x, "bob", True, monkeypatch, farm)
    assert sources == ["miss"] and error < 1e-4
    reused = int(kernel_log(farm)[before].split()[2])
    assert reused > 0, kernel_log(farm)[before]


def test_a_shared_compile_reuses_the_kernels_the_pool_built_from_another_tenants(farm, monkeypatch):
    torch.manual_seed(2)
    a, b = _block(20, 2), _block(20, 3)  # siblings, compiled shared by two tenants
    x = torch.randn(4, 20)
    counts = pool_builds(farm)
    assert _run(a, x, "alice", False, monkeypatch, farm)[0] == ["miss"]
    wait_for_pool_builds(farm, counts)  # in the background, after alice's compile ended
    assert _objects(_pool_dir(farm))
    before = len(kernel_log(farm))
    sources, error = _run(b, x, "bob", False, monkeypatch, farm)
    assert sources == ["miss"] and error < 1e-4
    reused = int(kernel_log(farm)[before].split()[2])
    assert reused > 0, kernel_log(farm)[before]


def test_a_sibling_right_after_a_shared_compile_reuses_every_object_the_pool_built_for_it(
    farm, monkeypatch
):
    """Issue 53: alice's shared compile hands its C++ builds to the pool's builders, so its
    objects are the pool's when it ends; bob's sibling, compiled at once (no pool build waited
    for), reuses them and equals eager."""
    wait_for_compile_builders(farm)
    torch.manual_seed(4)
    a, b = _block(28, 2), _block(28, 3)  # siblings, compiled shared by two tenants
    x = torch.randn(4, 28)
    before = len(kernel_log(farm))
    sources, error = _run(a, x, "alice", False, monkeypatch, farm)
    assert sources == ["miss"] and error < 1e-4
    line = kernel_log(farm)[before]
    assert int(line.split()[2]) == 0 and _built_by_the_pool(line) > 0, line
    before = len(kernel_log(farm))
    sources, error = _run(b, x, "bob", False, monkeypatch, farm)
    assert sources == ["miss"] and error < 1e-4
    line = kernel_log(farm)[before]
    assert int(line.split()[2]) > 0, line  # alice's objects, as the pool built them


def _built_by_the_pool(line: str) -> int:
    """`... N objects built by the pool for it` of a compile's kernel cache line."""
    return int(line.rsplit(", ", 1)[1].split()[0])


class _Exploit:
    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


def _plant(victim_graph: bytes) -> bytes:
    """A payload that compiles `victim_graph` honestly in its child, then reports every C++
    object of it with PLANTED bytes, and an honest artifact: a hostile child's best try."""
    code = f"""
import os
from torchfarm.compiler.inductor import compile_payload
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.workers import compile_child, kernel_cache
cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
artifact = compile_payload({victim_graph!r}, pb.Options(), {local_target().threads}, {{}})
# every object of it: built here, or (shared) linked from the pool's builds for it
files = pb.KernelFiles(built={{n: {PLANTED!r} for n in kernel_cache._names(cache)}})
assert files.built, "no kernel to plant"
compile_child.report(pb.CompileChildReport(kernels=files))
compile_child.report(pb.CompileChildReport(artifact=artifact.SerializeToString()))
os._exit(0)
"""
    return pickle.dumps(_Exploit(code))


MARKER = b"torchfarm pool build of the attacker's own source"
MARKER_SOURCE = f'extern "C" const char marker[] = "{MARKER.decode()}";'


def _plant_in_pool(victim_graph: bytes) -> bytes:
    """A payload that compiles `victim_graph` honestly in its child, then reports for the pool
    every object of it with PLANTED bytes, the victim's sources, a source of its own, and a
    source naming something other than a C++ code cache; and an honest artifact."""
    code = f"""
import os
from torchfarm.compiler.inductor import compile_payload
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.workers import compile_child, kernel_cache
cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
recorded = pb.KernelFiles()
with kernel_cache.recording(recorded):
    artifact = compile_payload({victim_graph!r}, pb.Options(), {local_target().threads}, {{}})
files = pb.KernelFiles(built={{n: {PLANTED!r} for n in kernel_cache._names(cache)}})
assert files.built and recorded.sources, "no kernel to plant"
files.sources.extend(recorded.sources)
files.sources.append(pb.KernelSource(code_cache="CppCodeCache", main_code={MARKER_SOURCE!r}))
files.sources.append(pb.KernelSource(code_cache="os.system", main_code="echo planted"))
compile_child.report(pb.CompileChildReport(kernels=files))
compile_child.report(pb.CompileChildReport(artifact=artifact.SerializeToString()))
os._exit(0)
"""
    return pickle.dumps(_Exploit(code))


def _send(farm, graph: bytes, tenant: str, private: bool) -> list:
    request = pb.CompileRequest(graph=graph, target=local_target(), private=private)
    with grpc.insecure_channel(farm.addr) as channel:
        return list(
            pb_grpc.FarmStub(channel).Compile(
                request, metadata=[("authorization", f"Bearer {TOKENS[tenant]}")], timeout=300
            )
        )


def _what_a_child_sees(farm, tenant: str) -> dict:
    """What a private compile child of `tenant` can list of the worker's kernel root (a host
    path) and of its own staging dir: a count of entries, or the error."""
    code = f"""
import json, os
seen = {{}}
for top in ({os.path.join(farm.workdir, "kernels")!r}, "/run/kernels"):
    try:
        seen[top] = len(os.listdir(top))
    except OSError as e:
        seen[top] = type(e).__name__
raise RuntimeError("report: " + json.dumps(seen))
"""
    with pytest.raises(grpc.RpcError) as e:
        _send(farm, pickle.dumps(_Exploit(f"exec({code!r}, {{}})")), tenant, private=True)
    assert "report: " in e.value.details(), e.value.details()
    return json.loads(e.value.details().rsplit("report: ", 1)[1].strip())


def test_kernels_planted_by_a_hostile_payload_reach_no_other_tenant_and_no_shared_entry(
    farm, monkeypatch
):
    torch.manual_seed(1)
    victim = torch.nn.Sequential(torch.nn.Linear(13, 29), torch.nn.LayerNorm(29), torch.nn.SiLU())
    x = torch.randn(3, 13)
    with torch.no_grad():
        graph = direct_request(victim, x).graph
    hostile = _plant(graph)

    # Sent private, the planted objects land in alice's own cache, under the victim's names.
    assert _send(farm, hostile, "alice", private=True)[-1].WhichOneof("event") == "chunk"
    planted = [n for n, data in _objects(_tenant_dir(farm, "alice")).items() if data == PLANTED]
    assert planted

    # They are live for alice herself (her private compile of the victim loads them and
    # fails, so her client compiles locally): the names are the ones the victim's compile uses.
    sources, error = _run(victim, x, "alice", True, monkeypatch, farm)
    assert sources == ["local"] and error < 1e-4

    # Sent shared, its objects are ignored: a shared job fills no tenant's cache, and the
    # pool's only from its own builds of sources (which, staged first, now shadow alice's).
    assert _send(farm, hostile, "alice", private=False)[-1].WhichOneof("event") == "chunk"
    assert PLANTED not in _objects(_pool_dir(farm)).values()

    # bob's compile of the same graph: his own cache, where nothing of alice's is staged.
    sources, error = _run(victim, x, "bob", True, monkeypatch, farm)
    assert sources == ["miss"] and error < 1e-4
    assert PLANTED not in _objects(_tenant_dir(farm, "bob")).values()
    # and what bob's child can list: nothing of the host's root, nothing of what is staged
    # for it (it finds an object by the name its own source gives)
    seen = _what_a_child_sees(farm, "bob")
    root = os.path.join(farm.workdir, "kernels")
    assert seen == {root: "FileNotFoundError", "/run/kernels": "PermissionError"}

    # alice's shared compile of it: the entry every tenant may hit is built without her cache.
    sources, error = _run(victim, x, "alice", False, monkeypatch, farm)
    assert sources == ["miss"] and error < 1e-4


def test_objects_a_hostile_payload_reports_for_the_pool_never_enter_it(farm, monkeypatch):
    torch.manual_seed(3)
    victim = torch.nn.Sequential(torch.nn.Linear(11, 23), torch.nn.LayerNorm(23), torch.nn.SiLU())
    x = torch.randn(3, 11)
    with torch.no_grad():
        graph = direct_request(victim, x).graph
    counts = pool_builds(farm)
    assert _send(farm, _plant_in_pool(graph), "alice", private=False)[-1].WhichOneof("event") == (
        "chunk"
    )
    wait_for_pool_builds(farm, counts)
    pool = _objects(_pool_dir(farm))
    # No planted byte: the pool holds what its builds made of the sources it was given,
    # the attacker's own one included, under the name that source gives (never a victim's).
    assert PLANTED not in pool.values()
    assert any(MARKER in data for data in pool.values())
    assert any("failed" in line for line in kernel_log(farm, "pool kernel build"))  # os.system

    # bob's shared compile of the victim: a miss that loads the victim's kernels as the pool
    # built them from their sources, and equals eager.
    before = len(kernel_log(farm))
    sources, error = _run(victim, x, "bob", False, monkeypatch, farm)
    assert sources == ["miss"] and error < 1e-4
    assert int(kernel_log(farm)[before].split()[2]) > 0, kernel_log(farm)[before]


class _Bmm(torch.nn.Module):
    def forward(self, a, b):
        return torch.bmm(a, b).relu()


class _BmmTanh(torch.nn.Module):
    def forward(self, a, b):
        return torch.bmm(a, b).tanh()


def _tuned(
    farm,
    mode: str,
    model: torch.nn.Module | None = None,
    tenant: str = "alice",
    private: bool = True,
    k: int = 96,
) -> tuple[str, list[int]]:
    """`tenant`'s compile of `model` (_Bmm) on a bmm (8, 64, k) x (8, k, 64) in `mode` (a
    max-autotune one): its key, and the numbers of its kernel cache line (objects reused,
    kept, tuning results reused, GEMM candidates)."""
    a, b = torch.randn(8, 64, k), torch.randn(8, k, 64)
    request = direct_request(model or _Bmm(), a, b, mode=mode)
    request.private = private
    before = len(kernel_log(farm))
    with grpc.insecure_channel(farm.addr) as channel:
        events = list(
            pb_grpc.FarmStub(channel).Compile(
                request, metadata=[("authorization", f"Bearer {TOKENS[tenant]}")], timeout=600
            )
        )
    header = next(e.header for e in events if e.WhichOneof("event") == "header")
    assert header.source == "miss"
    line = kernel_log(farm)[before]
    return header.key, [int(w) for w in line.replace("(", " ").split() if w.isdigit()][:4]


def _admin(farm, *args: str):
    result = CliRunner().invoke(
        app, ["cache", *args, "--addr", farm.addr, "--token", ADMIN_TOKEN, "--json"]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_gemm_timings_are_found_again_until_the_pools_kernels_are_dropped(farm):
    pool = pool_name(local_target())
    # On the CPU, max-autotune benchmarks a bmm's C++ template and ATen choices.
    _, (_, kept, _, benchmarked) = _tuned(farm, "max-autotune")
    assert kept > 0 and benchmarked > 0
    # The same kernels under another key: the tenant's objects and timings are found.
    key, (reused, _, _, benchmarked) = _tuned(farm, "max-autotune-no-cudagraphs")
    assert reused > 0 and benchmarked == 0
    stats = _admin(farm, "stats")["pools"][pool]
    assert stats["gemm_candidates_benchmarked"] > 0

    assert _admin(farm, "drop-kernels", "--pool", pool) == {"pool": pool, "generation": 1}
    _admin(farm, "rm", key)
    past_gateway_memory()
    # The very compile again: nothing of before the drop is staged, all is built and tuned anew.
    _, (reused, kept, _, benchmarked) = _tuned(farm, "max-autotune-no-cudagraphs")
    assert reused == 0 and kept > 0 and benchmarked > 0
    assert any(
        "kernel cache: dropped (generation 1)" in line for line in kernel_log(farm, "dropped")
    )
    with open(os.path.join(os.path.dirname(_pool_dir(farm)), "generation")) as f:
        assert f.read() == "1"


def test_a_shared_compile_finds_the_gemm_timings_the_pool_measured_for_another_tenant(farm):
    # alice's shared compile benchmarks the bmm's candidates and reports only the problem; the
    # pool measures it itself and keeps Inductor's timings.
    counts = pool_builds(farm)
    _, (_, _, _, benchmarked) = _tuned(farm, "max-autotune", private=False, k=80)
    assert benchmarked > 0
    wait_for_pool_builds(farm, counts)
    builds = kernel_log(farm, "pool kernel build")[counts[1] :]
    assert builds and all(line.startswith("pool kernel build: ") for line in builds), builds
    # bob's shared compile of another graph with that bmm: every timing is the pool's.
    _, (_, _, _, benchmarked) = _tuned(farm, "max-autotune", _BmmTanh(), "bob", False, k=80)
    assert benchmarked == 0


def test_the_pools_gemm_timings_travel_in_a_bundle_and_are_measured_again_where_imported(
    farm, tmp_path
):
    """After the test above: the pool's tuning builds leave in a bundle (no entry: a target no
    entry has), are dropped with its kernels, come back with the bundle, and the pool measures
    them again after its next compile; then another graph with that bmm benchmarks none."""
    pool = pool_name(local_target())
    bundle = str(tmp_path / "tuning.tfbundle")
    assert _admin(farm, "export", bundle, "--target", "no-such-target")["tuning_builds"] >= 1
    _admin(farm, "drop-kernels", "--pool", pool)
    assert _admin(farm, "import", bundle)["tuning_builds"] >= 1
    counts = pool_builds(farm)
    # The first compile after the drop, in default mode (it benchmarks nothing, so reports no
    # GEMM problem of its own): its job's end offers the bundle's builds to the pool's builder.
    _tuned(farm, "default", _BmmSigmoid(), "alice", False, k=80)
    wait_for_pool_builds(farm, counts)
    _, (_, _, _, benchmarked) = _tuned(farm, "max-autotune", _BmmGelu(), "bob", False, k=80)
    assert benchmarked == 0


class _BmmSigmoid(torch.nn.Module):
    def forward(self, a, b):
        return torch.bmm(a, b).sigmoid()


class _BmmGelu(torch.nn.Module):
    def forward(self, a, b):
        return torch.nn.functional.gelu(torch.bmm(a, b))
