"""The farm end to end: real redis-server, Celery worker, gRPC gateway and Inductor.

Tolerances: float32 outputs and gradients must match eager within 1e-4 absolute (Inductor
may reorder reductions; PyTorch's own benchmarks accept far more for float32).
"""

import concurrent.futures
import dataclasses
import socket
import warnings

import grpc
import pytest
import torch
from torch._inductor.compile_fx import compile_fx

import torchfarm
from tests.integration.helpers import TOKENS, direct_request, past_gateway_memory, run_client
from tests.models import build
from torchfarm.client import backend, records, remote
from torchfarm.compiler.target import local_target
from torchfarm.contract import shape_guards
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc
from torchfarm.settings import ClientSettings

pytestmark = pytest.mark.integration
ATOL = 1e-4


def _farm_compile(model, farm, tenant="alice", **kwargs):
    return torchfarm.compile(model, addr=farm.addr, token=TOKENS[tenant], **kwargs)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_outputs_and_gradients_match_eager(farm, name, train):
    model, x = build(name)
    model.train(train)
    compiled = _farm_compile(model, farm)
    if train:
        expected = model(x)
        expected.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        out = compiled(x)
        out.sum().backward()
        for p, g in zip(model.parameters(), grads):
            torch.testing.assert_close(p.grad, g, atol=ATOL, rtol=1e-4)
    else:
        with torch.no_grad():
            expected, out = model(x), compiled(x)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=1e-4)
    assert [r.source for r in backend.history] and all(
        r.source in ("miss", "hit", "merged") for r in backend.history
    )


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_modes_go_through_the_farm(farm, mode):
    # On CPU, reduce-overhead exercises the client's CUDA-graph post-compile path (Inductor
    # declines it for CPU code); the GPU script runs it with real CUDA graphs.
    model, x = build("mlp")
    with torch.no_grad():
        out = _farm_compile(model, farm, mode=mode)(x)
        torch.testing.assert_close(out, model(x), atol=ATOL, rtol=1e-4)
    assert [r.source for r in backend.history] == ["miss"]


def test_fresh_process_hits_without_compiling_and_tenants_share(farm, store, compiler_log):
    compiles_before = store.counters.farm().get("compiles", 0)
    first = run_client(farm, "model_client.py", "transformer96", "train", tenant="alice")
    assert first["sources"] == ["miss"]
    bindir, log = compiler_log
    second = run_client(
        farm, "model_client.py", "transformer96", "train", tenant="bob", path_prefix=bindir
    )
    assert second["sources"] == ["hit"]  # another tenant, the same artifact
    assert store.counters.farm().get("compiles", 0) == compiles_before + 1
    assert second["local_inductor_compiles"] == 0
    calls = log.read_text().splitlines() if log.exists() else []
    assert not [c for c in calls if ".cpp" in c or " -c " in c or " -o " in c], calls
    for result in (first, second):
        assert result["out_err"] < ATOL and result["grad_err"] < ATOL


def test_every_graph_of_a_program_with_a_graph_break_goes_to_the_farm(farm):
    def program(x):
        y = torch.sin(x) * 2
        torch._dynamo.graph_break()
        return torch.cos(y) + 1

    x = torch.randn(6, 6)
    out = _farm_compile(program, farm)(x)
    torch.testing.assert_close(out, program(x))
    assert len(backend.history) == 2
    assert all(r.source in ("miss", "hit", "merged") for r in backend.history)


def test_dynamic_shapes_guards_force_recompile_outside_them(farm):
    # With grad enabled, Inductor's C++ codegen guards the batch at <= 4096 (no_grad code
    # has no such guard). The farm returns that guard and the client installs it, so a
    # larger batch recompiles instead of running code built for <= 4096.
    model, _ = build("mlp")
    compiled = _farm_compile(model, farm, dynamic=True)
    for batch in (8, 16, 100):
        x = torch.randn(batch, 32)
        torch.testing.assert_close(compiled(x), model(x), atol=ATOL, rtol=1e-4)
    assert len(backend.history) == 1  # one dynamic graph served every batch size
    x = torch.randn(5000, 32)
    torch.testing.assert_close(compiled(x), model(x), atol=ATOL, rtol=1e-4)
    # Both artifacts come from the farm; the second one's code, not the first one's, runs
    # (both sit under one Inductor FX key, which loading looks up without its guards).
    assert [r.source in ("hit", "miss") for r in backend.history] == [True, True]


