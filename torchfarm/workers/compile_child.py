"""Entry point of the sandboxed compile child: `python -m torchfarm.workers.compile_child`.

It speaks the contract's child protocol (CompileChildRequest / CompileChildReport in
torchfarm.proto) over pipes only: one length-prefixed request on stdin (then, for a shared job
whose pool builds for its compiles, the answers to its PoolBuild reports), length-prefixed
reports on stdout.
So nothing of a tenant's compile is a file the host can see, and a crashed worker leaves
nothing behind; the one exception is the kernels a private job's child reports (C++ objects;
on GPU pools Triton entries and tuning results), which its parent checks and keeps for that
tenant's later compiles (kernel_cache.py); a shared job's
child reports the C++ sources it built, the Triton kernels it asked for and the GEMMs whose
candidates it benchmarked, which only ever reach a kernel build of the pool's
(kernel_builder.py). Everything it
reads is hostile; it runs with no network, no secrets, no capabilities and no access to the
cache.

A child is started ahead of need (workers/child_pool.py): it first warms up with nothing of a
tenant's (torch, Inductor, Triton and the operator's TORCHFARM_OP_LIBRARIES imported, on CUDA
the context made, Triton's driver stubs built and a throwaway graph compiled: warm_compile.py),
reports `ready`, and only then reads its one request. It compiles that one and exits, so no
two tenants ever share a process.

With `--concurrent-backward` it starts, first thing, a helper: the same module with
`--backward-helper`, in the same sandbox, which warms up beside it, gets the same request
and compiles the graph's backward while this process compiles the forward
(torch_adapter/compile/concurrent_backward.py). On its stdin come two frames (FRAME): the
request, then the forward's output strides (JSON) once this process has lowered its forward.
What it compiled reaches the artifact only through the Inductor cache dir the two share, as a
cache entry that this process looks up (and compiles itself where that misses); its one
report, the GEMM candidates it benchmarked and their problems, is a KernelFiles it leaves in
that dir (HELPER_REPORT), which this process adds to its own, with when its backward went
where (HELPER_TIMES, for the miss's timings). Once its backward's lowering
holds for those strides, before its code is generated and its kernels compiled, it leaves
there its backward's key (HELPER_KEY), which this process compares with its own at its
backward (`_Meeting`): equal, it waits for the helper's end and looks its backward up;
different, or no key left by a helper that exited, it ends the helper at once and compiles
the backward itself, and the artifact says which of the key's details differed
(Artifact.backward_miss, for the worker's log). Under CUDA graphs the helper sets the boxes
a forward's compile sets as a forward on one GPU sets them (concurrent_backward.py); where
this process's forward set them otherwise, the keys differ and it compiles the backward itself.

On CPU pools the pool keeps warm *parents* instead (`--fork-server`): a process in the same
sandbox that warms up once, then for each request forks a process from that untouched state,
handed the request's own three pipes over its stdin (a Unix socket, SCM_RIGHTS). That process
is a compile child as above, warm-up done: it reports `ready`, reads its one request, compiles
it and exits (its backward helper forked from it, warm too); the parent then ends every
process the request left, empties the sandbox's writable directories (warm_fork.py) and
reports the request's exit status on its stdout before it forks the next. A warm-up (~4.5
CPU-s on the 2-core box) is paid once per parent, not once per compile. On CUDA a process
cannot fork once its CUDA context exists, so GPU pools start one child per request as before.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import os
import queue
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, Any, BinaryIO, Protocol

from google.protobuf.message import DecodeError

from torchfarm.compiler import compilers
from torchfarm.contract.options import INDUCTOR, compiler_of
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import env
from torchfarm.workers import kernel_cache, warm_fork

if TYPE_CHECKING:  # it imports torch, which the worker importing this module never needs
    from torchfarm.torch_adapter.compile.concurrent_backward import Key, Strides

# Each report on the child's stdout, and each frame on its helper's stdin, is preceded by
# its length, 8 bytes big-endian.
FRAME = struct.Struct(">Q")
HELPER_REPORT = "torchfarm-helper.pb"  # the backward helper's KernelFiles, in the shared cache dir
HELPER_KEY = "torchfarm-helper-key.json"  # its backward's Key, beside it
HELPER_TIMES = "torchfarm-helper-times.json"  # when its backward went where (HelperTimes)
# A fork server's protocol. On its stdin (a Unix socket): FORK with the request's stdin,
# stdout and stderr (SCM_RIGHTS), or KILL (end the request now). On its stdout: a `ready`
# report once warm, then END (the exit status) after each request, once its sandbox is clean.
FORK, KILL = b"F", b"K"
END = struct.Struct(">i")

_reports: BinaryIO | None = None  # the real stdout; fd 1 itself then points at stderr
_reporting = threading.Lock()  # the compile's threads ask for pool builds beside its stages


def report(message: pb.CompileChildReport) -> None:
    """Send one report to the parent."""
    assert _reports is not None, "report() before main() took over stdout"
    data = message.SerializeToString()
    with _reporting:
        _reports.write(FRAME.pack(len(data)) + data)
        _reports.flush()


POOL_BUILD_WAIT_S = 120  # a C++ kernel's build takes 1-95 s on the CPU box


class _PoolBuilds:
    """CompileChildRequest.pool_builds, the child's side: each ask is a PoolBuild report,
    answered by a PoolBuilt on stdin (after the request); all unanswered asks are answered
    False once stdin ends."""

    def __init__(self, answers: BinaryIO) -> None:
        self.lock, self.asked = threading.Lock(), 0
        self.waiting: dict[int, tuple[threading.Event, list[bool]]] = {}
        self.ended = False
        reader = threading.Thread(target=self._read, args=(answers,), daemon=True)
        reader.start()

    def __call__(self, source: pb.KernelSource) -> bool:
        """Whether the pool built `source` and staged its objects, once it says."""
        with self.lock:
            if self.ended:
                return False
            self.asked += 1
            ident, answer = self.asked, (threading.Event(), [False])
            self.waiting[ident] = answer
        report(pb.CompileChildReport(build=pb.PoolBuild(id=ident, source=source)))
        # Not answered in time (the pool's builders busy, or a fault of the worker's): built
        # here, as without the pool.
        return answer[0].wait(POOL_BUILD_WAIT_S) and answer[1][0]

    def _read(self, answers: BinaryIO) -> None:
        try:
            while (data := _read_frame(answers)) is not None:
                built = pb.PoolBuilt.FromString(data)
                with self.lock:
                    event, staged = self.waiting.pop(built.id, (threading.Event(), [False]))
                staged[0] = built.staged
                event.set()
        finally:
            with self.lock:
                self.ended = True
                for event, _ in self.waiting.values():
                    event.set()


def _on_stage(stage: pb.Progress.Stage.ValueType) -> None:
    report(pb.CompileChildReport(stage=stage))


def warm_up(
    device: str, op_libraries: list[str], isa_checks: str = "", throwaway: bool = False
) -> None:
    """Everything a compile needs that no request decides, done before the request exists;
    on CUDA with `throwaway`, a compile of the farm's own small graph too (warm_compile.py)."""
    import torch

    import torchfarm.compiler.inductor  # noqa: F401
    from torchfarm.torch_adapter.compile import standalone
    from torchfarm.workers import warm_compile

    standalone.import_compiler()

    for module in op_libraries:
        importlib.import_module(module)
    if device == "cuda":
        torch.zeros(1, device="cuda")  # the CUDA context
        try:
            from triton.runtime import driver
        except ImportError:  # a CUDA build without Triton: nothing more to build
            return
        from torchfarm.torch_adapter.worker import compile_workers

        driver.active.utils  # noqa: B018  (compiles Triton's C driver stubs into its cache dir)
        if throwaway:  # before the compile workers start: none inherits its cache dirs
            warm_compile.compile_once(device)
        compile_workers.start_and_wait()  # Inductor's Triton compile workers, answering
    else:
        from torchfarm.torch_adapter.worker import isa_probe

        isa_probe.pick(isa_checks)


