"""The unit tier: no farm, no process of its own, no compile. Store tests get a bare
redis-server of their own, and a real three-master Redis Cluster (tests/redis_cluster.py)
where the layout matters, started once per session, and a real S3 server (SeaweedFS's
`weed`) for a module that asks for one: they are the tier's only processes.

The guard below fails any unit test (its setup, call or teardown) that starts a process:
a subprocess, a fork, a multiprocessing child, or g++, which every Inductor compile on the
CPU runs (the run's Inductor cache starts empty, tests/conftest.py). Such a test belongs to
tests/integration/, at the same path. A summary names the unit tests that took more than
SLOW_TEST_CPU_S or SLOW_TEST_WALL_S (setup and teardown included: a fixture's wait counts),
without failing them (the box is shared: a time is no verdict)."""

import _posixsubprocess
import contextlib
import gc
import os
import subprocess
import time

import pytest

from torchfarm.local_farm import LocalFarm

SLOW_TEST_CPU_S = 1.0
SLOW_TEST_WALL_S = 2.0

# Every way a Python process starts another: subprocess through its own binding of fork_exec
# (or posix_spawn), multiprocessing's spawn and forkserver through fork_exec, its fork
# through os.fork.
_SPAWNERS = [
    (subprocess, "_fork_exec"),
    (_posixsubprocess, "fork_exec"),
    (os, "fork"),
    (os, "forkpty"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (os, "system"),
]


class _ProcessGuard:
    """Armed while a test runs (pytest itself, pytest-xdist's workers among its processes,
    may start processes between tests); disarmed for the tier's own servers."""

    def __init__(self) -> None:
        self.armed = False
        self.started: list[str] = []

    @contextlib.contextmanager
    def disarmed(self):
        armed, self.armed = self.armed, False
        try:
            yield
        finally:
            self.armed = armed

    def wrap(self, module, name):
        real = getattr(module, name)

        def guarded(*args, **kwargs):
            if self.armed:
                self.started.append(f"{name}{_argv(args)}")
                raise RuntimeError("a unit test started a process (tests/unit/conftest.py)")
            return real(*args, **kwargs)

        setattr(module, name, guarded)


def _argv(args) -> str:
    """The program a spawn would have run, for the failure's message."""
    argv = args[0] if args and isinstance(args[0], (list, tuple)) else args[1:2]
    return f"({' '.join(os.fsdecode(a) for a in argv[:4])} ...)" if argv else "()"


_guard = _ProcessGuard()
for _module, _name in _SPAWNERS:
    _guard.wrap(_module, _name)


_SPENT = pytest.StashKey[list]()  # [CPU-s, wall-s] of a test's phases so far


@pytest.hookimpl(wrapper=True)
def _each_phase(item):
    """Setup, call and teardown of every test: fails the one that tried to start a process,
    and adds the phase's CPU time (all threads) and wall time to the test's."""
    _guard.armed = True
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        return (yield)
    finally:
        _guard.armed = False
        spent = item.stash.setdefault(_SPENT, [0.0, 0.0])
        spent[0] += time.process_time() - cpu
        spent[1] += time.perf_counter() - wall
        started, _guard.started[:] = list(_guard.started), []
        if started:
            pytest.fail(
                "a unit test starts no process (tests/unit/conftest.py); this one started "
                + ", ".join(started),
                pytrace=False,
            )


pytest_runtest_setup = pytest_runtest_call = _each_phase


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    """The last phase: the test's CPU and wall time go into its teardown report (as
    user_properties, which reach pytest-xdist's controller)."""
    try:
        return (yield from _each_phase(item))
    finally:
        cpu_s, wall_s = item.stash[_SPENT]
        item.user_properties += [("cpu_s", cpu_s), ("wall_s", wall_s)]


def pytest_terminal_summary(terminalreporter):
    """Names the tests over budget, without failing them: CPU time hardly moves with the
    box's load, wall time does (waits: a sleep, a timeout, a server's start or stop)."""
    slow = sorted(
        (spent.get("wall_s", 0), spent.get("cpu_s", 0), report.nodeid)
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", "") == "teardown"
        and (spent := dict(report.user_properties))
        and (spent.get("cpu_s", 0) > SLOW_TEST_CPU_S or spent.get("wall_s", 0) > SLOW_TEST_WALL_S)
    )
    if slow:
        terminalreporter.section(
            f"unit tests over {SLOW_TEST_CPU_S:g} CPU-s or {SLOW_TEST_WALL_S:g} s wall, their "
            "fixtures included (a budget to keep)"
        )
        for wall_s, cpu_s, nodeid in reversed(slow):
            terminalreporter.write_line(f"{wall_s:6.2f} s {cpu_s:6.2f} CPU-s  {nodeid}")


@pytest.fixture(scope="session", autouse=True)
def compiler_version():
    """The target descriptor asks the C++ compiler for its version once per process
    (compiler/target.py): asked here, before the first test, as the tier's one short process."""
    from torchfarm.compiler.target import local_target

    with _guard.disarmed():
        local_target()


@pytest.fixture(scope="session")
def redis_url():
    """A real redis-server (the embedded farm's, alone) on a free loopback port."""
    servers = LocalFarm()
    try:
        with _guard.disarmed():
            servers.start_redis()
        yield servers.redis_url
    finally:
        servers.stop()


@pytest.fixture(scope="session")
def redis_cluster_url():
    """TORCHFARM_REDIS_URL of a real three-master Redis Cluster on loopback ports."""
    from tests.redis_cluster import redis_cluster

    with contextlib.ExitStack() as stack:
        with _guard.disarmed():
            cluster = stack.enter_context(redis_cluster())
        yield cluster.url


@pytest.fixture(scope="module")
def s3():
    """A real S3 server (tests/s3_server.py), its settings in the environment of the module."""
    from tests.s3_server import seaweedfs

    with contextlib.ExitStack() as stack:
        with _guard.disarmed():
            server = stack.enter_context(seaweedfs())
        with pytest.MonkeyPatch.context() as env:
            for name, value in server.env.items():
                env.setenv(name, value)
            yield server


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Every object left at the end moves to the permanent generation (gc.freeze): the
    interpreter's exit then skips collecting them. Exiting with torch, Dynamo and Inductor
    loaded took 1.5-2.7 s per process (each pytest-xdist worker's, then the controller
    waits), 0.3 s frozen; reference counting still frees what it frees, atexit still runs."""
    gc.freeze()