def test_one_key_serves_every_batch_size_its_guards_allow(farm, store):
    # Fresh processes trace the same dynamic graph at different batch sizes: one key (the
    # payload has no size hints), one entry per guard set, chosen by the client.
    first, other, large = (run_client(farm, "dynamic_client.py", str(b)) for b in (8, 16, 5000))
    assert first["sources"] == ["miss"] and other["sources"] == ["hit"]
    assert large["sources"] == ["miss"]
    assert first["keys"] == other["keys"] == large["keys"]
    entries = store.artifacts.entries(first["keys"][0])
    guards = sorted(shape_guards.describe(e.guards) for e in entries)
    assert len(guards) == 2 and all(guards), guards  # <= 4096 and >= 4097, say
    assert max(r["out_err"] for r in (first, other, large)) < 1e-4


def test_a_lifted_float_is_one_key_whatever_its_value(farm, store):
    # A float that changed between calls is a graph input (a 0-d tensor read with .item());
    # its value travels beside the payload, as size hints do, and the compiled code reads it
    # at run time: a fresh process with another value hits, and both equal eager.
    compiles_before = store.counters.farm().get("compiles", 0)
    first, other = (run_client(farm, "float_client.py", v) for v in ("2.5", "-0.75"))
    assert first["sources"] == ["miss", "miss"] and other["sources"] == ["hit", "hit"]
    assert first["keys"] == other["keys"]
    assert first["graphs"] == other["graphs"] == 2  # the constant 1.0, then the lifted float
    assert store.counters.farm().get("compiles", 0) == compiles_before + 2
    assert max(r["out_err"] for r in (first, other)) < ATOL


ALICE = ClientSettings(addr="", token=TOKENS["alice"])


