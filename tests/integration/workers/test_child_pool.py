"""The warm child pool's own logic, with a stand-in child that speaks the child protocol
(the real compile child and its sandbox are the integration tier's)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.workers import child_pool
from torchfarm.workers.compile_child import FRAME

# argv[1] says how the stand-in behaves: "ready" (warms up in argv[2] seconds, answers its
# request with the request's bytes as artifact), "hang" (never gets ready), "fail" (exits
# before ready).
_STAND_IN = """
import sys, time
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.workers.compile_child import FRAME
def send(report):
    data = report.SerializeToString()
    sys.stdout.buffer.write(FRAME.pack(len(data)) + data)
    sys.stdout.buffer.flush()
mode, delay = sys.argv[1], float(sys.argv[2])
if mode == "fail":
    sys.exit("toolchain broken")
time.sleep(3600 if mode == "hang" else delay)
send(pb.CompileChildReport(ready=True))
request = sys.stdin.buffer.read()
if request:
    send(pb.CompileChildReport(artifact=request))
"""


def _command(*modes: str, delay: float = 0.0, started: list | None = None):
    """Child n behaves as modes[n] (the last mode for the rest)."""

    def command(number: int, private_dir: str):
        mode = modes[min(number, len(modes) - 1)]
        if started is not None:
            started.append(number)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        return [sys.executable, "-c", _STAND_IN, mode, str(delay)], env, private_dir

    return command


class _Events:
    def __init__(self) -> None:
        self.replaced: list[str] = []
        self.taken: list[str] = []
        self.events = child_pool.Events(replaced=self.replaced.append, taken=self.taken.append)


def _until(condition, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.05)


def _ready(pool: child_pool.ChildPool) -> list[child_pool.Child]:
    return [c for c in pool.idle() if c.is_ready and c.alive()]


def _serve(child: child_pool.Child, request: bytes) -> bytes:
    """Hand `request` to `child` and read its artifact report."""
    assert child.wait_ready()
    child.stdin.write(request)
    child.stdin.close()
    for _ in range(2):
        head = child.stdout.read(FRAME.size)
        report = pb.CompileChildReport.FromString(child.stdout.read(FRAME.unpack(head)[0]))
        if report.WhichOneof("report") == "artifact":
            assert child.close() == 0
            return report.artifact
    raise AssertionError("no artifact")


@pytest.fixture
def pools():
    made: list[child_pool.ChildPool] = []

    def make(size: int, command, warm_up_timeout_s: float = 60, events=child_pool.Events()):
        made.append(child_pool.ChildPool(size, command, warm_up_timeout_s, events=events))
        return made[-1]

    yield make
    for pool in made:
        pool.close()


def test_a_ready_child_serves_one_request_and_is_replaced_at_once(pools):
    events = _Events()
    pool = pools(2, _command("ready"), events=events.events)
    _until(lambda: len(_ready(pool)) == 2)
    child = pool.take()
    assert child.is_ready and child not in pool.idle() and events.taken == ["ready"]
    assert _serve(child, b"request bytes") == b"request bytes"
    _until(lambda: len(_ready(pool)) == 2)


def test_a_child_that_dies_while_idle_is_replaced(pools):
    events = _Events()
    pool = pools(1, _command("ready"), events=events.events)
    _until(lambda: len(_ready(pool)) == 1)
    victim = pool.idle()[0]
    os.kill(victim.proc.pid, signal.SIGKILL)
    _until(lambda: len(_ready(pool)) == 1 and _ready(pool)[0] is not victim)
    assert events.replaced == ["died"]
    assert victim.proc.returncode == -signal.SIGKILL  # reaped
    assert _serve(pool.take(), b"next") == b"next"


def test_a_hanging_warm_up_is_killed_and_replaced(pools):
    events = _Events()
    # 5 s: long enough for a ready stand-in to start on a machine as busy as CI's (at 1 s, one
    # run saw its next two children counted as hung too)
    pool = pools(1, _command("hang", "ready"), warm_up_timeout_s=5, events=events.events)
    _until(lambda: len(pool.idle()) == 1)
    hung = pool.idle()[0]
    _until(lambda: len(_ready(pool)) == 1)
    assert events.replaced == ["hung"]
    _until(lambda: hung.proc.poll() is not None)  # killed, not left running
    assert _serve(pool.take(), b"after the hang") == b"after the hang"


def test_a_request_with_no_ready_child_still_gets_one(pools):
    # A pool of none (every child on demand), and a pool whose children are still warming.
    events = _Events()
    warming = pools(1, _command("ready", delay=5), events=events.events)
    _until(lambda: len(warming.idle()) == 1)
    on_demand = pools(0, _command("ready", delay=5), events=events.events)
    children = [warming.take(), on_demand.take()]
    assert not any(child.is_ready for child in children)  # taken while they warm up
    assert [_serve(child, b"served") for child in children] == [b"served"] * 2
    assert events.taken == ["warming", "started"]
    assert on_demand.idle() == []  # a pool of none keeps none


def test_warm_ups_that_keep_failing_back_off_and_requests_still_end(pools):
    started: list[int] = []
    events = _Events()
    pool = pools(1, _command("fail", started=started), events=events.events)
    _until(lambda: len(started) >= 3)
    time.sleep(2)
    # Without the pause the pool would have started dozens; with it, the pauses double.
    assert len(started) <= 6, started
    assert set(events.replaced) == {"died"}
    child = pool.take()  # does not wait for a healthy child: takes what there is
    assert not child.wait_ready()
    assert child.close() != 0 and "toolchain broken" in child.error_text()


def test_the_pool_never_holds_more_than_its_size(pools):
    pool = pools(2, _command("ready"))
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(len(pool.idle()))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(4):
            _until(lambda: len(_ready(pool)) == 2)
            _serve(pool.take(), b"x")
        _until(lambda: len(_ready(pool)) == 2)
    finally:
        stop.set()
        watcher.join()
    assert max(seen) == 2


def test_closing_the_pool_kills_its_children(pools):
    pool = pools(2, _command("ready", "hang"))
    _until(lambda: len(pool.idle()) == 2 and len(_ready(pool)) == 1)
    children = pool.idle()
    pool.close()
    assert all(c.proc.returncode is not None for c in children)
    assert all(not os.path.exists(c.private_dir) for c in children)
    with pytest.raises(RuntimeError, match="closed"):
        pool.take()


def _fork_server(number: int, private_dir: str):
    """The real compile child as a warm parent, unsandboxed (the sandboxed one is the
    integration tier's: test_attacks.py, test_sandbox.py)."""
    from torchfarm.settings import WorkerSettings
    from torchfarm.workers import sandbox

    settings = WorkerSettings(sandbox="none", concurrent_backward="0", kernel_cache_mb=0)
    return sandbox.child_command(settings, private_dir, number=number, fork_server=True)


def test_a_warm_parent_forks_one_child_per_request_and_serves_the_next(worker_isa_verdict):
    reused: list[str] = []
    events = _Events()
    pool = child_pool.ChildPool(
        1, _fork_server, 300, events=events.events, reuse=lambda d: reused.append(d) or True
    )
    try:
        _until(lambda: len(_ready(pool)) == 1, timeout_s=300)
        (parent,) = pool.idle()
        # A child that gets no request (its pipe closed) exits 0; one killed on KILL ends by
        # SIGKILL; each time the same parent comes back, and the pool started no other (a
        # parent killed while idle is replaced: test_warm_children.py, on a real farm).
        first = pool.take()
        assert isinstance(first, child_pool.ForkedChild) and first.parent is parent
        assert first.wait_ready() and pool.idle() == []
        assert first.close() == 0
        second = pool.take()
        assert second.parent is parent and second.wait_ready()
        second.kill()  # while it waits for its request: only the kill can end it
        assert second.proc.wait() == -signal.SIGKILL and second.close() == -signal.SIGKILL
        assert pool.idle() == [parent] and reused == [parent.private_dir] * 2
        assert events.taken == ["ready", "ready"] and events.replaced == []
    finally:
        pool.close()


def test_a_parent_started_for_a_request_that_found_none_idle_serves_the_next_overlap(
    monkeypatch, worker_isa_verdict
):
    """Kept after its request: the next two requests at once take both parents and start
    none. Once idle past SURPLUS_IDLE_S, the one idle longest is ended and the pool is back
    at its size."""
    pool = child_pool.ChildPool(1, _fork_server, 300, reuse=lambda d: True)
    try:
        _until(lambda: len(_ready(pool)) == 1, timeout_s=300)
        (parent,) = pool.idle()
        first = pool.take()
        second = pool.take()  # none idle: a parent of its own, one over the pool's size
        assert second.parent is not parent
        for child in (first, second):
            assert child.wait_ready() and child.close() == 0
        assert pool.idle() == [parent, second.parent]
        third, fourth = pool.take(), pool.take()
        assert {third.parent, fourth.parent} == {parent, second.parent}
        for child in (fourth, third):
            assert child.wait_ready() and child.close() == 0
        assert pool.idle() == [fourth.parent, third.parent] and pool._started == 2
        monkeypatch.setattr(child_pool, "SURPLUS_IDLE_S", 0.0)
        _until(lambda: len(pool.idle()) == 1)
        assert pool.idle() == [third.parent] and third.parent.alive()
        _until(lambda: not fourth.parent.alive())
    finally:
        pool.close()