def _arguments(argv: list[str]) -> argparse.Namespace:
    """What to warm up for: the worker's device and TORCHFARM_OP_LIBRARIES (nothing secret)."""
    parser = argparse.ArgumentParser(prog="torchfarm.workers.compile_child")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--op-libraries", default="", help="comma-separated modules")
    parser.add_argument("--kernels", default="", help="staged C++ objects (kernel_cache.py)")
    parser.add_argument("--gpu-lock", default="", help="its GPU's (gpu_lock.py)")
    parser.add_argument("--isa-checks", default="", help="the worker's ISA probe (isa_probe.py)")
    parser.add_argument(
        "--tuning-gpus", default="", help="GPUs to benchmark candidates on (tuning_devices.py)"
    )
    parser.add_argument(
        "--compilers", default=compilers.DEFAULT, help="the pool's TORCHFARM_COMPILERS"
    )
    parser.add_argument(
        "--concurrent-backward", action="store_true", help="start a backward helper"
    )
    parser.add_argument("--backward-helper", action="store_true", help="be that helper")
    parser.add_argument(
        "--kernel-names",
        choices=env.setting("KERNEL_NAMES").choices,
        default=env.default("KERNEL_NAMES"),
        help="the pool's TORCHFARM_KERNEL_NAMES",
    )
    parser.add_argument(
        "--fork-server", action="store_true", help="fork one child per request (CPU pools)"
    )
    parser.add_argument("--in-sandbox", action="store_true", help="its own PID namespace")
    return parser.parse_args(argv)


