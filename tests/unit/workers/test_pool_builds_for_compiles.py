"""The C++ libraries a shared compile asks the pool to build while it runs (issue 53): the
child's ask and its answer, the parent's answers on the child's stdin, and the pool's builders
building each source once. No process starts here: the builds are a stand-in builder's (the
whole path: tests/integration/test_kernel_cache.py)."""

import io
import os
import threading

import pytest
from google.protobuf.message import DecodeError

from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import WorkerSettings
from torchfarm.workers import compile_child, kernel_builder, kernel_cache, sandbox
from torchfarm.workers.compile_child import FRAME

OBJ = "ab/cab" + "c" * 49 + ".so"
SOURCE = pb.KernelSource(code_cache="CppCodeCache", main_code="int x;")


def _frame(message) -> bytes:
    data = message.SerializeToString()
    return FRAME.pack(len(data)) + data


def _frames(data: bytes, kind):
    """The length-prefixed messages of `kind` in `data`."""
    stream, found = io.BytesIO(data), []
    while head := stream.read(FRAME.size):
        found.append(kind.FromString(stream.read(FRAME.unpack(head)[0])))
    return found


class StandInBuilder:
    """A builder child's stand-in: each build waits for `release`, then makes OBJ."""

    built: list[str] = []
    release = threading.Event()

    def __init__(self, settings: WorkerSettings, priority: str = "") -> None:
        assert priority == "normal"  # the compile waits for it: the compiles' priority

    def start(self) -> None:
        pass

    def build(self, source: pb.KernelBuild) -> pb.KernelFiles:
        StandInBuilder.release.wait()
        StandInBuilder.built.append(source.cpp.main_code)
        if "fails" in source.cpp.main_code:
            raise RuntimeError("build exit 1")
        if "garbled" in source.cpp.main_code:  # a reply that does not parse, and the like
            raise DecodeError("Error parsing message")
        return pb.KernelFiles(built={OBJ: b"lib"})


@pytest.fixture
def builds(monkeypatch, tmp_path):
    StandInBuilder.built, StandInBuilder.release = [], threading.Event()
    monkeypatch.setattr(kernel_builder, "_Builder", StandInBuilder)
    cache = kernel_cache.KernelCache(str(tmp_path), "toolchain", 1 << 20)
    return kernel_builder.CompileBuilds(cache, WorkerSettings(), 2), cache.pool_dir("pool")


def test_a_source_asked_by_two_compiles_at_once_is_built_once(builds):
    compile_builds, pool_dir = builds
    answers: list[list[str]] = []
    asks = [
        threading.Thread(target=lambda: answers.append(compile_builds.build(pool_dir, SOURCE)))
        for _ in range(2)
    ]
    for ask in asks:
        ask.start()
    StandInBuilder.release.set()
    for ask in asks:
        ask.join(timeout=60)
    assert answers == [[OBJ], [OBJ]] and StandInBuilder.built == ["int x;"]
    with open(os.path.join(pool_dir, OBJ), "rb") as f:  # kept for every later compile
        assert f.read() == b"lib"
    assert compile_builds.build(pool_dir, SOURCE) == [OBJ]  # built before: not again
    assert StandInBuilder.built == ["int x;"]


def test_a_failed_build_answers_nothing_and_is_tried_again(builds):
    compile_builds, pool_dir = builds
    StandInBuilder.release.set()
    failing = pb.KernelSource(code_cache="CppCodeCache", main_code="fails")
    assert compile_builds.build(pool_dir, failing) == []
    assert compile_builds.build(pool_dir, failing) == []
    assert StandInBuilder.built == ["fails", "fails"]


def test_a_build_that_raises_what_no_build_should_answers_nothing_and_the_builder_serves_on(
    builds,
):
    """Its thread answers [] and takes the next source: a builder thread that died left the
    asking compile waiting for ever (and its builder slot gone)."""
    compile_builds, pool_dir = builds
    StandInBuilder.release.set()
    for garbled in ("garbled 1", "garbled 2", "garbled 3"):  # more than the 2 builders
        source = pb.KernelSource(code_cache="CppCodeCache", main_code=garbled)
        assert compile_builds.build(pool_dir, source) == []
    assert compile_builds.build(pool_dir, SOURCE) == [OBJ]


class _Stdin(io.BytesIO):
    def close(self) -> None:  # kept readable for the test
        pass


