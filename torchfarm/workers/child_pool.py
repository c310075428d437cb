"""Compile children started ahead of need, so that a compile does not wait for one to warm up.

A child costs seconds before it can compile (torch imported, on CUDA a context made and
Triton's stubs built); a compile request then costs only the hand-off. Each child still
serves exactly one request and exits (compile_child.py): warming is done with nothing of a
tenant's, so isolation is as strong as starting one per request.

The pool keeps `size` children warm and starts a replacement as soon as one is taken. A child
that dies while it waits, or takes longer than `warm_up_timeout_s` to get ready, is killed and
replaced, after a growing pause while they keep failing (a broken toolchain must not spin).
`take` never waits for the pool: with no child ready it takes one still warming, or starts
one, and the caller's own timeout bounds the rest.

With `reuse` (CPU pools), what the pool keeps warm is *parents* (`compile_child
--fork-server`): each warms up once in its sandbox, and `take` hands out a child forked from
one that is idle; when that child has ended and the parent has made its sandbox clean again,
the parent goes back to the pool (if `reuse(private_dir)` could clear what the worker put in
its private dir for that request), else it is ended. The pool keeps `size` parents, idle or
busy, and starts one more only for a request that finds none idle. That one is kept too: under
steady overlap the next request finds it idle instead of starting another (~5 s). A request
takes the parent idle the shortest, so one the pool no longer needs idles on; past
SURPLUS_IDLE_S, while the pool holds more than `size`, it is ended.

This module knows processes and the `ready` report only; what a child runs and in which
sandbox is the caller's `command` (workers/sandbox.py).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO

from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.workers.compile_child import END, FORK, FRAME, KILL

log = logging.getLogger("torchfarm.worker")

ERROR_TAIL_BYTES = 2048  # how much of a child's stderr is kept for the error text
_READY_FRAME = 16  # a `ready` report is 2 bytes; anything longer is not one
_BACKOFF_S = (0.5, 60.0)  # pause before the next start after a failed warm-up: first, most
_CHECK_EVERY_S = 0.5  # how often the keeper looks for children that died or hang
_KILL_GRACE_S = 30.0  # a forked child not ended this long after KILL: its parent is killed
SURPLUS_IDLE_S = 60.0  # a parent over the pool's size idle this long is ended (370 MB each)

# argv, environment and working directory of a child, given the number of the child (from 0)
# and an empty private host directory of its own (removed when it ends).
Command = Callable[[int, str], tuple[list[str], dict[str, str], str]]


@dataclasses.dataclass(frozen=True)
class Events:
    """What the pool tells its owner (metrics): how many children are ready now, each child
    it replaced, with why ("died" or "hung"), and each child taken for a request, in which
    state ("ready"; "warming" or "started": the pool had run dry)."""

    ready: Callable[[int], None] = lambda count: None
    replaced: Callable[[str], None] = lambda reason: None
    taken: Callable[[str], None] = lambda state: None


class Child:
    """One started compile child: its process, its stderr's tail, and whether it is ready."""

    proc: subprocess.Popen | _Forked

    def __init__(self, number: int, command: Command) -> None:
        self.started = self.idle_since = time.monotonic()
        self.private_dir = tempfile.mkdtemp(prefix="torchfarm-compile-")
        try:
            argv, env, cwd = command(number, self.private_dir)
            self.proc = self._popen(argv, env, cwd)
        except BaseException:
            shutil.rmtree(self.private_dir, ignore_errors=True)
            raise
        self._watch()

    def _popen(self, argv: list[str], env: dict[str, str], cwd: str) -> subprocess.Popen:
        return subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    def _watch(self) -> None:
        self.stderr: collections.deque[bytes] = collections.deque()
        self.is_ready = False
        self.settled = threading.Event()  # set when it reported ready, or will never
        self._threads = [
            threading.Thread(target=self._await_ready, daemon=True, name="child-warm-up"),
            threading.Thread(target=_tail, args=(self.proc.stderr, self.stderr), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def stdin(self) -> IO[bytes]:
        assert self.proc.stdin
        return self.proc.stdin

    @property
    def stdout(self) -> IO[bytes]:
        assert self.proc.stdout
        return self.proc.stdout

    def _await_ready(self) -> None:
        """Read the child's first report, which must be `ready`; anything else ends it."""
        try:
            head = self.stdout.read(FRAME.size)
            if len(head) == FRAME.size and FRAME.unpack(head)[0] <= _READY_FRAME:
                data = self.stdout.read(FRAME.unpack(head)[0])
                report = pb.CompileChildReport.FromString(data)  # protobuf parse: no code runs
                self.is_ready = report.WhichOneof("report") == "ready" and report.ready
        except Exception:  # a malformed first report: not ready
            pass
        finally:
            if not self.is_ready:
                self.kill()
            self.settled.set()

    def wait_ready(self) -> bool:
        """Block until the child is ready (True) or has ended without (False)."""
        self.settled.wait()
        return self.is_ready

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass

    def close(self) -> int:
        """Wait for it to end (kill it first to not wait), release its pipes and directory;
        its exit status."""
        returncode = self._release()
        shutil.rmtree(self.private_dir, ignore_errors=True)
        return returncode

    def _release(self) -> int:
        try:
            if self.proc.stdin:  # a child still waiting for its request reads the end, exits
                self.proc.stdin.close()
        except OSError:
            pass
        returncode = self.proc.wait()
        for thread in self._threads:
            thread.join(timeout=5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()
        return returncode

    def error_text(self) -> str:
        return b"".join(self.stderr)[-ERROR_TAIL_BYTES:].decode(errors="replace")


class WarmParent(Child):
    """A fork server (compile_child.py): a Child whose one `ready` says it is warm, and which
    then forks a child per request, one at a time; its stdin is the control socket."""

    def _popen(self, argv: list[str], env: dict[str, str], cwd: str) -> subprocess.Popen:
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            return subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=theirs.fileno(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        except BaseException:
            self.control.close()
            raise
        finally:
            theirs.close()

    def fork(self, done: Callable[[WarmParent, bool], None]) -> ForkedChild:
        """A child forked for one request; `done(self, cleanly)` once it has ended and been
        closed (`cleanly`: this parent reported its end, so its sandbox is clean again)."""
        return ForkedChild(self, done)

    def ended(self) -> int | None:
        """Block until this parent reports its current child's end: the exit status; None
        where the parent itself ended (killed, or its sandbox could not be made clean)."""
        assert self.proc.stdout is not None
        data = self.proc.stdout.read(END.size)
        return END.unpack(data)[0] if len(data) == END.size else None

    def send(self, message: bytes, fds: tuple[int, ...] = ()) -> None:
        socket.send_fds(self.control, [message], list(fds))

    def close(self) -> int:
        self.control.close()  # an idle parent reads the end and exits
        return super().close()


class _Forked:
    """The part of a Popen that the worker uses, for a child that a WarmParent forked."""

    pid: int  # the parent's (the host's pid of its sandbox)

    def __init__(self, parent: WarmParent) -> None:
        self.parent, self.pid = parent, parent.proc.pid
        self.returncode: int | None = None
        self.cleanly = False  # the parent reported the end (its sandbox is clean again)
        self.given_back = False  # from then on a kill must not reach the parent's next child
        self._lock = threading.Lock()
        self._sending = threading.Lock()
        ours: list[int] = []
        theirs: list[int] = []
        try:
            for _ in range(3):  # stdin, stdout, stderr
                read_end, write_end = os.pipe()
                ours.append(write_end if not theirs else read_end)
                theirs.append(read_end if not theirs else write_end)
            parent.send(FORK, tuple(theirs))
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        self.stdin: IO[bytes] | None = os.fdopen(ours[0], "wb")
        self.stdout: IO[bytes] | None = os.fdopen(ours[1], "rb")
        self.stderr: IO[bytes] | None = os.fdopen(ours[2], "rb")

    def wait(self) -> int:
        with self._lock:
            if self.returncode is None:
                status = self.parent.ended()
                self.cleanly = status is not None
                if status is None:  # the parent is gone, and its sandbox with it
                    self.parent.kill()
                    status = self.parent.proc.wait() or -9
                self.returncode = status
            return self.returncode

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        """Ask the parent to kill the child; kill the parent (and its sandbox) if it cannot
        be asked, or has not reported the end _KILL_GRACE_S later."""
        with self._sending:
            if self.given_back:  # a late kill (a timer, the abandon check): ended already
                return
            try:
                self.parent.send(KILL)
            except OSError:
                self.parent.kill()
                return
        timer = threading.Timer(_KILL_GRACE_S, self._unless_ended)
        timer.daemon = True
        timer.start()

    def _unless_ended(self) -> None:
        if self._lock.acquire(blocking=False):  # a waiter holds it until the end is reported
            try:
                if self.returncode is None:
                    self.parent.kill()
            finally:
                self._lock.release()
        elif self.returncode is None:
            self.parent.kill()


class ForkedChild(Child):
    """A child forked by a WarmParent for one request: the same pipes and reports as a
    started one; closing it gives the parent back (`done`)."""

    proc: _Forked

    def __init__(self, parent: WarmParent, done: Callable[[WarmParent, bool], None]) -> None:
        self.started = time.monotonic()
        self.parent, self._done = parent, done
        self.private_dir = parent.private_dir  # the parent's (its staging dir among it)
        self.proc = _Forked(parent)
        self._watch()

    def close(self) -> int:
        try:
            returncode = self._release()
        except BaseException:
            self._give_back(False)
            raise
        self._give_back(self.proc.cleanly)
        return returncode

    def error_text(self) -> str:
        """Its own error text; where its parent ended instead of reporting its end (a warm-up
        that failed, a sandbox that could not be cleaned), the parent's after it."""
        text = super().error_text()
        if self.proc.returncode is not None and not self.proc.cleanly:
            for thread in self.parent._threads:  # its stderr drained to the end
                thread.join(timeout=5)
            text = (text + self.parent.error_text())[-ERROR_TAIL_BYTES:]
        return text

    def _give_back(self, cleanly: bool) -> None:
        with self.proc._sending:
            self.proc.given_back = True
        self._done(self.parent, cleanly)


def _tail(stream: IO[bytes], keep: collections.deque) -> None:
    """Drain `stream`, keeping only its last ERROR_TAIL_BYTES in `keep`."""
    size = 0
    for chunk in iter(lambda: stream.read(4096), b""):
        keep.append(chunk)
        size += len(chunk)
        while size - len(keep[0]) >= ERROR_TAIL_BYTES:
            size -= len(keep.popleft())


class ChildPool:
    """Up to `size` idle children, kept warm by a background keeper thread."""

    def __init__(
        self,
        size: int,
        command: Command,
        warm_up_timeout_s: float,
        events: Events = Events(),
        reuse: Callable[[str], bool] | None = None,
    ) -> None:
        self.size, self.warm_up_timeout_s = size, warm_up_timeout_s
        self._command, self._events, self._reuse = command, events, reuse
        self._idle: list[Child] = []  # oldest first
        self._busy = 0  # parents whose forked child serves a request (with `reuse`)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._started = 0  # children started so far (numbers them)
        self._failures = 0  # warm-ups failed in a row
        self._next_start = 0.0  # monotonic time before which the keeper starts none
        self._keeper = threading.Thread(target=self._keep, daemon=True, name="child-pool")
        self._keeper.start()

    def take(self) -> Child:
        """A child for one request: the ready one idle the shortest if any, else the one
        warming longest, else a new one (with `reuse`: forked from such a parent). Never waits
        for the pool; the caller owns (and must close) the child."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the compile child pool is closed")
            self._reap()
            live = [c for c in self._idle if c.alive()]
            chosen = next((c for c in reversed(live) if c.is_ready), live[0] if live else None)
            if chosen:
                self._idle.remove(chosen)
                self._report_ready()
            if self._reuse:
                self._busy += 1
        self._events.taken("started" if not chosen else "ready" if chosen.is_ready else "warming")
        if not self._reuse:
            self._wake.set()  # start its replacement now
            return chosen or self._start()
        try:
            parent = chosen or self._start()
            assert isinstance(parent, WarmParent)
            try:
                return parent.fork(self._give_back)
            except OSError:  # it died since: a new one
                parent.kill()
                parent.close()
                parent = self._start()
                assert isinstance(parent, WarmParent)
                return parent.fork(self._give_back)
        except BaseException:
            with self._lock:
                self._busy -= 1
            raise

    def _give_back(self, parent: WarmParent, cleanly: bool) -> None:
        """A parent whose child has ended: idle again if its sandbox and private dir are
        clean again, else ended. One over the pool's size too: `_end_surplus` ends it
        later if it stays idle."""
        assert self._reuse is not None
        keep = cleanly and parent.alive() and self._reuse(parent.private_dir)
        with self._lock:
            self._busy -= 1
            keep = keep and not self._closed
            if keep:
                parent.idle_since = time.monotonic()
                self._idle.append(parent)
                self._report_ready()
        if not keep:
            parent.kill()
            parent.close()
        self._wake.set()

    def idle(self) -> list[Child]:
        """The children waiting now (a copy)."""
        with self._lock:
            return list(self._idle)

    def close(self) -> None:
        """Stop warming and kill every idle child."""
        with self._lock:
            self._closed = True
            children, self._idle = self._idle, []
        self._wake.set()
        for child in children:
            child.kill()
            child.close()
        self._keeper.join(timeout=10)

    def _start(self) -> Child:
        with self._lock:
            number, self._started = self._started, self._started + 1
        return (WarmParent if self._reuse else Child)(number, self._command)

    def _keep(self) -> None:
        while True:
            self._wake.wait(timeout=_CHECK_EVERY_S)
            self._wake.clear()
            with self._lock:
                if self._closed:
                    return
                self._reap()
                self._end_surplus()
                kept = len(self._idle) + self._busy  # a busy parent comes back
                wanted = kept < self.size and time.monotonic() >= self._next_start
            if wanted:
                try:
                    child = self._start()
                except OSError as e:  # cannot even start one: count it as a failed warm-up
                    log.warning("cannot start a compile child: %s", e)
                    with self._lock:
                        self._failed()
                    continue
                threading.Thread(target=self._on_settled, args=(child,), daemon=True).start()
                with self._lock:
                    closed = self._closed
                    if not closed:
                        self._idle.append(child)
                if closed:
                    child.kill()
                    child.close()
                    return
                self._wake.set()  # more may be missing

    def _on_settled(self, child: Child) -> None:
        """Wake the keeper when a child gets ready or fails its warm-up."""
        if child.wait_ready():
            with self._lock:
                self._failures, self._next_start = 0, 0.0
                self._report_ready()
        self._wake.set()

    def _reap(self) -> None:
        """Drop idle children that died or hang in their warm-up (lock held)."""
        now = time.monotonic()
        for child in list(self._idle):
            if not child.alive() or (child.settled.is_set() and not child.is_ready):
                reason = "died"
            elif not child.settled.is_set() and now - child.started > self.warm_up_timeout_s:
                reason = "hung"
                child.kill()
            else:
                continue
            self._idle.remove(child)
            threading.Thread(target=child.close, daemon=True).start()
            log.warning(
                "compile child %s %s: replacing it; its error text:\n%s",
                "hung in its warm-up" if reason == "hung" else "died while idle",
                f"pid {child.proc.pid}",
                child.error_text()[-1000:],
            )
            self._events.replaced(reason)
            self._failed()
        self._report_ready()

    def _end_surplus(self) -> None:
        """End the children idle longest past SURPLUS_IDLE_S while the pool holds more than
        its size (lock held)."""
        now = time.monotonic()
        while len(self._idle) + self._busy > self.size:
            oldest = min(self._idle, key=lambda c: c.idle_since, default=None)
            if oldest is None or now - oldest.idle_since < SURPLUS_IDLE_S:
                return
            self._idle.remove(oldest)
            oldest.kill()
            threading.Thread(target=oldest.close, daemon=True).start()
            self._report_ready()

    def _failed(self) -> None:
        """One more failure in a row: pause before the next start, longer each time."""
        self._failures += 1
        pause = min(_BACKOFF_S[1], _BACKOFF_S[0] * 2 ** (self._failures - 1))
        self._next_start = time.monotonic() + pause

    def _report_ready(self) -> None:
        self._events.ready(sum(1 for c in self._idle if c.is_ready and c.alive()))