def _warm_up(args: argparse.Namespace) -> None:
    if args.kernels and args.device == "cuda":  # before Triton or a compile worker starts
        with contextlib.suppress(ImportError):  # a CUDA build without Triton
            from torchfarm.torch_adapter.worker import triton_cache

            staged = os.path.join(args.kernels, kernel_cache.TRITON)
            os.environ.update(triton_cache.environment(staged))
    op_libraries = [m for m in args.op_libraries.split(",") if m]
    warm_up(args.device, op_libraries, args.isa_checks, throwaway=True)
    if args.gpu_lock:  # after the throwaway compile: only the request's measurements wait
        from torchfarm.workers import gpu_lock

        gpu_lock.install(args.gpu_lock)
    if args.kernel_names == "content":
        from torchfarm.torch_adapter.compile import standalone

        standalone.inductor_config.triton.unique_kernel_names = False


def _start_helper(argv: list[str]) -> subprocess.Popen:
    """The backward helper: this child's arguments, in helper mode; its output goes to this
    child's stderr (fd 2), never into the reports."""
    args = [a for a in argv if a != "--concurrent-backward"] + ["--backward-helper"]
    return subprocess.Popen(
        [sys.executable, "-m", "torchfarm.workers.compile_child", *args],
        stdin=subprocess.PIPE,
        stdout=2,
    )


class _Helper(Protocol):
    """What the child uses of its helper: a Popen, or the fork server's `_ForkedHelper`."""

    @property
    def stdin(self) -> IO[Any] | None: ...

    def poll(self) -> int | None: ...
    def wait(self) -> int: ...
    def kill(self) -> None: ...