def test_eight_concurrent_identical_requests_compile_once(farm, store):
    request = direct_request(
        torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.SiLU()), torch.randn(5, 24)
    )
    settings = dataclasses.replace(ALICE, addr=farm.addr)
    before = store.counters.farm().get("compiles", 0)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: remote.fetch(request, settings), range(8)))
    assert store.counters.farm().get("compiles", 0) == before + 1
    assert len({header.digest for header, _ in results}) == 1
    sources = sorted(header.source for header, _ in results)
    assert sources.count("miss") == 1 and set(sources) <= {"miss", "merged", "hit"}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_farm_down_compiles_locally_with_one_warning():
    def program(x):
        y = torch.relu(x) + 1
        torch._dynamo.graph_break()
        return y * 3

    compiled = torchfarm.compile(program, addr=f"127.0.0.1:{_closed_port()}")
    records._warned.clear()
    x = torch.randn(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(x)
    torch.testing.assert_close(out, program(x))
    farm_warnings = [w for w in caught if "torchfarm" in str(w.message)]
    assert len(farm_warnings) == 1, [str(w.message) for w in farm_warnings]
    assert "unreachable" in str(farm_warnings[0].message)
    assert [r.source for r in backend.history] == ["local", "local"]


def _call(farm, request, token=TOKENS["alice"]):
    with grpc.insecure_channel(farm.addr) as channel:
        metadata = [("authorization", f"Bearer {token}")] if token else []
        return list(pb_grpc.FarmStub(channel).Compile(request, metadata=metadata, timeout=30))


@pytest.mark.parametrize(
    "token,status",
    [(None, grpc.StatusCode.UNAUTHENTICATED), ("wrong", grpc.StatusCode.UNAUTHENTICATED)],
)
def test_gateway_refuses_unknown_tokens(farm, token, status):
    request = pb.CompileRequest(graph=b"x", target=local_target(), options=pb.Options())
    with pytest.raises(grpc.RpcError) as e:
        _call(farm, request, token=token)
    assert e.value.code() == status


def test_gateway_refuses_bad_requests_precisely(farm):
    target = local_target()
    cases = [
        (pb.CompileRequest(graph=b"", target=target), grpc.StatusCode.INVALID_ARGUMENT),
        (
            pb.CompileRequest(graph=b"x", target=target, options=pb.Options(mode="turbo")),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            pb.CompileRequest(
                graph=b"x", target=target, options=pb.Options(config_patches_json="{not json")
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            pb.CompileRequest(graph=b"x", target=pb.Target(device="tpu", torch_version="1")),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            pb.CompileRequest(graph=b"x", target=target, size_hints={"__import__('os')": 1}),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            pb.CompileRequest(graph=b"x", target=target, float_hints={"zf1": float("nan")}),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            pb.CompileRequest(graph=b"x", target=target, digest="../../etc/passwd"),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            pb.CompileRequest(
                graph=b"x",
                target=target,
                options=pb.Options(state=pb.TraceState(autocast=["cuda:int3"])),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ]
    unknown = pb.Target()
    unknown.CopyFrom(target)
    unknown.cpu_capability = "NEON"
    cases.append(
        (pb.CompileRequest(graph=b"x", target=unknown), grpc.StatusCode.FAILED_PRECONDITION)
    )
    for request, status in cases:
        with pytest.raises(grpc.RpcError) as e:
            _call(farm, request)
        assert e.value.code() == status, (request, e.value.details())
    assert "Pools available" in e.value.details()


def test_hostile_payload_fails_cleanly_and_farm_keeps_serving(farm):
    request = pb.CompileRequest(graph=b"\x80\x04not a pickle at all", target=local_target())
    with pytest.raises(grpc.RpcError) as e:
        _call(farm, request)
    assert e.value.code() == grpc.StatusCode.ABORTED
    model, x = build("mlp", seed=7)
    with torch.no_grad():
        torch.testing.assert_close(_farm_compile(model, farm)(x), model(x), atol=ATOL, rtol=1e-4)


def test_corrupt_blob_is_dropped_and_rebuilt(farm, store):
    request = direct_request(
        torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.Tanh()), torch.randn(3, 12)
    )
    settings = dataclasses.replace(ALICE, addr=farm.addr)
    header, data = remote.fetch(request, settings)
    stored = bytearray(store.artifacts.blobs.get(header.digest, 1 << 30))  # the farm's blob store
    stored[len(stored) // 2] ^= 0xFF
    store.artifacts.blobs.put(header.digest, bytes(stored))
    compiles = store.counters.farm().get("compiles", 0)
    past_gateway_memory()
    header2, data2 = remote.fetch(request, settings)
    assert header2.source == "miss" and data2  # detected, never served, rebuilt
    assert store.counters.farm().get("compiles", 0) == compiles + 1


def test_a_graph_without_tensor_inputs_compiles_on_the_farm(farm):
    # sizes in, a new tensor out: what transformers' position-id graphs look like
    def positions(n: int):
        return torch.arange(n) * 2 + 1

    compiled = _farm_compile(positions, farm, dynamic=True)
    assert torch.equal(compiled(7), positions(7))
    assert [r.source for r in backend.history] == ["miss"], backend.history


@torch.library.custom_op("torchfarm_test::double", mutates_args=())
def _double(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return x * 2


@_double.register_fake
def _(x, counts):
    return torch.empty_like(x)


def _double_backward(ctx, grad):
    for _ in ctx.counts.tolist():  # data-dependent, like transformers 5.17's MoE backward
        pass
    return grad * 2, None


def _double_setup(ctx, inputs, output):
    ctx.counts = inputs[1]


_double.register_autograd(_double_backward, setup_context=_double_setup)


def test_a_graph_inductor_cannot_trace_is_split_by_dynamo_as_for_local_torch_compile(farm, store):
    # The op's backward reads a tensor's values, so tracing it with fake tensors fails; local
    # torch.compile then runs the frame eagerly and compiles the functions it calls. Through
    # the farm (whose worker lacks the op), those must go to the farm the same way, and the
    # farm remembers the failure (TORCHFARM_FAILURE_MEMORY) instead of compiling it again.
    def before(x):
        return torch.sin(x) * 2

    def after(y):
        return torch.cos(y).sum()

    def program(x, counts):
        return after(torch.ops.torchfarm_test.double(before(x), counts))

    def gradient(compiled):
        x = torch.linspace(-1, 1, 12, requires_grad=True)
        compiled(x, torch.tensor([4, 8])).backward()
        return x.grad

    local_graphs = []

    def counting_inductor(gm, example_inputs):
        compiled = compile_fx(gm, example_inputs)
        local_graphs.append(len(gm.graph.nodes))
        return compiled

    expected = gradient(program)
    torch._dynamo.reset()
    torch.testing.assert_close(
        gradient(torch.compile(program, backend=counting_inductor)), expected
    )
    torch._dynamo.reset()
    backend.history.clear()
    torch.testing.assert_close(gradient(_farm_compile(program, farm)), expected)
    sources = [r.source for r in backend.history]
    assert sources[0] == "split" and "DataDependentOutputException" in backend.history[0].why
    assert sources[1:] == ["miss"] * len(local_graphs) and len(local_graphs) >= 2, sources

    failures = sum(s.get("compile_failures", 0) for s in store.counters.per_pool().values())
    torch._dynamo.reset()
    backend.history.clear()
    torch.testing.assert_close(gradient(_farm_compile(program, farm)), expected)
    assert [r.source for r in backend.history] == ["split"] + ["hit"] * len(local_graphs)
    assert "not retried" in backend.history[0].why
    assert sum(s.get("compile_failures", 0) for s in store.counters.per_pool().values()) == failures
