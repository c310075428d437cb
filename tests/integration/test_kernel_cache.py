"""A tenant's kernel cache on the real session farm (workers/kernel_cache.py): a private
compile reuses the C++ objects the tenant's earlier private compiles built; a hostile payload
can plant objects under the names of another graph's kernels in its own tenant's cache only,
and neither another tenant's compile nor a shared entry ever loads them."""

import glob
import json
import os
import pickle

import grpc
import pytest
import torch

import torchfarm
from tests.integration.helpers import TOKENS, direct_request
from torchfarm.client import backend
from torchfarm.compiler.target import local_target
from torchfarm.contract.pools import pool_name
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration
PLANTED = b"PLANTED by another tenant's compile"


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


def _kernel_log(farm) -> list[str]:
    """The worker's `kernel cache: N objects reused, M kept` lines, oldest first."""
    lines = []
    for path in sorted(glob.glob(os.path.join(farm.log_dir, "*.log"))):
        with open(path, errors="replace") as f:
            for line in f:
                if "kernel cache:" in line:
                    lines.append(json.loads(line)["message"])
    return lines


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
    before = len(_kernel_log(farm))
    kept = _objects(_tenant_dir(farm, "bob"))
    assert kept  # A's objects are bob's now
    sources, error = _run(b, x, "bob", True, monkeypatch, farm)
    assert sources == ["miss"] and error < 1e-4
    reused = int(_kernel_log(farm)[before].split()[2])
    assert reused > 0, _kernel_log(farm)[before]


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
files = kernel_cache.report(cache, "")
assert files.built, "no kernel to plant"
for name in files.built:
    files.built[name] = {PLANTED!r}
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
    """A private compile child of `tenant` counts the files it can read under the worker's
    kernel root (a host path) and in its own staging dir, and the planted ones among them."""
    code = f"""
import json, os
seen = {{}}
for top in ({os.path.join(farm.workdir, "kernels")!r}, "/run/kernels"):
    files = [os.path.join(w, n) for w, _, names in os.walk(top) for n in names]
    seen[top] = [len(files), sum(open(f, "rb").read() == {PLANTED!r} for f in files)]
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

    # Sent shared, its report is ignored: shared jobs neither read nor fill a kernel cache.
    assert _send(farm, hostile, "alice", private=False)[-1].WhichOneof("event") == "chunk"
    assert PLANTED not in _objects(_tenant_dir(farm, "alice")).values()

    # Sent private, the planted objects land in alice's own cache, under the victim's names.
    assert _send(farm, hostile, "alice", private=True)[-1].WhichOneof("event") == "chunk"
    planted = [n for n, data in _objects(_tenant_dir(farm, "alice")).items() if data == PLANTED]
    assert planted

    # They are live for alice herself (her private compile of the victim loads them and
    # fails, so her client compiles locally): the names are the ones the victim's compile uses.
    sources, error = _run(victim, x, "alice", True, monkeypatch, farm)
    assert sources == ["local"] and error < 1e-4

    # bob's compile of the same graph: his own cache, where nothing of alice's is staged.
    sources, error = _run(victim, x, "bob", True, monkeypatch, farm)
    assert sources == ["miss"] and error < 1e-4
    assert PLANTED not in _objects(_tenant_dir(farm, "bob")).values()
    # and what bob's child can read: his own objects, staged; nothing of the host's root
    seen = _what_a_child_sees(farm, "bob")
    root = os.path.join(farm.workdir, "kernels")
    assert seen == {root: [0, 0], "/run/kernels": [len(_objects(_tenant_dir(farm, "bob"))), 0]}

    # alice's shared compile of it: the entry every tenant may hit is built without her cache.
    sources, error = _run(victim, x, "alice", False, monkeypatch, farm)
    assert sources == ["miss"] and error < 1e-4