class _ForkedHelper:
    """The backward helper of a forked child: forked from it before its request exists, so
    warm as it is; its request on a pipe, its output on the child's stderr."""

    def __init__(self, args: argparse.Namespace) -> None:
        read_end, write_end = os.pipe()

        def helper() -> int:
            os.close(write_end)
            os.dup2(read_end, 0)
            os.close(read_end)
            os.dup2(2, 1)
            return _helper_main(args, warmed=True)

        self.pid = warm_fork.fork(helper)
        os.close(read_end)
        self.stdin: IO[Any] | None = os.fdopen(write_end, "wb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def _hand_over(
    helper: _Helper | None, request: bytes, compiles: bool
) -> Callable[[Strides | None], None]:
    """Give the helper the request, and what it returns is called with the forward's output
    strides (None: no more to send). Frames are written from a thread: a helper still warming
    up reads only then, and a large request fills the pipe. A helper with nothing to do gets
    an empty pipe (a None first)."""
    if helper is None or helper.stdin is None:
        return lambda strides: None
    pipe = helper.stdin
    frames: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    frames.put(request if compiles else None)

    def write() -> None:
        try:
            while (frame := frames.get()) is not None:
                pipe.write(FRAME.pack(len(frame)) + frame)
                pipe.flush()
            pipe.close()
        except BrokenPipeError:  # the helper died: the child compiles its backward itself
            pass

    threading.Thread(target=write, name="backward-helper-request", daemon=True).start()

    def send(strides: Strides | None) -> None:
        frames.put(None if strides is None else json.dumps(strides).encode())

    return send


def _read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame of a pipe (None at its end): the child's from its worker, the helper's
    from its child."""
    head = stream.read(FRAME.size)
    if len(head) < FRAME.size:
        return None
    (size,) = FRAME.unpack(head)
    data = stream.read(size)
    return data if len(data) == size else None


def _strides(stream: BinaryIO) -> Strides | None:
    """The forward's output strides the child sent (None where it sent none)."""
    frame = _read_frame(stream)
    if frame is None:
        return None
    return [None if s is None else tuple(int(n) for n in s) for s in json.loads(frame)]


class _ForwardStrides:
    """The helper's side of the child's forward strides: read from `stream` by a thread as
    soon as they come, so that the helper's lowering sees them arrive (`arrived`)."""

    def __init__(self, stream: BinaryIO) -> None:
        self.arrived = threading.Event()
        self.strides: Strides | None = None
        threading.Thread(
            target=self._read, args=(stream,), name="forward-strides", daemon=True
        ).start()

    def _read(self, stream: BinaryIO) -> None:
        try:
            self.strides = _strides(stream)
        finally:
            self.arrived.set()

    def wait(self) -> Strides | None:
        """The strides (None where the child sent none), once they have come."""
        self.arrived.wait()
        return self.strides


def _end(helper: _Helper | None) -> None:
    if helper is not None and helper.poll() is None:
        helper.kill()
        helper.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _arguments(argv)
    if args.backward_helper:  # its child waits for its end, not for its teardown
        warm_fork.run_and_exit(lambda: _helper_main(args))
    if args.fork_server:
        return _fork_server_main(args)
    helper = _start_helper(argv) if args.concurrent_backward else None
    try:
        return _child_main(args, helper)
    finally:
        _end(helper)


def _fork_server_main(args: argparse.Namespace) -> int:
    """Warm up once, then serve each FORK in a child forked from that untouched state, one at
    a time, and make the sandbox as it was before the next (module docstring)."""
    control = socket.socket(fileno=os.dup(0))
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    ends = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the warm-up prints goes to stderr, never into the reports
    _warm_up(args)
    warm = warm_fork.WarmState(args.in_sandbox)  # sealed from here on
    data = pb.CompileChildReport(ready=True).SerializeToString()
    ends.write(FRAME.pack(len(data)) + data)
    ends.flush()
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, len(FORK), 3)
        except OSError:
            return 0
        if not message:  # the worker closed the socket: it is done with this parent
            return 0
        if message != FORK or len(fds) != 3:  # a KILL that came after its child's end
            for fd in fds:
                os.close(fd)
            continue
        parents = (control.fileno(), ends.fileno())
        pid = warm_fork.fork(functools.partial(_forked_child, args, fds, parents))
        for fd in fds:
            os.close(fd)
        status = _until_ended(pid, control)
        # Before the child is reaped: until then its pid, and so its process group's id, is
        # not reused, and ending the group ends only what the child left.
        warm.as_if_new(group=pid)  # raises where it cannot: the parent and its sandbox end
        with contextlib.suppress(ChildProcessError):  # reaped there already (in the sandbox)
            os.waitpid(pid, 0)
        ends.write(END.pack(status))
        ends.flush()


