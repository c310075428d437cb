"""The pool's kernel builds as background work (issue 53): idle priority for a build and the
threads it starts, at most TORCHFARM_KERNEL_BUILDS at once, none while a compile runs. No
process starts here: the builds are a stand-in builder's (a real builder child's priorities:
tests/integration/workers/test_idle_builds.py)."""

import errno
import os
import threading

import pytest

from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import WorkerSettings
from torchfarm.workers import idle_priority, kernel_builder, kernel_cache
from torchfarm.workers.slots import Slots


def in_a_thread(body):
    """What `body` returns, run in a thread of its own: a thread's scheduler policy and I/O
    class are its own (and its children's), so this process keeps its."""
    result = []
    thread = threading.Thread(target=lambda: result.append(body()))
    thread.start()
    thread.join()
    return result[0]


def test_a_builds_thread_and_the_threads_it_starts_run_at_sched_idle():
    def idle_then_start() -> tuple[int, int]:
        idle_priority.idle_cpu()
        return os.sched_getscheduler(0), in_a_thread(lambda: os.sched_getscheduler(0))

    assert in_a_thread(idle_then_start) == (os.SCHED_IDLE, os.SCHED_IDLE)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_the_session_goes_to_nice_19_and_io_to_the_idle_class(monkeypatch, tmp_path):
    """Written to a stand-in of /proc/self/autogroup: the real one is the whole test
    session's (the builder's own, in tests/integration/workers/test_idle_builds.py)."""
    autogroup = tmp_path / "autogroup"
    monkeypatch.setattr(idle_priority, "_AUTOGROUP", str(autogroup))
    classes: list[int] = []
    monkeypatch.setattr(idle_priority, "_set_io_class", classes.append)
    assert idle_priority.idle_session() == []
    assert autogroup.read_text() == "19" and classes == [3]  # IOPRIO_CLASS_IDLE


def test_what_the_host_does_not_permit_is_named_and_skipped(monkeypatch, tmp_path):
    monkeypatch.setattr(idle_priority, "_AUTOGROUP", str(tmp_path))  # a directory: EISDIR

    def refused(io_class: int) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(idle_priority, "_set_io_class", refused)
    skipped = idle_priority.idle_session()
    assert skipped[0] == "idle I/O priority: Operation not permitted"
    assert skipped[1].startswith("autogroup nice 19: ") and len(skipped) == 2
    monkeypatch.setattr(idle_priority, "_AUTOGROUP", str(tmp_path / "none"))  # no autogroups
    assert idle_priority.idle_session() == ["idle I/O priority: Operation not permitted"]


def test_the_autogroup_is_written_again_while_another_write_holds_it(monkeypatch, tmp_path):
    """The kernel takes an autogroup's nice at most every 100 ms host-wide (EAGAIN)."""
    attempts = []
    real_open = open

    def busy_twice(path, mode="r"):
        attempts.append(path)
        if len(attempts) <= 2:
            raise BlockingIOError(errno.EAGAIN, "busy")
        return real_open(path, mode)

    monkeypatch.setattr(idle_priority, "_AUTOGROUP", str(tmp_path / "autogroup"))
    monkeypatch.setattr(idle_priority, "open", busy_twice, raising=False)
    monkeypatch.setattr(idle_priority.time, "sleep", lambda s: None)
    idle_priority._set_autogroup_nice(19)
    assert len(attempts) == 3 and (tmp_path / "autogroup").read_text() == "19"


class StandInBuilder:
    """A builder child's stand-in: records each build, builds nothing."""

    built: list[str] = []

    def __init__(self, settings: WorkerSettings) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def build(self, source: pb.KernelBuild) -> pb.KernelFiles:
        StandInBuilder.built.append(source.cpp.main_code)
        return pb.KernelFiles()


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    StandInBuilder.built = []
    monkeypatch.setattr(kernel_builder, "_Builder", StandInBuilder)
    cache = kernel_cache.KernelCache(str(tmp_path), "toolchain", 1 << 20)
    return cache, cache.pool_dir("pool")


def test_builds_run_on_at_most_kernel_builds_threads(stand_in):
    before = {t.name for t in threading.enumerate()}
    kernel_builder.PoolBuilds(stand_in[0], WorkerSettings(kernel_builds=3), lambda: None)
    started = {t.name for t in threading.enumerate()} - before
    assert sorted(started) == ["kernel-builds-0", "kernel-builds-1", "kernel-builds-2"]
    assert WorkerSettings().kernel_builds == max(1, (os.cpu_count() or 1) // 4)


def test_no_build_starts_before_compiles_are_done(stand_in):
    cache, pool_dir = stand_in
    waiting, compiles_end = threading.Event(), threading.Event()

    def compiles_done() -> None:
        waiting.set()
        compiles_end.wait()

    builds = kernel_builder.PoolBuilds(cache, WorkerSettings(kernel_builds=1), compiles_done)
    kept = threading.Semaphore(0)
    source = pb.KernelBuild(cpp=pb.KernelSource(main_code="one"))
    assert builds.offer(pool_dir, [source], lambda *_: kept.release()) == 1
    assert waiting.wait(timeout=60)
    assert StandInBuilder.built == []
    compiles_end.set()
    assert kept.acquire(timeout=60)
    assert StandInBuilder.built == ["one"]


def test_slots_wait_until_no_compile_runs():
    slots, taken, release = Slots(), threading.Event(), threading.Event()

    def compile_() -> None:
        with slots.taken():
            taken.set()
            release.wait()

    threading.Thread(target=compile_).start()
    assert taken.wait(timeout=60)
    waiter = threading.Thread(target=slots.wait_until_none_run)
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive()  # a compile runs
    release.set()
    waiter.join(timeout=60)
    assert not waiter.is_alive()
    slots.wait_until_none_run()  # none runs: at once
