"""The pool's kernel builds: how a C++ object or a Triton kernel enters the cache that every
tenant's compiles on a pool read (workers/kernel_cache.py; docs/reliability.md, "Kernel reuse").

A compile child runs a tenant's code, so the objects it reports could be anything under any
name. What a shared job's child reports for the pool is therefore only sources: one
`KernelSource` per C++ library (Inductor's load_async arguments) and, on a GPU pool, one
`TritonSource` per Triton kernel (its module as Inductor wrote it). After the job has ended,
the worker builds each source it has not built before in a builder child of its own: the
compile sandbox (no network, no secrets, a private tmpfs, nothing staged), given sources and
nothing else. Those builds are background work: they never compete with the user's processes
nor with compiles (issue 53). A builder runs at idle CPU and I/O priority
(workers/idle_priority.py; but for GEMM measurements; TORCHFARM_KERNEL_BUILD_PRIORITY=normal:
at the compiles' priority), at most TORCHFARM_KERNEL_BUILDS of them at once, and each build
waits until no compile runs in this worker (workers/slots.py). The exception, on CPU pools: a
shared compile hands its C++ builds to the pool's builders for compiles (`CompileBuilds`)
while it runs, at the compiles' priority, since the compile waits for them.
- A C++ library: the builder calls Inductor's own load_async, which names the objects after
  the source and the pool's compile command and runs g++ on them; it never loads them.
- A Triton kernel: the builder first checks that the module is one Inductor writes
  (torch_adapter/worker/triton_source_check.py; running a module, or compiling a jit body, can run
  any Python), then compiles it as Inductor's compile workers do, and Triton names each entry
  after what determines it (its version, the function's text, signature, options, target).
  Refused modules are not built (exit status REFUSED).
- A GEMM whose candidates a compile benchmarked (max-autotune): the builder makes operands of
  the recorded layouts on the pool's device and lets Inductor benchmark every candidate and
  file the timings (torch_adapter/worker/gemm_problems.py); the worker merges them into the pool's.
  On a GPU its measurements hold the GPU's benchmark lock, as compiles' do
  (workers/gpu_lock.py), and run at the compiles' priority: every later
  compile on the pool takes these timings, so none may be taken beside another measurement
  or behind a busy host.
It reports what it built. So what lies under a name is what the pool's compilers make of the
one source that name hashes; a hostile payload can at most make the pool build, correctly,
kernels whose sources it names.

The builder child (`python -m torchfarm.workers.kernel_builder`) imports torch and Inductor,
runs Inductor's ISA checks and computes the keys of the worker's precompiled headers once
(`remember_headers`), then builds the sources it is sent one after another,
each as a fresh builder would: in a process forked for it from that untouched state, with the
writable directories emptied (Inductor's and Triton's cache dirs among them) and every
process an earlier build left ended. That saves ~3 CPU-seconds of imports per source: a
pool's builds cost as much CPU as its compiles before. It lives until the worker stops it
(a background builder after IDLE_S without a source; a compiles' builder with the worker).
On stdin: length-prefixed `KernelBuild`s; on stdout, an empty reply once warm, then one reply
each: the build's exit status, then its `KernelFiles` (refused: why).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import IO, BinaryIO, NoReturn

from torchfarm.errors import BuildRefused
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import WorkerSettings
from torchfarm.workers import compile_child, idle_priority, kernel_cache, sandbox, warm_fork
from torchfarm.workers.compile_child import FRAME
from torchfarm.workers.slots import SLOTS

log = logging.getLogger("torchfarm.worker")

BUILD_TIMEOUT_S = 600  # one library: seconds of g++ here, minutes on a crowded host
MAX_QUEUED = 1024  # sources waiting for a build; more are dropped (a later compile offers them)
IDLE_S = 5.0  # a background builder with nothing to build for this long is stopped
REPLY = struct.Struct(">iQ")  # a build's exit status, then the length of its KernelFiles
REFUSED = 3  # a build's exit status: a Triton module that is not one Inductor writes
_TRISTATE = {0: None, 1: False, 2: True}  # KernelSource.needs_vec_isa


def build(
    request: pb.KernelBuild, cache_dir: str, device: str = "cpu", gpu_lock: str = ""
) -> pb.KernelFiles:
    """Builder child: build what `request` names into the empty `cache_dir` (and, for a Triton
    kernel, Triton's empty TRITON_CACHE_DIR) as a compile would, without loading or launching
    anything built; report it. A GEMM problem is measured instead, on `device` (the pool's),
    its measurements holding `gpu_lock` (workers/gpu_lock.py) where given."""
    with _as_compiles(cache_dir):
        if request.HasField("triton"):
            return _build_triton(request.triton, cache_dir)
        if request.HasField("gemm"):
            return _measure_gemm(request.gemm, cache_dir, device, gpu_lock)
        _build_cpp(request.cpp)
    return kernel_cache.report(cache_dir, "")


@contextlib.contextmanager
def _as_compiles(cache_dir: str) -> Iterator[None]:
    """Inductor configured as for the pool's compiles, its cache dir `cache_dir`."""
    from torchfarm.compiler.inductor import WORKER_CONFIG
    from torchfarm.torch_adapter.compile import standalone

    with standalone.inductor_config.patch(WORKER_CONFIG), standalone.cache_dir_at(cache_dir):
        yield


def remember_headers(cache_dir: str) -> int:
    """Builder child, warm and before any build: the keys of the precompiled headers the
    worker built, computed once here for every build forked from it (without, each C++ build
    ran g++ -E on the header again, ~0.4 s of a ~1 s build: a compile handing its builds to
    the pool got 1.14-1.27x slower); how many headers."""
    from torchfarm.torch_adapter.compile import cpp_libraries

    with _as_compiles(cache_dir):
        try:
            return cpp_libraries.remember_headers(kernel_cache.CODE_CACHES)
        except Exception as e:  # an optimization: its builds then hash the headers each
            print(f"kernel builder: headers not remembered: {e}", file=sys.stderr)
            return 0


def _measure_gemm(
    gemm: pb.GemmProblem, cache_dir: str, device: str, gpu_lock: str
) -> pb.KernelFiles:
    """The timings Inductor filed for the problem's candidates, and nothing else the
    measurement compiled. It runs in a fresh interpreter (in this sandbox, with this cache
    dir): CUDA does not start in a process forked from one that asked for the device count
    (torch then marks the fork bad), which importing Inductor did on a GPU host."""
    from torchfarm.torch_adapter.worker import gemm_problems

    gemm_problems.check(gemm)  # refused before anything starts
    subprocess.run(
        [sys.executable, "-m", "torchfarm.workers.gemm_measure", device, gpu_lock],
        input=gemm.SerializeToString(),
        stdout=sys.stderr,  # the measurement's output: the error text, never the reply
        check=True,
    )
    files = kernel_cache.report(cache_dir, "")
    for name in [n for n in files.built if not kernel_cache.is_gemm_timings(n)]:
        del files.built[name]
    return files


def _build_triton(source: pb.TritonSource, cache_dir: str) -> pb.KernelFiles:
    """The kernel's Triton entries, and the autotune result it was built with (if one was
    taken), kept under the kernel's text as the tenant's are (kernel_cache.text_name)."""
    from torchfarm.torch_adapter.worker import triton_kernels

    result = triton_kernels.build(source.module, source.kernel_name, source.result)
    files = kernel_cache.report(cache_dir, "", triton_dir=os.environ["TRITON_CACHE_DIR"])
    for name in [n for n in files.built if n.startswith(kernel_cache.TUNING + "/")]:
        del files.built[name]  # the build's own copy of the result
    if result:
        files.built[kernel_cache.text_name(source.kernel_name, source.module)] = result
    return files


def _build_cpp(source: pb.KernelSource) -> None:
    """The objects of one library, as the compile's class, command and precompiled header
    make them."""
    from torchfarm.torch_adapter.compile import cpp_libraries

    if source.code_cache not in kernel_cache.CODE_CACHES:
        raise ValueError(f"not a C++ code cache: {source.code_cache!r}")
    cpp_libraries.build(
        source.code_cache,
        source.main_code,
        source.optimized_code if source.has_optimized else None,
        _TRISTATE[source.needs_vec_isa],
        _TRISTATE[source.kernel_needs_vec_isa],
    )


def builds_of(files: pb.KernelFiles) -> list[pb.KernelBuild]:
    """What a shared job's child recorded, as the builds that would make it for the pool."""
    return (
        [pb.KernelBuild(cpp=s) for s in files.sources]
        + [pb.KernelBuild(triton=t) for t in files.triton_sources]
        + [pb.KernelBuild(gemm=g) for g in files.gemm_problems]
    )


def _build_and_keep(
    builder: _Builder, kernels: kernel_cache.KernelCache, pool_dir: str, source: pb.KernelBuild
) -> pb.KernelFiles:
    """Build `source` in `builder`, keep what it made in `pool_dir` and mark it built there
    (a marker last: a source marked built has its files in place)."""
    files = builder.build(source)
    kernels.keep(pool_dir, files)
    kernels.mark_built(pool_dir, source, sorted(files.built))
    return files


# pool dir, source, `kept`
_Queued = tuple[str, pb.KernelBuild, Callable[[pb.KernelBuild, int], None]]


class PoolBuilds:
    """The worker's queue of kernel builds for its pools, drained by TORCHFARM_KERNEL_BUILDS
    background threads, each with its builder child. Before each build a thread waits for
    `compiles_done` (by default, until no compile runs in this worker process): a build
    started beside a compile would take the compile's cores, memory and disk."""

    def __init__(
        self,
        kernels: kernel_cache.KernelCache,
        settings: WorkerSettings,
        compiles_done: Callable[[], None] = SLOTS.wait_until_none_run,
    ) -> None:
        self.kernels, self.settings, self.compiles_done = kernels, settings, compiles_done
        self.waiting: queue.Queue[_Queued] = queue.Queue(MAX_QUEUED)
        for number in range(settings.kernel_builds):
            name = f"kernel-builds-{number}"
            threading.Thread(target=self._drain, name=name, daemon=True).start()

    def offer(
        self,
        pool_dir: str,
        sources: list[pb.KernelBuild],
        kept: Callable[[pb.KernelBuild, int], None],
    ) -> int:
        """Queue the sources not built for `pool_dir` yet; how many were queued. `kept` hears
        each source built and how many tuning results its build stored (for the pool's
        counters and its tuning builds)."""
        queued = 0
        for source in sources:
            if self.kernels.built_before(pool_dir, source):
                continue
            try:
                self.waiting.put_nowait((pool_dir, source, kept))
            except queue.Full:
                break
            queued += 1
        return queued

    def _drain(self) -> None:
        while True:
            item: _Queued | None = self.waiting.get()
            with _Builder(self.settings) as builder:
                while item is not None:
                    self.compiles_done()
                    self._build(builder, *item)
                    try:  # the rest of the burst goes to the same builder
                        item = self.waiting.get(timeout=IDLE_S)
                    except queue.Empty:
                        item = None

    def _build(
        self,
        builder: _Builder,
        pool_dir: str,
        source: pb.KernelBuild,
        kept: Callable[[pb.KernelBuild, int], None],
    ) -> None:
        if self.kernels.built_before(pool_dir, source):  # queued twice
            log.info("pool kernel build skipped: built already")
            return
        started = time.perf_counter()
        try:
            files = _build_and_keep(builder, self.kernels, pool_dir, source)
            tuned = sum(1 for name in files.built if name.startswith(kernel_cache.TUNING + "/"))
            kept(source, tuned)
        except ValueError as e:  # a Triton module that is not Inductor's: not shared
            log.info("pool kernel build %s", str(e)[:600])
            return
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            log.warning("pool kernel build failed: %s", str(e)[-500:])
            return
        log.info(
            "pool kernel build: %d files in %.1f s (%d waiting)",
            len(files.built),
            time.perf_counter() - started,
            self.waiting.qsize(),
        )


class CompileBuilds:
    """The C++ libraries shared compiles ask the pool to build while they run
    (CompileChildRequest.pool_builds; issue 53: a compile's objects are the pool's when it
    ends, so a sibling right after reuses them). Each is built once, by one of `size` builder
    children kept warm from the start, at the compiles' priority (the compile waits for it, as
    for its own build), and kept in the pool's directory as a background build's would be; a
    source asked for while it is being built waits for that build. Each builder is driven by a
    thread of its own that lives as long as the worker: a sandbox dies with the thread that
    started it (bwrap's --die-with-parent)."""

    def __init__(self, kernels: kernel_cache.KernelCache, settings: WorkerSettings, size: int):
        self.kernels = kernels
        self.lock = threading.Lock()
        self.building: dict[str, threading.Event] = {}
        self.waiting: queue.Queue[tuple[str, pb.KernelBuild, Future]] = queue.Queue()
        for number in range(size):
            builder = _Builder(settings, priority="normal")
            name = f"compile-kernel-builds-{number}"
            threading.Thread(target=self._drain, args=(builder,), name=name, daemon=True).start()

    def build(self, pool_dir: str, source: pb.KernelSource) -> list[str]:
        """The names of the objects of `source` in `pool_dir`, built now unless they are
        there; [] where its build failed."""
        request = pb.KernelBuild(cpp=source)
        marker = kernel_cache.source_marker(pool_dir, request)
        while True:
            with self.lock:
                if self.kernels.built_before(pool_dir, request):
                    return self.kernels.built_names(pool_dir, request)
                running = self.building.get(marker)
                if running is None:
                    self.building[marker] = threading.Event()
                    break
            running.wait()  # then found built, or built here if that build failed
        try:
            built: Future[list[str]] = Future()
            self.waiting.put((pool_dir, request, built))
            return built.result()
        finally:
            with self.lock:
                self.building.pop(marker).set()

    def _drain(self, builder: _Builder) -> None:
        """Its builder's thread: it never ends, whatever a build raises (a waiting compile
        would wait on it for ever), and answers [] for a build that failed."""
        try:  # its imports now, not on a compile's path
            builder.start()
            log.info("kernel builder for compiles ready")
        except Exception as e:  # the first build starts another
            log.warning("kernel builder for compiles failed: %s", str(e)[-500:])
        while True:
            pool_dir, request, built = self.waiting.get()
            built.set_result(self._build(builder, pool_dir, request))

    def _build(self, builder: _Builder, pool_dir: str, request: pb.KernelBuild) -> list[str]:
        started = time.perf_counter()
        try:
            names = sorted(_build_and_keep(builder, self.kernels, pool_dir, request).built)
        except Exception as e:  # the compile builds it itself
            log.warning("kernel build for a compile failed: %s", str(e)[-500:])
            return []
        log.info(
            "kernel build for a compile: %d files in %.1f s",
            len(names),
            time.perf_counter() - started,
        )
        return names


class _Builder:
    """A sandboxed builder child, started on first use (or `start`) and fed one source at a
    time; one whose build fails or times out is ended, and the next source starts another.
    At `priority` (idle: TORCHFARM_KERNEL_BUILD_PRIORITY's)."""

    def __init__(self, settings: WorkerSettings, priority: str = "") -> None:
        self.settings = settings
        self.priority = priority or settings.kernel_build_priority
        self.proc: subprocess.Popen | None = None
        self.private_dir = ""
        self.errors: BinaryIO | None = None  # the child's stderr: the tail of a failure

    def __enter__(self) -> _Builder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> subprocess.Popen:
        self.private_dir = tempfile.mkdtemp(prefix="torchfarm-kernel-build-")
        child: tuple[str, ...] = ("-m", "torchfarm.workers.kernel_builder")
        child += ("--device", self.settings.device)
        child += ("--priority", self.priority)
        if self.settings.sandbox == "bwrap":  # its own PID namespace and tmpfs to clean
            child += ("--in-sandbox",)
        argv, env, cwd = sandbox.child_command(self.settings, self.private_dir, child)
        self.errors = tempfile.TemporaryFile()
        return subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )

    def start(self) -> subprocess.Popen:
        """The child, started now where it has not been, once warm (its empty first reply);
        RuntimeError where it ended first."""
        if self.proc is None:
            try:
                self.proc = self._start()
            except Exception:  # its directories and stderr file go with it
                self.stop()
                raise
            assert self.proc.stdout is not None
            try:
                _read(self.proc.stdout, REPLY.size, time.monotonic() + BUILD_TIMEOUT_S)
            except (OSError, TimeoutError, EOFError) as e:
                self._failed(e)
        return self.proc

    def build(self, source: pb.KernelBuild) -> pb.KernelFiles:
        """Build one source; RuntimeError with the child's error where it failed."""
        self.proc = self.start()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        data = source.SerializeToString()
        try:
            self.proc.stdin.write(FRAME.pack(len(data)) + data)
            self.proc.stdin.flush()
            deadline = time.monotonic() + BUILD_TIMEOUT_S
            status, size = REPLY.unpack(_read(self.proc.stdout, REPLY.size, deadline))
            reply = _read(self.proc.stdout, size, deadline)
        except (OSError, TimeoutError, EOFError) as e:
            self._failed(e)
        if status == REFUSED:  # checked and not built: the builder itself is as it was
            raise ValueError(f"refused: {reply.decode(errors='replace')}")
        if status:
            error = f"build exit {status}: {self._error_tail()!r}"
            self.stop()  # its stderr has served; the next source starts a clean builder
            raise RuntimeError(error)
        if self.errors is not None:  # what a build that succeeded said: a builder lives long
            self.errors.seek(0)  # the offset the child writes at too (one open file)
            self.errors.truncate()
        return pb.KernelFiles.FromString(reply)  # protobuf parse: no code runs

    def _failed(self, error: Exception) -> NoReturn:
        text = f"builder: {type(error).__name__} {error} {self._error_tail()!r}"
        self.stop()
        raise RuntimeError(text) from None

    def _error_tail(self) -> bytes:
        if self.errors is None:
            return b""
        self.errors.seek(0, os.SEEK_END)
        self.errors.seek(max(0, self.errors.tell() - 500))
        return self.errors.read()

    def stop(self) -> None:
        """Close its stdin (it exits once idle) and remove its directories; kill it if it
        does not go at once."""
        if self.proc is not None:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # anything left of it, g++ included
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None
        if self.errors is not None:
            self.errors.close()
            self.errors = None
        if self.private_dir:
            shutil.rmtree(self.private_dir, ignore_errors=True)
            self.private_dir = ""


def _read(stream: IO[bytes], size: int, deadline: float) -> bytes:
    """Exactly `size` bytes of a pipe by `deadline`: TimeoutError, or EOFError if it closed."""
    chunks, left = [], size
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        while left:
            if not selector.select(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"no reply in {BUILD_TIMEOUT_S} s")
            chunk = os.read(stream.fileno(), min(left, 1 << 20))
            if not chunk:
                raise EOFError("the builder exited")
            chunks.append(chunk)
            left -= len(chunk)
    return b"".join(chunks)


def _build_in_fork(
    source: pb.KernelBuild, cache_dir: str, device: str, gpu_lock: str, idle: bool
) -> tuple[int, bytes]:
    """Build `source` in a child forked from this process, whose state no build has touched:
    each build sees only its own source; `idle`: at idle priority (but a GEMM measurement)."""
    read_end, write_end = os.pipe()

    def build_here() -> int:  # the build's own process
        os.close(read_end)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the next sources are not its to read
        if idle and source.HasField("gemm"):  # its timings are the pool's: not measured behind
            idle_priority.normal_session()  # others
        elif idle:
            idle_priority.idle_cpu()
        try:
            data, status = build(source, cache_dir, device, gpu_lock).SerializeToString(), 0
        except BuildRefused as e:  # the reply is why
            data, status = str(e)[:500].encode(), REFUSED
        with os.fdopen(write_end, "wb") as out:
            out.write(data)
        return status

    pid = warm_fork.fork(build_here)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as built:
        data = built.read()
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), data