def _forked_child(args: argparse.Namespace, fds: list[int], parents: tuple[int, ...]) -> int:
    """A fork server's child: the request's pipes on 0, 1, 2, nothing of its parent's."""
    for fd in parents:  # the parent's socket and reports: never the tenant's to use
        os.close(fd)
    os.setsid()  # one process group: how its leftovers are ended without a sandbox
    warm_fork.die_with_parent()
    for number, fd in enumerate(fds):
        os.dup2(fd, number)
        os.close(fd)
    helper = _ForkedHelper(args) if args.concurrent_backward else None
    try:
        return _child_main(args, helper, warmed=True)
    finally:
        _end(helper)


def _until_ended(pid: int, control: socket.socket) -> int:
    """Wait for the forked child `pid` to end, killing it on KILL (or when the worker is
    gone); its exit status. It is left unreaped (a zombie)."""
    pidfd = os.pidfd_open(pid)
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(pidfd, selectors.EVENT_READ, "ended")
            selector.register(control, selectors.EVENT_READ, "control")
            while True:
                for key, _ in selector.select():
                    if key.data == "ended":
                        ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
                        assert ended is not None
                        code = ended.si_status
                        return code if ended.si_code == os.CLD_EXITED else -code
                    message = control.recv(16)
                    if not message:
                        selector.unregister(control)
                    if message in (KILL, b""):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(pidfd)


def _child_main(args: argparse.Namespace, helper: _Helper | None, warmed: bool = False) -> int:
    global _reports
    # Whatever the compile prints goes to stderr (the error text), never into the reports.
    _reports = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    if not warmed:
        _warm_up(args)
    report(pb.CompileChildReport(ready=True))
    data = _read_frame(sys.stdin.buffer)
    if data is None:  # the worker closed the pipe without a request: it is going away
        return 0
    request = pb.CompileChildRequest.FromString(data)
    helped = helper is not None and _helpable(request.options)
    send = _hand_over(helper, data, helped)
    with _kernel_hooks(args, request) as hooks:
        artifact = _compile(args, request, helper if helped else None, send)
    send(None)  # a helper still waiting for strides (no forward was compiled) ends
    files = hooks.report(args, request)
    if helped:  # where the graph had a backward, the helper has exited: its report is whole
        helper_files = _helper_report(hooks.cache_dir)
        files.gemm_candidates_benchmarked += helper_files.gemm_candidates_benchmarked
        if request.kernel_sources:
            files.gemm_problems.extend(helper_files.gemm_problems)
    report(pb.CompileChildReport(kernels=files))
    report(pb.CompileChildReport(artifact=artifact.SerializeToString()))
    return 0


@dataclasses.dataclass
class _KernelHooks:
    """What the kernel cache's hooks saw of one compile (kernel_cache.py), for its report."""

    cache_dir: str
    benchmarked: Any  # gemm_benchmarks.Benchmarked: the GEMM candidates it benchmarked
    recorded: pb.KernelFiles  # the sources it built, for the pool's kernel builds
    lookups: kernel_cache.TuningLookups | None = None

    def report(self, args: argparse.Namespace, request: pb.CompileChildRequest) -> pb.KernelFiles:
        from torchfarm.torch_adapter.worker import gemm_problems

        files = pb.KernelFiles()
        if args.kernels:
            files = kernel_cache.report(
                self.cache_dir,
                args.kernels,
                built=request.kernel_cache,
                triton_dir=os.environ.get("TRITON_CACHE_DIR", ""),
                lookups=self.lookups,
            )
            files.MergeFrom(self.recorded)
        files.gemm_candidates_benchmarked = self.benchmarked.candidates
        if request.kernel_sources:
            problems = gemm_problems.problems(self.benchmarked.problems, args.device)
            files.gemm_problems.extend(problems)
        return files