def test_the_parent_answers_each_ask_with_the_objects_it_staged(tmp_path):
    pool_dir, staging = tmp_path / "pool", tmp_path / "staging"
    (pool_dir / "ab").mkdir(parents=True)
    (pool_dir / OBJ).write_bytes(b"lib")
    staging.mkdir()
    asked, answered = [], threading.Semaphore(0)
    stdin = _Stdin()

    def pool_build(source: pb.KernelSource) -> tuple[str, list[str]]:
        asked.append(source.main_code)
        return str(pool_dir), [OBJ] if source.main_code == "int x;" else []

    child_input = sandbox._ChildInput(stdin, pool_build, str(staging))
    child_input.feed(b"the request")
    original = child_input._write

    def write(data: bytes) -> None:
        original(data)
        answered.release()

    child_input._write = write  # type: ignore[method-assign]
    child_input.ask(pb.PoolBuild(id=7, source=SOURCE))
    assert answered.acquire(timeout=60)
    child_input.ask(pb.PoolBuild(id=8, source=pb.KernelSource(main_code="not built")))
    assert answered.acquire(timeout=60)
    assert stdin.getvalue().startswith(FRAME.pack(len(b"the request")) + b"the request")
    after_request = FRAME.size + len(b"the request")
    answers = _frames(stdin.getvalue()[after_request:], pb.PoolBuilt)
    assert [(a.id, a.staged) for a in answers] == [(7, True), (8, False)]
    assert asked == ["int x;", "not built"] and child_input.staged == [OBJ]
    assert (staging / OBJ).read_bytes() == b"lib"
    child_input.close()
    child_input.ask(pb.PoolBuild(id=9, source=SOURCE))  # the child has left: no answer
    assert answered.acquire(timeout=60)
    assert len(_frames(stdin.getvalue()[after_request:], pb.PoolBuilt)) == 2
    assert child_input.staged == [OBJ]  # nothing staged for it either


def test_asks_past_the_cap_or_without_the_pools_builds_are_answered_no_at_once(tmp_path):
    stdin, release = _Stdin(), threading.Event()

    def pool_build(source: pb.KernelSource) -> tuple[str, list[str]]:
        release.wait()
        return str(tmp_path), []

    child_input = sandbox._ChildInput(stdin, pool_build, str(tmp_path))
    for ident in range(sandbox.MAX_POOL_BUILDS_ASKED + 1):
        child_input.ask(pb.PoolBuild(id=ident, source=SOURCE))
    answers = _frames(stdin.getvalue(), pb.PoolBuilt)
    assert [(a.id, a.staged) for a in answers] == [(sandbox.MAX_POOL_BUILDS_ASKED, False)]
    release.set()
    unasked = sandbox._ChildInput(_Stdin(), None, str(tmp_path))
    unasked.ask(pb.PoolBuild(id=1, source=SOURCE))
    assert [(a.id, a.staged) for a in _frames(unasked.stdin.getvalue(), pb.PoolBuilt)] == [
        (1, False)
    ]


def test_the_child_waits_for_its_answer_and_hears_no_once_stdin_ends(monkeypatch):
    reports = io.BytesIO()
    monkeypatch.setattr(compile_child, "_reports", reports)
    read_end, write_end = os.pipe()
    with os.fdopen(read_end, "rb") as answers, os.fdopen(write_end, "wb") as parent:
        ask = compile_child._PoolBuilds(answers)
        got: list[bool] = []
        child = threading.Thread(target=lambda: got.append(ask(SOURCE)))
        child.start()
        child.join(timeout=0.5)
        assert child.is_alive()  # waiting for its answer
        asked = _frames(reports.getvalue(), pb.CompileChildReport)
        assert [(r.build.id, r.build.source) for r in asked] == [(1, SOURCE)]
        parent.write(_frame(pb.PoolBuilt(id=1, staged=True)))
        parent.flush()
        child.join(timeout=60)
        assert got == [True]
        second = threading.Thread(target=lambda: got.append(ask(SOURCE)))
        second.start()
        parent.close()  # the worker is gone: every ask unanswered is a no
        second.join(timeout=60)
    assert got == [True, False] and ask(SOURCE) is False


def test_a_child_whose_ask_is_not_answered_in_time_builds_it_itself(monkeypatch):
    monkeypatch.setattr(compile_child, "_reports", io.BytesIO())
    monkeypatch.setattr(compile_child, "POOL_BUILD_WAIT_S", 0.2)
    read_end, write_end = os.pipe()
    with os.fdopen(read_end, "rb") as answers, os.fdopen(write_end, "wb"):
        assert compile_child._PoolBuilds(answers)(SOURCE) is False  # the parent says nothing