def main() -> int:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever a build prints goes to stderr, never into the replies
    # What every build needs, once: the imports, and the ISA probe with its build checks
    # (bf16, VNNI, AMX: Inductor's own test programs, answered from the worker's probe where
    # it ran them) remembered in-process.
    parser = argparse.ArgumentParser(prog="torchfarm.workers.kernel_builder")
    parser.add_argument("--in-sandbox", action="store_true")
    parser.add_argument("--isa-checks", default="", help="the worker's ISA probe (isa_probe.py)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the pool's")
    parser.add_argument("--gpu-lock", default="", help="its GPU's (gpu_lock.py)")
    parser.add_argument("--priority", choices=("idle", "normal"), default="idle")
    args = parser.parse_args()
    idle = args.priority == "idle"
    # Background work from the start, its imports included (a GEMM measurement's fork
    # leaves it: idle_priority.normal_session). A CPU pool's builder measures nothing, so its
    # start-up (torch's imports: 3-5 CPU s, which ran beside the user's next hit at normal
    # priority) takes only idle CPU too; a GPU pool's must stay able to leave it.
    for skipped in idle_priority.idle_session() if idle else []:
        print(f"kernel builder: no {skipped}", file=sys.stderr)
    if idle and args.device == "cpu":
        idle_priority.idle_cpu()
    compile_child.warm_up("cpu", [], args.isa_checks)
    cache_dir = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    headers = remember_headers(cache_dir)  # what it writes there goes before the first build
    print(f"kernel builder: {headers} precompiled headers", file=sys.stderr)
    # Sealed (not dumpable: no g++ run on a crafted source can reach into it), and each build
    # forked from it in a sandbox made as it was before the last one (warm_fork.py).
    warm = warm_fork.WarmState(args.in_sandbox)
    replies.write(REPLY.pack(0, 0))  # ready: warm, reading sources
    replies.flush()
    requests = sys.stdin.buffer
    while head := requests.read(FRAME.size):
        source = pb.KernelBuild.FromString(requests.read(FRAME.unpack(head)[0]))
        warm.as_if_new()
        status, data = _build_in_fork(source, cache_dir, args.device, args.gpu_lock, idle)
        replies.write(REPLY.pack(status, len(data)) + data)
        replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