@contextlib.contextmanager
def _kernel_hooks(
    args: argparse.Namespace, request: pb.CompileChildRequest
) -> Iterator[_KernelHooks]:
    """While entered, the staged kernels are found (before anything of the tenant's runs),
    and what the compile builds and benchmarks is recorded."""
    from torchfarm.torch_adapter.compile import gemm_benchmarks

    with contextlib.ExitStack() as stack:
        hooks = _KernelHooks(
            cache_dir=os.environ["TORCHINDUCTOR_CACHE_DIR"],
            benchmarked=stack.enter_context(gemm_benchmarks.counted()),
            recorded=pb.KernelFiles(),
        )
        if args.kernels:
            hooks.lookups = stack.enter_context(
                kernel_cache.looking_up(args.kernels, hooks.cache_dir)
            )
        if request.kernel_sources:
            triton = args.device == "cuda"
            stack.enter_context(kernel_cache.recording(hooks.recorded, triton=triton))
        if request.pool_builds and args.kernels:
            ask = _PoolBuilds(sys.stdin.buffer)
            stack.enter_context(kernel_cache.built_by_pool(ask, args.kernels, hooks.cache_dir))
        yield hooks


def _compile(
    args: argparse.Namespace,
    request: pb.CompileChildRequest,
    helper: _Helper | None,
    send_strides: Callable[[Strides], None],
) -> pb.Artifact:
    """Compile the request with its compiler; its backward by `helper`, where given, which
    `send_strides` tells the forward's output strides."""
    for module in request.op_libraries:
        importlib.import_module(module)
    name = compiler_of(request.options)
    if request.descriptor and name != INDUCTOR:  # only Inductor's checks the descriptor
        raise ValueError(f"a graph descriptor is for Inductor's graphs, not compiler {name!r}")
    compiler = compilers.load(name, compilers.parse(args.compilers))
    context = compilers.CompileContext(
        on_stage=_on_stage, tuning_gpus=tuple(g for g in args.tuning_gpus.split(",") if g)
    )
    if helper is None:
        return compiler.compile(request, context)
    from torchfarm.torch_adapter.compile import concurrent_backward

    cache_dir = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    meeting = _Meeting(helper, cache_dir)
    started = time.monotonic()  # the helper's clock too: one host
    with concurrent_backward.backward_from(meeting, send_strides) as backward:
        artifact = compiler.compile(request, context)
    artifact.backward = backward.compiled_by
    if backward.compiled_by == "helper":
        artifact.backward_timings.CopyFrom(_helper_times(cache_dir, started))
        artifact.backward_timings.backward_at_s = backward.key_at - started
        artifact.backward_timings.backward_wait_s = backward.wait_s
        artifact.backward_timings.backward_load_s = backward.load_s
    if backward.compiled_by == "child":  # the lookup of the helper's backward missed
        helper_key = _helper_key(cache_dir)
        artifact.backward_miss = concurrent_backward.difference(helper_key, backward.key)
        if helper_key is None:
            artifact.backward_miss += f" (its exit status {helper.poll()})"
        if not meeting.waited:
            artifact.backward_miss += "; the helper was ended at its key, not waited for"
    return artifact


def _helpable(options: pb.Options) -> bool:
    """Whether a helper can compile the backward of a compile with these options: Inductor's."""
    return compiler_of(options) == INDUCTOR


class _Meeting:
    """The child, at its backward's key, and its helper's: equal, the helper's end is waited
    for (its entry then in the cache dir); different, or none left by a helper that exited, the
    helper is ended at once, its compile not waited for (`waited` False)."""

    POLL_S = 0.01

    def __init__(self, helper: _Helper, cache_dir: str) -> None:
        self.helper, self.cache_dir = helper, cache_dir
        self.waited = False

    def __call__(self, ours: Key | None) -> None:
        theirs = self._their_key()
        if ours is not None and theirs is not None and theirs.key == ours.key:
            self.helper.wait()
            self.waited = True
        else:
            _end(self.helper)

    def _their_key(self) -> Key | None:
        """The helper's key once it left it (None: it exited without)."""
        while (key := _helper_key(self.cache_dir)) is None:
            if self.helper.poll() is not None:
                return _helper_key(self.cache_dir)  # left just before it exited
            time.sleep(self.POLL_S)
        return key


