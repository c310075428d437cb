"""The pool's kernel builds as background work (workers/idle_priority.py, issue 53): a real
builder child in its sandbox and the C++ compiler it runs are at SCHED_IDLE, the idle I/O
class and a session at autogroup nice 19 (the default TORCHFARM_KERNEL_BUILD_PRIORITY, named
here: the tier's farms run at `normal`); a GEMM measurement leaves that for the compiles'
priority. (Threads, settings and the waits: tests/unit/workers/test_idle_builds.py.)"""

import json
import os
import platform
import subprocess
import sys
import threading
import time

import pytest

from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import WorkerSettings
from torchfarm.workers import kernel_builder

IOPRIO_GET = {"x86_64": 252, "aarch64": 31}.get(platform.machine())
pytestmark = pytest.mark.skipif(
    IOPRIO_GET is None or not os.path.exists("/proc/self/autogroup"),
    reason="a kernel with autogroups, on x86_64 or aarch64",
)
# Long enough for g++ to be seen running (a second or so).
SOURCE = """#include <regex>
#include <string>
extern "C" int torchfarm_idle_probe(const char* s) {
    return std::regex_match(std::string(s), std::regex("[a-z]+[0-9]*")) ? 1 : 0;
}"""


def priority(pid: int | str = "self") -> tuple[int, int, int]:
    """(scheduler policy, I/O class, autogroup nice) of a process."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    number = os.getpid() if pid == "self" else int(pid)
    io_class = libc.syscall(IOPRIO_GET, 1, number) >> 13
    with open(f"/proc/{pid}/autogroup") as f:
        nice = int(f.read().split()[-1])
    return os.sched_getscheduler(number), io_class, nice


def exiting(pid: int) -> bool:
    """Whether a process has begun to exit (PF_EXITING, or gone). Its I/O class then reads as
    0, the default: the kernel drops its io_context before it becomes a zombie, and a zombie
    has none. That flag is set first, so read after the priority, it names such a reading."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            flags = int(f.read().rsplit(")", 1)[1].split()[6])
    except (OSError, ValueError):
        return True
    return bool(flags & 0x4)  # PF_EXITING


def descendants(root: int) -> dict[int, str]:
    """The processes under `root` now: pid -> command name."""
    parents, names = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    head, tail = f.read().rsplit(")", 1)
            except OSError:
                continue
            parents[int(entry)], names[int(entry)] = int(tail.split()[1]), head.split("(", 1)[1]
    found, frontier = {}, {root}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier}
        found.update({p: names[p] for p in frontier})
    return found


def _priorities_seen(settings: WorkerSettings) -> dict[int, tuple[str, tuple[int, int, int]]]:
    """pid -> (name, priority) of each process under a real builder child while it builds
    SOURCE (the builder's start-up done first)."""

    def source(code: str) -> pb.KernelBuild:
        return pb.KernelBuild(cpp=pb.KernelSource(code_cache="CppCodeCache", main_code=code))

    seen: dict[int, tuple[str, tuple[int, int, int]]] = {}
    with kernel_builder._Builder(settings) as builder:
        # Warm first: the builder's start-up compiles too (Inductor's ISA checks), in the
        # builder itself.
        assert builder.build(source('extern "C" int torchfarm_warm() { return 1; }')).built
        assert builder.proc is not None
        done = threading.Event()

        def watch(root: int) -> None:
            while not done.is_set():
                for pid, name in descendants(root).items():
                    try:
                        reading = priority(pid)
                    except (OSError, ValueError):
                        continue  # ended meanwhile
                    if not exiting(pid):  # an exiting process's I/O class reads as 0
                        seen[pid] = (name, reading)  # the latest: a fork idles itself
                time.sleep(0.005)

        watcher = threading.Thread(target=watch, args=(builder.proc.pid,))
        watcher.start()
        try:
            assert builder.build(source(SOURCE)).built
        finally:
            done.set()
            watcher.join()
        assert b"kernel builder: no" not in builder._error_tail()  # all of it was permitted
    return seen


def test_a_builder_child_and_its_compiler_run_at_idle_priority():
    seen = _priorities_seen(WorkerSettings(sandbox="bwrap", kernel_build_priority="idle"))
    compilers = [p for name, p in seen.values() if name == "cc1plus"]
    assert compilers and set(compilers) == {(os.SCHED_IDLE, 3, 19)}, seen
    builders = {p for name, p in seen.values() if name.startswith("python")}
    # the warm builder of a CPU pool too (it never measures), and the build's own process
    assert builders == {(os.SCHED_IDLE, 3, 19)}, seen


def test_at_normal_priority_a_builder_and_its_compiler_run_as_compiles_do():
    """TORCHFARM_KERNEL_BUILD_PRIORITY=normal (the test farms'): SCHED_OTHER, the default
    I/O class, a session at autogroup nice 0."""
    seen = _priorities_seen(WorkerSettings(sandbox="bwrap", kernel_build_priority="normal"))
    assert any(name == "cc1plus" for name, _ in seen.values()), seen
    assert {p for _, p in seen.values()} == {(os.SCHED_OTHER, 0, 0)}, seen


GEMM_FORK = """
import json, os, subprocess, sys
from torchfarm.workers import idle_priority
idle_priority.idle_session()
read, write = os.pipe()
if os.fork() == 0:
    idle_priority.normal_session()
    out = subprocess.run([sys.executable, "-c", sys.argv[1]], capture_output=True, text=True)
    os.write(write, out.stdout.encode())
    os._exit(0)
os.close(write)
print(os.read(read, 1000).decode())
os.wait()
"""
REPORT = f"""
import ctypes, json, os
io = ctypes.CDLL(None).syscall({IOPRIO_GET or 0}, 1, 0) >> 13
with open("/proc/self/autogroup") as f:
    print(json.dumps([os.sched_getscheduler(0), io, int(f.read().split()[-1])]))
"""


def test_a_gemm_measurement_runs_at_the_compiles_priority():
    """Forked from an idle session (the builder's), it leaves it: a process it starts is at
    SCHED_OTHER, the default I/O class and nice 0."""
    out = subprocess.run(
        [sys.executable, "-c", GEMM_FORK, REPORT],
        capture_output=True,
        text=True,
        check=True,
        start_new_session=True,  # the autogroup's nice is the whole session's
    )
    assert json.loads(out.stdout) == [os.SCHED_OTHER, 0, 0]
