"""Idle priority: how the pool's kernel builds (workers/kernel_builder.py) take only CPU and disk
time that nothing else on the host wants, the compiler processes a build starts included (each
of these settings is inherited on fork).

- CPU: SCHED_IDLE, below every nice level (`idle_cpu`).
- The session: its autogroup at nice 19 (`idle_session`). Where the kernel has autogroups
  (/proc/sys/kernel/sched_autogroup_enabled, on in most distributions), CPU time is first
  shared between sessions, then within each; the builder runs in a session of its own (its
  sandbox's --new-session, Popen's start_new_session), so it had as much of the CPU as the
  user's whole session, whatever its nice level or policy. Measured on the 2-core dev box, both
  pinned to one core: a busy loop in the user's session got half as much of it as a SCHED_IDLE
  (or nice 10) loop in another session; with that session at nice 19, the other loop got 1%.
- I/O: the IDLE class (ioprio_set(2), through its syscall: Python has no wrapper).
Best effort: what the host does not permit is skipped and named, for the caller to log.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import time

# ioprio_set(2): IOPRIO_WHO_PROCESS, its syscall number, the class in the top bits
_WHO_PROCESS, _CLASS_SHIFT, _CLASS_NONE, _CLASS_IDLE = 1, 13, 0, 3
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}.get(platform.machine())
_AUTOGROUP = "/proc/self/autogroup"
_LOWEST = 19  # nice
_AUTOGROUP_TRIES = 50  # its nice is written at most every 100 ms host-wide (EAGAIN), 20 ms apart


def idle_cpu() -> None:
    """This process at SCHED_IDLE: it runs only where no other wants the core. An unprivileged
    process cannot leave it (RLIMIT_NICE), so a process that must (a GEMM measurement) never
    enters it."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def idle_session() -> list[str]:
    """This process's I/O at the IDLE class and its session's autogroup at nice 19; what was
    not permitted, each as `what: why`."""
    skipped = []
    try:
        _set_io_class(_CLASS_IDLE)
    except OSError as e:
        skipped.append(f"idle I/O priority: {e.strerror or e}")
    try:
        _set_autogroup_nice(_LOWEST)
    except FileNotFoundError:
        pass  # no autogroups: sessions are not weighed against each other
    except OSError as e:
        skipped.append(f"autogroup nice {_LOWEST}: {e.strerror or e}")
    return skipped


def normal_session() -> None:
    """Out of `idle_session`'s: a session of its own (whose autogroup is at nice 0) and the
    default I/O class (where it could be set), as the compiles have."""
    os.setsid()
    with contextlib.suppress(OSError):
        _set_io_class(_CLASS_NONE)


def _set_io_class(io_class: int) -> None:
    if _IOPRIO_SET is None:
        raise OSError(errno.ENOSYS, f"ioprio_set: unknown on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_IOPRIO_SET, _WHO_PROCESS, 0, io_class << _CLASS_SHIFT) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _set_autogroup_nice(nice: int) -> None:
    for _ in range(_AUTOGROUP_TRIES):
        try:
            with open(_AUTOGROUP, "w") as f:
                f.write(str(nice))
            return
        except BlockingIOError:  # another process's write within the last 100 ms
            time.sleep(0.02)
    raise OSError(errno.EAGAIN, "autogroup busy")
