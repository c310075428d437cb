"""Processes forked from a warm, untouched state: how a sandboxed process that imported torch
and Inductor once serves each request (a compile, a kernel build) as a fresh process would.

The warm process never runs a request itself: it `seal`s itself (not dumpable), and for each
request it forks a process from its untouched state, waits for it, then makes its sandbox as
it was before that request (`as_if_new`): every other process ended, the writable directories
emptied, /dev and the IPC namespace as at the start. So a request's process finds nothing of
an earlier one's, and no process of an earlier request is left to reach into it or into the
warm process that forks the next one. Used by the compile children's fork server
(compile_child.py) and the pool's kernel builder (kernel_builder.py); the argument is in
docs/reliability.md, "Warm parents".
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import NoReturn

PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4  # prctl(2)
IPC_RMID = 0
_SYSV = {"shm": "shmctl", "sem": "semctl", "msg": "msgctl"}  # /proc/sysvipc/X: libc's remover
_END_TRIES = 500  # SIGKILL rounds (10 ms apart) before a sandbox that keeps forking is given up


def _prctl(option: int, value: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def die_with_parent() -> None:
    """This process gets SIGKILL when the one that forked it ends (sandboxed or not)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class WarmState:
    """The warm process's side: seal it, fork requests from it, restore its sandbox after each.
    `in_sandbox`: it runs in its own PID, IPC and mount namespaces (bwrap), whose every other
    process and writable mount belong to requests; without one only a request's own process
    group is ended (`--sandbox none`: trusted clients only)."""

    def __init__(self, in_sandbox: bool) -> None:
        # Each request forks this process while torch's idle threads exist: Python's warning
        # of that would fill every request's error text.
        warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
        # Not dumpable: no process a request starts, though of the same uid, can trace this
        # one, open its /proc/<pid>/mem or fds, and so reach into later requests.
        _prctl(PR_SET_DUMPABLE, 0)
        self.in_sandbox = in_sandbox
        self.dev = _dev_entries() if in_sandbox else {}

    def as_if_new(self, group: int = 0) -> None:
        """What a fresh process would find: every process a request left ended (in the
        sandbox all but its init and this one; else the process group `group`), the work dir
        (Inductor's cache dir, $HOME and $TMPDIR) empty, and in the sandbox /dev/shm empty,
        /dev as at the start and no System V IPC object left. RuntimeError where that cannot
        be had: the caller then ends, and its sandbox with it."""
        if self.in_sandbox:
            _end_all_others()
        elif group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        for directory in (os.environ["TMPDIR"], *(["/dev/shm"] if self.in_sandbox else [])):
            _empty(directory)
        if self.in_sandbox:
            _restore_dev(self.dev)
            _remove_sysv_ipc()


def fork(body: Callable[[], int]) -> int:
    """Run `body` in a process forked from this one (`run_and_exit`); its pid."""
    _flush()  # nothing buffered here is printed twice
    pid = os.fork()
    if pid:
        return pid
    run_and_exit(body)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def run_and_exit(body: Callable[[], int]) -> NoReturn:
    """Run `body`, then end this process at once, its exit status what `body` returns (1
    where it raised, with the traceback on stderr): not the interpreter's teardown (its
    modules, Inductor's compile workers, a CUDA context; ~1.4 s after a compile), which a
    process that waits for this one's end would wait for."""
    status = 1
    try:
        status = body()
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        _flush()
        os._exit(status)


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has ended: it writes nothing more)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _end_all_others() -> None:
    """SIGKILL every process of the PID namespace but its init (bwrap, pid 1) and this one,
    until none runs: kill(-1) reaches them all at once, including ones forked meanwhile."""
    me = os.getpid()
    for _ in range(_END_TRIES):
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):  # this process's own children
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        if not any(_running(p) for p in _pids() if p not in (1, me)):
            return
        time.sleep(0.01)
    raise RuntimeError("processes of a request outlived SIGKILL")


def _empty(directory: str) -> None:
    for entry in os.listdir(directory):
        path = os.path.join(directory, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)  # read-only binds below stay
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _dev_entries() -> dict[str, str]:
    """bwrap's /dev (a tmpfs a request can write): each entry, with its link target."""
    return {
        name: os.readlink(f"/dev/{name}") if os.path.islink(f"/dev/{name}") else ""
        for name in os.listdir("/dev")
    }


def _restore_dev(entries: dict[str, str]) -> None:
    for name in set(os.listdir("/dev")) - set(entries):
        path = f"/dev/{name}"
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    if _dev_entries() != entries:  # a link replaced, a device node removed: not restorable
        raise RuntimeError("a request changed bwrap's /dev")


def _remove_sysv_ipc() -> None:
    """System V shared memory, semaphores and message queues outlive their processes (the
    sandbox's IPC namespace holds them): removed."""
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, remover in _SYSV.items():
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                ids = [int(line.split()[1]) for line in f.readlines()[1:] if line.strip()]
        except OSError:
            continue
        for ipc_id in ids:
            if kind == "sem":
                status = libc.semctl(ipc_id, 0, IPC_RMID)
            else:
                status = getattr(libc, remover)(ipc_id, IPC_RMID, None)
            if status != 0:
                raise RuntimeError(f"cannot remove System V {kind} {ipc_id}")
