"""A compile child that hangs, allocates without bound or crashes, on a farm of its own with
short limits: each gets a precise error, and the farm then serves an honest compile. A compile
whose only client left is stopped long before its timeout."""

import pickle
import threading
import time

import grpc
import pytest
import torch

import torchfarm
from tests.integration.test_attacks import _Exploit
from torchfarm.client import backend
from torchfarm.compiler.target import local_target
from torchfarm.local_farm import LocalFarm
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def limited_farm():
    # 45 s: short for the hanging child, and room for an honest compile on a loaded CI machine
    # (20 s was once too little for Linear + Mish there)
    with LocalFarm(
        extra_env={"TORCHFARM_COMPILE_TIMEOUT_WORKER": "45", "TORCHFARM_COMPILE_MEMORY_MB": "16384"}
    ) as farm:
        yield farm


def _attack(farm, code: str) -> grpc.RpcError:
    request = pb.CompileRequest(graph=pickle.dumps(_Exploit(code)), target=local_target())
    with grpc.insecure_channel(farm.addr) as channel, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.FarmStub(channel).Compile(request, timeout=300))
    return e.value


@pytest.mark.parametrize(
    "name,code,status,says",
    [
        (
            "hangs",
            "import time\ntime.sleep(3600)",
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "compile exceeded 45 s",
        ),
        # 1 GiB mappings, never touched: the address-space limit stops them, not the host's RAM
        (
            "allocates without bound",
            "import mmap\nchunks = []\nwhile True:\n    chunks.append(mmap.mmap(-1, 1 << 30))",
            grpc.StatusCode.ABORTED,
            "Cannot allocate memory",
        ),
        (
            "crashes",
            "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)",
            grpc.StatusCode.ABORTED,
            "signal 11",
        ),
    ],
)
def test_a_bad_compile_child_gets_a_precise_error(limited_farm, name, code, status, says):
    error = _attack(limited_farm, code)
    assert error.code() == status, error.details()
    assert says in error.details()


def test_the_farm_still_compiles_after_the_bad_children(limited_farm):
    model = torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Mish())
    compiled = torchfarm.compile(model, addr=limited_farm.addr)
    x = torch.randn(3, 5)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert [r.source for r in backend.history] == ["miss"], [r.why for r in backend.history]


def test_a_running_compile_whose_client_left_is_stopped(limited_farm):
    """Issue 27, finding 5: the compile went on (holding a slot) until its timeout after its
    only waiter left. Now it is stopped within seconds of the waiters' expiry."""
    store = limited_farm.store()
    before = store.counters.farm().get("abandoned", 0)
    request = pb.CompileRequest(
        graph=pickle.dumps(_Exploit("import time\ntime.sleep(3600)")), target=local_target()
    )
    channel = grpc.insecure_channel(limited_farm.addr)
    call = pb_grpc.FarmStub(channel).Compile(request, timeout=300)
    events = []
    reader = threading.Thread(target=_read, args=(call, events), daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while not any(e.progress.stage == pb.Progress.COMPILING for e in events):
        assert time.monotonic() < deadline, "the compile never started"
        time.sleep(0.2)
    call.cancel()  # the client goes away while its child sleeps
    left = time.monotonic()
    while store.counters.farm().get("abandoned", 0) == before:
        # waiters expire after 10 s, then two checks 5 s apart: well under the 45 s timeout
        assert time.monotonic() - left < 35, "the abandoned compile ran on"
        time.sleep(0.5)
    channel.close()


def _read(call, events: list) -> None:
    try:
        for event in call:
            events.append(event)
    except grpc.RpcError:  # cancelled
        return
