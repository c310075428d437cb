"""Fresh client processes without paying torch's import in each: forks of a warm parent.

The tier starts about a hundred client processes (helpers.run_client), and each new
interpreter spent ~4.7 CPU-s importing torch, Dynamo and Inductor before its first line, on
a 2-core CI machine whose wall time is its CPU-seconds over two. This parent imports those
once (and nothing of torchfarm); each client is a fork of it that then runs as
`python SCRIPT ARGS` would: its own environment, argv, working dir, stdout and stderr (files),
script as __main__, and the interpreter's normal exit (atexit handlers, non-daemon threads).
Nothing has traced or compiled before the fork, so to Dynamo, Inductor and the farm each is a
fresh process with empty caches, as before.

What torch reads from the environment when it loads, the parent read from the tier's: a call
whose environment differs from the parent's in anything but TORCHFARM_* and what torch reads
only when it compiles (`PER_CLIENT`) gets a new interpreter instead (`fits`: OMP_NUM_THREADS,
say), as does a call while the parent serves another.

Protocol (the parent's stdin and stdout, one JSON line each): a request {"argv", "env",
"cwd", "stdout", "stderr"}; the answers {"pid": N} once forked, {"rc": N} once it ended.
"""

from __future__ import annotations

import atexit
import functools
import gc
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time

PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "grpc")
# What torch reads only when it runs (the cache dirs; PATH, for the C++ compiler; the user's
# cache home, where torchfarm keeps programs) and pytest's name of the test running now.
PER_CLIENT = (
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "PATH",
    "XDG_CACHE_HOME",
    "PYTEST_CURRENT_TEST",
)


def fits(env: dict[str, str], parent_env: dict[str, str]) -> bool:
    """Whether a client with `env` may be a fork of a parent started with `parent_env`."""
    differ = {k for k in env.keys() | parent_env.keys() if env.get(k) != parent_env.get(k)}
    return all(k.startswith("TORCHFARM_") or k in PER_CLIENT for k in differ)


def _answer(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())  # fd 1 unbuffered: a fork inherits no
    # pending bytes of it


def _become_client(request: dict) -> None:
    """In the fork: take the request's process state, then run its script as __main__."""
    os.setsid()  # its own group, which a timeout kills whole
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    runpy.run_path(sys.argv[0], run_name="__main__")


def serve() -> None:
    for module in PRELOAD:
        __import__(module)
    # What the imports made, out of the collector's sight (CPython's advice for processes that
    # fork without exec): a fork's collections, and the interpreter's exit, then do not walk
    # and copy-on-write its pages: ~1 CPU-s a client less, its exit included.
    gc.freeze()
    _answer({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _become_client(request)
            return  # the script ended: the interpreter exits as a fresh one would, status 0
        _answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _answer({"rc": os.waitstatus_to_exitcode(status)})


class WarmParent:
    """The caller's side: one parent per test process, started at its first client."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.busy = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
            bufsize=0,  # unbuffered: select() sees every answer the pipe holds
        )
        atexit.register(self.close)
        if self._read(time.monotonic() + 120) != {"ready": True}:
            raise RuntimeError("the warm parent did not start")

    def run(
        self, argv: list[str], env: dict[str, str], stdout: str, stderr: str, timeout: float
    ) -> int | None:
        """The client's exit status; None where it must be a new interpreter instead."""
        if self.proc.poll() is not None or not fits(env, self.env):
            return None
        if not self.busy.acquire(blocking=False):
            return None
        try:
            request = {
                "argv": argv,
                "env": env,
                "cwd": os.getcwd(),
                "stdout": stdout,
                "stderr": stderr,
            }
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            deadline = time.monotonic() + timeout
            pid = self._read(deadline)["pid"]
            try:
                return self._read(deadline)["rc"]
            except TimeoutError:
                os.killpg(pid, signal.SIGKILL)
                self._read(time.monotonic() + 60)
                raise subprocess.TimeoutExpired(argv, timeout) from None
        finally:
            self.busy.release()

    def _read(self, deadline: float) -> dict:
        line = b""
        while not line.endswith(b"\n"):
            left = max(0.0, deadline - time.monotonic())
            if not select.select([self.proc.stdout], [], [], left)[0]:
                raise TimeoutError
            byte = self.proc.stdout.read(1)
            if not byte:
                raise RuntimeError("the warm parent exited")
            line += byte
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()  # it ends at the end of its input
        self.proc.wait(timeout=30)


@functools.cache
def _warm_parent() -> WarmParent | None:
    """This process's warm parent, started once; None where it could not start."""
    try:
        return WarmParent()
    except (OSError, RuntimeError, TimeoutError):
        return None


def run(
    argv: list[str], env: dict[str, str], stdout: str, stderr: str, timeout: float
) -> int | None:
    """Run `python ARGV` as a fork of this process's warm parent; None where it can't."""
    parent = _warm_parent()
    return parent.run(argv, env, stdout, stderr, timeout) if parent else None


if __name__ == "__main__":
    serve()