def _helper_report(cache_dir: str) -> pb.KernelFiles:
    """The backward helper's report (empty where it wrote none: no backward, or it failed)."""
    try:
        return pb.KernelFiles.FromString(_left(cache_dir, HELPER_REPORT))
    except (OSError, DecodeError):
        return pb.KernelFiles()


def _helper_key(cache_dir: str) -> Key | None:
    """The key of the backward the helper compiled (None where it left none)."""
    from torchfarm.torch_adapter.compile.concurrent_backward import Key

    try:
        left = json.loads(_left(cache_dir, HELPER_KEY))
        return Key(key=str(left["key"]), lines=[str(line) for line in left["lines"]])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _helper_times(cache_dir: str, started: float) -> pb.MissTimings:
    """The helper's part of a miss's timings (helper_*_s): when its backward went where
    (HELPER_TIMES, on time.monotonic()), in seconds since `started` on that clock; unset where
    it left none, or for a part it did not reach."""
    try:
        left = json.loads(_left(cache_dir, HELPER_TIMES))
        parts = ("began", "lowered", "compiled")
        return pb.MissTimings(
            **{f"helper_{p}_s": float(left[p]) - started for p in parts if left.get(p)}
        )
    except (OSError, ValueError, TypeError, AttributeError):
        return pb.MissTimings()


def _leave(cache_dir: str, name: str, data: bytes) -> None:
    """A file of the helper's for its child, whole or not at all (a rename), before it exits."""
    path = os.path.join(cache_dir, name)
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def _left(cache_dir: str, name: str) -> bytes:
    """What the helper left under `name` (`_leave`); OSError where it left nothing."""
    with open(os.path.join(cache_dir, name), "rb") as f:
        return f.read()


def _helper_main(args: argparse.Namespace, warmed: bool = False) -> int:
    """The backward helper: warm up, read the child's request, compile its backward into the
    shared cache dir, stop. Exit status 0 whether or not there was a backward."""
    warm_fork.die_with_parent()  # ends with its child, sandbox or not
    if not warmed:
        _warm_up(args)
    data = _read_frame(sys.stdin.buffer)
    if data is None:  # nothing to help with (not an Inductor compile, or the child is gone)
        return 0
    request = pb.CompileChildRequest.FromString(data)
    from torchfarm.torch_adapter.compile import concurrent_backward, gemm_benchmarks
    from torchfarm.torch_adapter.worker import gemm_problems

    cache_dir = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    with contextlib.ExitStack() as kernels:
        benchmarked = kernels.enter_context(gemm_benchmarks.counted())
        if args.kernels:
            kernels.enter_context(kernel_cache.looking_up(args.kernels, cache_dir))
        for module in request.op_libraries:
            importlib.import_module(module)
        compiler = compilers.load(INDUCTOR, compilers.parse(args.compilers))
        context = compilers.CompileContext(on_stage=lambda stage: None, tuning_gpus=())

        def hand_on(key: Key) -> None:
            _leave(cache_dir, HELPER_KEY, json.dumps(dataclasses.asdict(key)).encode())

        strides = _ForwardStrides(sys.stdin.buffer)
        try:
            with concurrent_backward.backward_only(
                strides.wait, hand_on, strides_arrived=strides.arrived.is_set
            ) as times:
                compiler.compile(request, context)
        except concurrent_backward.Stopped:
            pass
    _leave(cache_dir, HELPER_TIMES, json.dumps(dataclasses.asdict(times)).encode())
    files = pb.KernelFiles(gemm_candidates_benchmarked=benchmarked.candidates)
    files.gemm_problems.extend(gemm_problems.problems(benchmarked.problems, args.device))
    _leave(cache_dir, HELPER_REPORT, files.SerializeToString())
    return 0


if __name__ == "__main__":  # run the importable module's main, so report() has one state
    from torchfarm.workers import compile_child

    sys.exit(compile_child.main())
