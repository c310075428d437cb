"""Run one compile in a child process that can do nothing else, even under a root worker.

The child runs in bubblewrap as an unprivileged user of its own user namespace, with every
capability dropped and no new privileges, in new network, PID, IPC, UTS and cgroup
namespaces, and dies with its parent. It sees read-only binds of what a compile needs (the
toolchain under /usr, the interpreter, the environment's packages and the torchfarm package
alone, on a private path), and writes only to a size-capped private tmpfs that vanishes with
it. It never sees the worker's working directory, the host's /tmp, $HOME or the farm's data.
Request, stages and artifact travel through pipes (the contract's child protocol), read
with caps; its error text is bounded. See docs/reliability.md, "Threat model".

Children are started ahead of need by a pool of this worker's (workers/child_pool.py), each
in exactly this sandbox, and each serves one request. On CPU pools the pool keeps warm parents
in this sandbox instead, which fork one child per request (compile_child.py, `--fork-server`)
and clean the sandbox after each: the same sandbox, one request per process, without a
warm-up per request.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

from torchfarm.errors import TorchfarmError
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import WorkerSettings
from torchfarm.settings.sizing import COMPILE_SHM_MB, visible_gpus
from torchfarm.torch_adapter.worker import precompiled_headers
from torchfarm.workers import child_pool, isa_verdict, kernel_cache, metrics
from torchfarm.workers.child_pool import ERROR_TAIL_BYTES as ERROR_TAIL_BYTES  # its error text
from torchfarm.workers.compile_child import FRAME
from torchfarm.workers.gpu_lock import lock_file as gpu_lock_file

log = logging.getLogger("torchfarm.worker")

SANDBOX_UID = 65534  # the child's user and group inside its namespace: nobody
LIB_DIR = "/run/torchfarm"  # inside the sandbox: holds the torchfarm package, on PYTHONPATH
WORK_DIR = "/tmp"  # inside the sandbox: the private size-capped tmpfs, its cwd and $HOME
KERNEL_DIR = "/run/kernels"  # inside the sandbox: staged C++ objects, read-only, not listable
GPU_LOCK = "/run/gpu.lock"  # inside the sandbox: its GPU's benchmark lock, read-only
CHILD_USER = "nobody"  # the child's $USER: Inductor names its default cache dir after it
SHM_BYTES = COMPILE_SHM_MB << 20  # /dev/shm inside the sandbox (Python's semaphores live there)
_STAGES = (pb.Progress.COMPILING, pb.Progress.AUTOTUNING)  # what a child may report
_MAX_STAGE_FRAME = 64
# /etc is not bound, except the dynamic linker's cache: a CPU compile here ran without it (the
# default library paths sufficed), but libraries registered through /etc/ld.so.conf.d (CUDA's,
# /usr/local/lib) are found only through it.
# The loader's cache, and Debian's alternatives: symlinks only, through which /usr names tools
# (the GPU image's /usr/local/cuda -> /etc/alternatives/cuda -> /usr/local/cuda-13.0, whose
# headers AOTInductor compiles against).
_ETC = ("/etc/ld.so.cache", "/etc/alternatives")
# Top-level links or directories of a merged-/usr layout that point into /usr.
_TOP_LEVEL = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Environment the child may inherit: the compiler choice and the CUDA runtime's.
_PASSED_ENV = (
    "CXX",
    "CC",
    "CUDA_HOME",
    "CUDA_VISIBLE_DEVICES",
    "LD_LIBRARY_PATH",
    "TRITON_LIBCUDA_PATH",
    "TRITON_PTXAS_PATH",
)
# Of those, the ones that name a compiler: its whole installation prefix is bound (gcc needs
# its libexec and headers beside bin/). The others are bound as they are, file or directory.
_COMPILER_ENV = ("CC", "CXX")
_TOOL_ENV = ("CUDA_HOME", "TRITON_LIBCUDA_PATH", "TRITON_PTXAS_PATH")


ABANDON_CHECK_S = 5.0  # how often a running compile asks whether anyone still waits for it


class CompileFailed(TorchfarmError, RuntimeError):
    """The compile child failed, crashed or ran out of time; the message says which, `kind`
    how the job ends (JobOutcome.FAILED or TIMED_OUT). `lasting`: the child raised, so
    compiling the same job again would fail the same way."""

    def __init__(
        self,
        message: str,
        lasting: bool = False,
        kind: pb.JobOutcome.Kind.ValueType = pb.JobOutcome.FAILED,
    ) -> None:
        super().__init__(message)
        self.lasting, self.kind = lasting, kind

    def outcome(self) -> pb.JobOutcome:
        return pb.JobOutcome(kind=self.kind, error=str(self))


class _Stops:
    """The two ways a running child is ended from outside: its compile timeout, and its
    clients leaving (`abandoned()` True at two checks in a row, ABANDON_CHECK_S apart: a
    waiter between two gateways' refreshes is not yet gone; a failing check counts as not
    abandoned)."""

    def __init__(
        self, child: child_pool.Child, timeout_s: float, abandoned: Callable[[], bool] | None
    ) -> None:
        self.child, self.timeout_s, self.abandoned = child, timeout_s, abandoned
        self.timed_out, self.stopped, self._done = (threading.Event() for _ in range(3))
        self._timer = threading.Timer(timeout_s, self._expire)
        self._timer.daemon = True
        self._watcher = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> None:
        self._timer.start()
        self._watcher.start()

    def end(self) -> None:
        self._timer.cancel()
        self._done.set()

    def raise_if_stopped(self, handed_back: bool) -> None:
        """CompileFailed where the child was ended from outside (and, if abandoned, before it
        handed its artifact back)."""
        if self.stopped.is_set() and not handed_back:
            raise CompileFailed(
                "stopped: no client waits for this compile any more", kind=pb.JobOutcome.ABANDONED
            )
        if self.timed_out.is_set():
            raise CompileFailed(
                f"compile exceeded {self.timeout_s:.0f} s (TORCHFARM_COMPILE_TIMEOUT_WORKER)",
                kind=pb.JobOutcome.TIMED_OUT,
            )

    def _expire(self) -> None:
        self.timed_out.set()
        self.child.kill()

    def _watch(self) -> None:
        if self.abandoned is None:
            return
        strikes = 0
        while not self._done.wait(ABANDON_CHECK_S):
            try:
                strikes = strikes + 1 if self.abandoned() else 0
            except Exception:
                strikes = 0
            if strikes >= 2:
                self.stopped.set()
                self.child.kill()
                return


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """What of this machine the sandbox binds; `probe()` reads it, tests build their own."""

    top_level: dict[str, str]  # /bin, /lib64, ...: symlink target, or "" for a directory
    python_roots: tuple[str, ...]  # interpreter and environment prefixes outside /usr
    package_dir: str  # the torchfarm package (never its checkout)
    etc: tuple[str, ...]  # the /etc entries of _ETC that exist
    gpu_nodes: tuple[str, ...]  # /dev/nvidia*
    # PYTHONPATH entries of the worker's (packages installed with `pip --target`), minus the
    # working directory and any checkout holding a torchfarm source tree
    python_path: tuple[str, ...] = ()
    # compilers and CUDA tools the environment names outside /usr (a GPU image's /opt/gcc,
    # which Triton's driver build and Inductor use through CC / CXX)
    toolchain: tuple[str, ...] = ()

    @classmethod
    def probe(cls) -> HostLayout:
        top_level = {}
        for name in _TOP_LEVEL:
            path = f"/{name}"
            if os.path.islink(path):
                top_level[name] = os.readlink(path)
            elif os.path.isdir(path):
                top_level[name] = ""
        roots = {
            os.path.realpath(p)
            for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)
        }
        roots.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
        return cls(
            top_level=top_level,
            python_roots=_outermost(r for r in roots if not _under(r, "/usr") and r != "/"),
            package_dir=str(Path(__file__).resolve().parents[1]),
            etc=tuple(p for p in _ETC if os.path.exists(p)),
            gpu_nodes=tuple(
                f"/dev/{n}" for n in sorted(os.listdir("/dev")) if n.startswith("nvidia")
            ),
            python_path=_extra_python_path(),
            toolchain=_toolchain_paths(),
        )


def _extra_python_path() -> tuple[str, ...]:
    cwd, found = os.path.realpath(os.getcwd()), []
    for entry in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        path = os.path.realpath(entry)
        if (
            os.path.isdir(path)
            and path != cwd
            and not os.path.isdir(os.path.join(path, "torchfarm"))
            and path not in found
        ):
            found.append(path)
    return tuple(found)


def _toolchain_paths() -> tuple[str, ...]:
    found = []
    for name in (*_COMPILER_ENV, *_TOOL_ENV):
        value = os.environ.get(name, "")
        path = (shutil.which(value) or value) if value else ""
        if not path or not os.path.exists(path):
            continue
        for p in {os.path.abspath(path), os.path.realpath(path)}:
            if name in _COMPILER_ENV and os.path.basename(os.path.dirname(p)) == "bin":
                p = os.path.dirname(os.path.dirname(p))
            if p != "/" and not _under(p, "/usr"):
                found.append(p)
    return _outermost(found)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _outermost(paths) -> tuple[str, ...]:
    """The paths not inside another one of them, sorted."""
    ordered = sorted(set(paths))
    return tuple(p for p in ordered if not any(q != p and _under(p, q) for q in ordered))


def bwrap_args(
    settings: WorkerSettings, layout: HostLayout, kernels: str = "", gpu_lock: str = ""
) -> list[str]:
    """The bubblewrap command line (up to the child's own command) for one compile child;
    `kernels`, the child's staging directory for its tenant's C++ objects, is bound read-only
    on KERNEL_DIR (workers/kernel_cache.py), `gpu_lock`, its GPU's benchmark lock file, on
    GPU_LOCK (workers/gpu_lock.py)."""
    args = ["bwrap", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    args += ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    args += ["--unshare-cgroup-try", "--cap-drop", "ALL", "--die-with-parent", "--new-session"]
    args += ["--ro-bind", "/usr", "/usr"]
    for name, target in sorted(layout.top_level.items()):
        args += (
            ["--symlink", target, f"/{name}"] if target else ["--ro-bind", f"/{name}", f"/{name}"]
        )
    args += ["--dev", "/dev", "--proc", "/proc"]
    args += ["--size", str(settings.compile_disk_mb << 20), "--tmpfs", WORK_DIR]
    args += ["--size", str(SHM_BYTES), "--tmpfs", "/dev/shm"]
    # After the private /tmp, so that an environment living under the host's /tmp (a CI
    # clone's venv) is bound on top of it instead of hidden by it.
    binds = (*layout.etc, *layout.python_roots, *layout.python_path, *layout.toolchain)
    for path in (*binds, *settings.sandbox_binds):
        args += ["--ro-bind", path, path]
    args += ["--ro-bind", layout.package_dir, f"{LIB_DIR}/torchfarm"]
    for source, dest in precompiled_headers.child_binds(WORK_DIR, CHILD_USER):  # once built
        args += ["--ro-bind", source, dest]
    if settings.device == "cuda":  # autotuning benchmarks need the GPU, and nothing else
        for node in layout.gpu_nodes:
            args += ["--dev-bind", node, node]
        args += ["--ro-bind", "/sys", "/sys"]  # the CUDA driver reads its devices' topology
    if gpu_lock:
        args += ["--ro-bind", gpu_lock, GPU_LOCK]
    if kernels:
        args += ["--ro-bind", kernels, KERNEL_DIR]
    args += ["--chdir", WORK_DIR, "--remount-ro", "/"]
    return args


def child_environment(
    work_dir: str, lib_dir: str, python_path: tuple[str, ...] = ()
) -> dict[str, str]:
    """The child's whole environment: no secret of the worker's reaches it."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": os.pathsep.join((lib_dir, *python_path)),
        "PYTHONDONTWRITEBYTECODE": "1",
        "HOME": work_dir,
        "USER": CHILD_USER,
        "TMPDIR": work_dir,
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(work_dir, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(work_dir, "triton"),
    }
    env.update({name: os.environ[name] for name in _PASSED_ENV if name in os.environ})
    env.update(isa_verdict.child_environment())
    env.update(precompiled_headers.child_environment())
    return env


_CHILD = ("-m", "torchfarm.workers.compile_child")


def child_command(
    settings: WorkerSettings,
    private_dir: str,
    python_args: tuple[str, ...] = _CHILD,
    number: int = 0,
    fork_server: bool = False,
) -> tuple[list[str], dict, str]:
    """argv, environment and working directory of compile child number `number` (a CUDA
    child gets one of the visible GPUs, in turn), or with `fork_server` of a warm parent
    that forks such children. `private_dir` is an empty host directory of the parent's: with
    the kernel cache on, it holds the child's staging directory (`staging_dir`); without a
    sandbox, its library and work directories too."""
    python = [sys.executable, *python_args, *isa_verdict.child_arguments()]
    staging = gpu_lock = ""
    gpus = visible_gpus() if settings.device == "cuda" else ()
    gpu = gpus[number % len(gpus)] if gpus else ""
    if fork_server:
        python += ["--fork-server"] + (["--in-sandbox"] if settings.sandbox == "bwrap" else [])
    if python_args == _CHILD:
        python += ["--device", settings.device, "--op-libraries", ",".join(_op_libraries(settings))]
        python += ["--tuning-gpus", ",".join(tuning_gpus(settings))]
        python += ["--compilers", settings.compilers]
        if settings.backward_helper:
            python += ["--concurrent-backward"]
        if settings.kernel_names != "unique":
            python += ["--kernel-names", settings.kernel_names]
        if settings.kernel_cache_mb:
            staging = staging_dir(private_dir)
            os.makedirs(staging)
            python += ["--kernels", KERNEL_DIR if settings.sandbox == "bwrap" else staging]
    if gpu and (gpu_lock := gpu_lock_file(gpu)):  # compile or kernel builder
        python += ["--gpu-lock", GPU_LOCK if settings.sandbox == "bwrap" else gpu_lock]
    layout = HostLayout.probe()
    if settings.sandbox == "bwrap":
        cmd = bwrap_args(settings, layout, staging, gpu_lock) + python
        env, cwd = child_environment(WORK_DIR, LIB_DIR, layout.python_path), "/"
    else:
        # Unconfined: still off the worker's working directory, with only the package
        # importable.
        lib_dir, work_dir = os.path.join(private_dir, "lib"), os.path.join(private_dir, "work")
        os.makedirs(lib_dir)
        os.makedirs(work_dir)
        os.symlink(layout.package_dir, os.path.join(lib_dir, "torchfarm"))
        cmd, cwd = python, work_dir
        env = child_environment(work_dir, lib_dir, layout.python_path)
    cmd = limits(settings) + cmd
    if gpu:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return cmd, env, cwd


def tuning_gpus(settings: WorkerSettings) -> tuple[str, ...]:
    """The GPUs a child benchmarks its autotuning candidates on: all of the worker's where
    spread_tuning is on (torch_adapter/compile/tuning_devices.py), else none beside its own."""
    gpus = visible_gpus() if settings.device == "cuda" and settings.spread_tuning else ()
    return gpus if len(gpus) > 1 else ()


def staging_dir(private_dir: str) -> str:
    """Where the parent stages a tenant's C++ objects for the child of `private_dir`."""
    return os.path.join(private_dir, "kernels")


def _op_libraries(settings: WorkerSettings) -> list[str]:
    return [m.strip() for m in settings.op_libraries.split(",") if m.strip()]


def check_available(settings: WorkerSettings) -> None:
    """Refuse to start without a sandbox that holds, unless the operator asked for none."""
    if settings.sandbox == "none":
        log.warning(
            "!!! SANDBOX DISABLED (--sandbox none): untrusted graphs are unpickled and "
            "compiled without isolation, with this worker's privileges. Use only with "
            "clients you trust. !!!"
        )
        return
    if settings.sandbox != "bwrap":
        raise SystemExit(f"torchfarm worker: unknown sandbox {settings.sandbox!r}")
    if not shutil.which("bwrap"):
        raise SystemExit(
            "torchfarm worker: bubblewrap (bwrap) not found: install it (apt-get install "
            "bubblewrap) or run with --sandbox none (compiles untrusted graphs unconfined)"
        )
    problem = _self_check(settings)
    if problem:
        raise SystemExit(
            f"torchfarm worker: cannot build the compile sandbox ({problem}); see "
            "docs/self-hosting.md, or run with --sandbox none (compiles untrusted graphs "
            "unconfined)"
        )
    if settings.device == "cuda":
        log.warning(
            "compile children on CUDA have no memory cap (address-space limits break "
            "CUDA): give the worker's container a memory limit"
        )


# Run by the self-check inside the sandbox: confined as promised, and the child importable.
_SELF_CHECK = """
import os, torchfarm.workers.compile_child
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
caps = [int(status[k], 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")]
assert os.getuid() != 0 and not any(caps), status
assert not os.access("/", os.W_OK)
"""


def _self_check(settings: WorkerSettings) -> str:
    """Run the compile child's full sandbox on a tiny check; what went wrong, or ""."""
    cmd, env, cwd = child_command(settings, "", ("-c", _SELF_CHECK))
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return f"exit {proc.returncode}: {lines[-1] if lines else ''}" if proc.returncode else ""


def limits(settings: WorkerSettings) -> list[str]:
    """The argv prefix that sets a child's resource limits (util-linux's prlimit, then exec):
    applied without a preexec_fn, so no Python runs between fork and exec in a parent that
    may hold other threads (gRPC's, Celery's)."""
    memory_mb = settings.memory_limit_mb if settings.device != "cuda" else 0
    # CUDA reserves far more address space than it uses: RLIMIT_AS would stop it starting.
    address_space = [f"--as={memory_mb << 20}"] if memory_mb > 0 else []
    return ["prlimit", *address_space, "--core=0", "--"]


def _how_it_ended(returncode: int, sandbox: str) -> str:
    """`exit N`, or the signal that killed the child (bwrap reports that as exit 128 + N)."""
    signum = (
        -returncode
        if returncode < 0
        else (returncode - 128 if sandbox == "bwrap" and returncode > 128 else 0)
    )
    try:
        return (
            f"killed by signal {signum} ({signal.Signals(signum).name})"
            if signum
            else f"exit {returncode}"
        )
    except ValueError:  # not a signal number after all
        return f"exit {returncode}"


class _ChildInput:
    """What the parent writes to a child's stdin, each length-prefixed: its request, then the
    answers to the pool builds it asks for (ChildSpec.pool_build), each built in a thread of
    its own, at most MAX_POOL_BUILDS_ASKED at once (more are answered False at once). The pipe
    stays open until the child is closed; once `close`d, nothing more is staged or written."""

    def __init__(
        self,
        stdin: IO[bytes],
        pool_build: Callable[[pb.KernelSource], tuple[str, list[str]]] | None,
        staging: str,
    ) -> None:
        self.stdin, self.pool_build, self.staging = stdin, pool_build, staging
        self.lock = threading.Lock()
        self.asked = threading.BoundedSemaphore(MAX_POOL_BUILDS_ASKED)
        self.closed = False
        self.staged: list[str] = []  # the objects the pool built for the child and staged

    def feed(self, request: bytes) -> None:
        self._write(request)

    def ask(self, build: pb.PoolBuild) -> None:
        if self.pool_build is None or not self.staging or not self.asked.acquire(blocking=False):
            self._write(pb.PoolBuilt(id=build.id).SerializeToString())
            return
        threading.Thread(target=self._build, args=(build,), daemon=True).start()

    def _build(self, build: pb.PoolBuild) -> None:
        names: list[str] = []
        try:
            assert self.pool_build is not None
            # As the worker reads it: fields it does not know would make another marker
            # for the same source (a rebuild a child could force).
            build.source.DiscardUnknownFields()
            built_in, built = self.pool_build(build.source)
            with self.lock:  # never into a staging dir the child has left
                if not self.closed:
                    names = kernel_cache.stage_built(built_in, built, self.staging)
                    self.staged += names
        except Exception:
            log.exception("a pool build a compile asked for failed")
        finally:
            self.asked.release()
        self._write(pb.PoolBuilt(id=build.id, staged=bool(names)).SerializeToString())

    def _write(self, data: bytes) -> None:
        with self.lock:
            if self.closed:
                return
            try:
                self.stdin.write(FRAME.pack(len(data)) + data)
                self.stdin.flush()
            except (OSError, ValueError):  # the child has ended: its exit status says why
                pass

    def close(self) -> None:
        with self.lock:
            self.closed = True


MAX_POOL_BUILDS_ASKED = max(2, os.cpu_count() or 1)  # a compile builds on its host's cores


def _read_reports(
    stream: IO[bytes],
    settings: WorkerSettings,
    on_stage: Callable[[pb.Progress.Stage.ValueType], None] | None,
    kernels: pb.KernelFiles | None = None,
    asks: _ChildInput | None = None,
) -> bytes | None:
    """Read the child's reports until its artifact (returned) or the end of the stream; the
    kernels it reports go into `kernels`, the pool builds it asks for to `asks`."""
    while True:
        head = stream.read(FRAME.size)
        if len(head) < FRAME.size:
            return None
        (size,) = FRAME.unpack(head)
        if size > settings.max_artifact_bytes + 16:  # the artifact field's own tag and length
            raise CompileFailed(
                f"compile child's artifact is over {settings.max_artifact_bytes} bytes "
                f"({size} bytes sent; TORCHFARM_MAX_ARTIFACT_BYTES)",
                lasting=True,
            )
        data = stream.read(size)
        if len(data) < size:
            return None
        try:
            message = pb.CompileChildReport.FromString(data)  # protobuf parse: no code runs
        except Exception:
            raise CompileFailed("compile child sent a malformed report", lasting=True) from None
        if message.WhichOneof("report") == "artifact":
            if len(message.artifact) > settings.max_artifact_bytes:
                raise CompileFailed(
                    f"compile child's artifact is {len(message.artifact)} bytes, over "
                    f"{settings.max_artifact_bytes} (TORCHFARM_MAX_ARTIFACT_BYTES)",
                    lasting=True,
                )
            return message.artifact
        if message.WhichOneof("report") == "kernels" and kernels is not None:
            kernels.CopyFrom(message.kernels)
        elif message.WhichOneof("report") == "build" and asks is not None:
            asks.ask(message.build)
        elif size <= _MAX_STAGE_FRAME and message.stage in _STAGES and on_stage:
            on_stage(message.stage)


@dataclasses.dataclass(frozen=True)
class ChildSpec:
    """One compile for a child of the pool: what to compile, and what the caller hears.
    `on_stage(stage)` hears the child's Progress.Stage (COMPILING / AUTOTUNING) as it changes;
    `abandoned()`, asked every ABANDON_CHECK_S, stops the child once it has said True twice in
    a row (nobody waits for the result any more); `timeout_s` (else the settings') runs from
    the call, a child still warming up included. `kernels_from`: kernel cache directories
    (workers/kernel_cache.py) staged for the child, the first one's objects winning; the child
    then reports the objects it built (`report_built`) or the sources of the libraries it
    built (`report_sources`). `pool_build(source)`, for a shared job: the pool builds a C++
    library the child asks for during its compile; the directory it keeps it in and the
    objects' names there ([] where it did not), which are then staged for the child."""

    payload: bytes
    target: pb.Target
    options: pb.Options
    size_hints: Mapping[str, int] = dataclasses.field(default_factory=dict)
    float_hints: Mapping[str, float] = dataclasses.field(default_factory=dict)
    descriptor: bytes = b""  # the Job's: the child compiles the payload only if it has it
    on_stage: Callable[[pb.Progress.Stage.ValueType], None] | None = None
    abandoned: Callable[[], bool] | None = None
    timeout_s: float | None = None
    kernels_from: tuple[str, ...] = ()
    report_built: bool = False
    report_sources: bool = False
    pool_build: Callable[[pb.KernelSource], tuple[str, list[str]]] | None = None

    def request(self, settings: WorkerSettings) -> pb.CompileChildRequest:
        return pb.CompileChildRequest(
            graph=self.payload,
            target=self.target,
            options=self.options,
            size_hints=self.size_hints,
            float_hints=self.float_hints,
            descriptor=self.descriptor,
            op_libraries=_op_libraries(settings),
            kernel_cache=self.report_built,
            kernel_sources=self.report_sources,
            pool_builds=self.pool_build is not None,
        )


@dataclasses.dataclass(frozen=True)
class ChildResult:
    """What a compile child handed back: the Artifact's protobuf bytes, the seconds from
    the request until a ready child had it (the hand-off; ~0 when a warm child waited), and
    the C++ objects it reported for its tenant's kernel cache (hostile: the caller checks),
    and the objects the pool built for it during its compile (ChildSpec.pool_build)."""

    data: bytes
    handoff_s: float
    kernels: pb.KernelFiles
    pool_built: tuple[str, ...] = ()


_pool_lock = threading.Lock()  # Celery's threads may ask for the pool at once


def pool(settings: WorkerSettings) -> child_pool.ChildPool:
    """This worker process's pool of warm compile children (one per settings), started on
    first use and killed at exit."""
    with _pool_lock:
        return _pool(settings)


def forks_children(settings: WorkerSettings) -> bool:
    """Whether the pool keeps warm parents that fork the children: on CPU. A CUDA process
    cannot fork once its context exists (and a child's warm-up makes it), so GPU pools start
    one child per request."""
    return settings.device == "cpu"


@functools.cache
def _pool(settings: WorkerSettings) -> child_pool.ChildPool:
    started = child_pool.ChildPool(
        settings.warm_children,
        functools.partial(_pool_command, settings),
        settings.warm_up_timeout_s,
        events=child_pool.Events(
            ready=metrics.warm_children_ready, replaced=metrics.replaced, taken=metrics.taken
        ),
        reuse=_reusable if forks_children(settings) else None,
    )
    atexit.register(started.close)
    log.info(
        "compiles at once: %d (TORCHFARM_WORKER_CONCURRENCY); compile children kept warm: %d "
        "(TORCHFARM_WARM_CHILDREN)",
        settings.concurrency,
        settings.warm_children,
    )
    metrics.configured(settings.concurrency, settings.warm_children)
    return started


def _pool_command(settings: WorkerSettings, number: int, private_dir: str):
    forks = forks_children(settings)
    if forks:
        _parents_started_as[private_dir] = _started_as()
    return child_command(settings, private_dir, number=number, fork_server=forks)


# What of a child's command changes during a worker's life, as each warm parent started
# with it (by its private dir): the ISA probe's verdict, the precompiled headers once built.
_parents_started_as: dict[str, tuple] = {}


def _started_as() -> tuple:
    return (
        tuple(isa_verdict.child_arguments()),
        tuple(sorted(isa_verdict.child_environment().items())),
        tuple(precompiled_headers.child_binds(WORK_DIR, CHILD_USER)),
        tuple(sorted(precompiled_headers.child_environment().items())),
    )


def _reusable(private_dir: str) -> bool:
    """Before a warm parent serves its next request: it was started as a child would be now
    (else it is ended, and the next one gets the headers built since), and its staging dir
    (bound into its sandbox at start) is emptied of the last tenant's objects."""
    if _parents_started_as.get(private_dir) != _started_as():
        _parents_started_as.pop(private_dir, None)
        return False
    staging = staging_dir(private_dir)
    if not os.path.isdir(staging):
        return True
    try:
        kernel_cache.unhide(staging)
        for entry in os.listdir(staging):
            path = os.path.join(staging, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        if not os.listdir(staging):
            return True
    except OSError:
        log.warning("could not empty a warm parent's staging dir: ending it", exc_info=True)
    _parents_started_as.pop(private_dir, None)
    return False


def run_compile(spec: ChildSpec, settings: WorkerSettings) -> ChildResult:
    """Compile `spec` in a sandboxed child of the warm pool: the Artifact's protobuf bytes,
    the hand-off wait and the kernels the child reported; CompileFailed says how it failed."""
    timeout_s = spec.timeout_s or settings.compile_timeout_s
    called = time.perf_counter()
    child = pool(settings).take()
    staging = _stage(child, spec.kernels_from, settings)
    child_input = _ChildInput(child.stdin, spec.pool_build, staging)
    request = spec.request(settings).SerializeToString()
    feeder = threading.Thread(target=child_input.feed, args=(request,), daemon=True)
    feeder.start()
    stops = _Stops(child, timeout_s, spec.abandoned)
    stops.start()
    handoff_s, kernels, data = 0.0, pb.KernelFiles(), None
    try:
        ready = child.wait_ready()  # a warm child at once; else its warm-up, or its end
        handoff_s = time.perf_counter() - called
        data = (
            _read_reports(child.stdout, settings, spec.on_stage, kernels, child_input)
            if ready
            else None
        )
        if data is not None:
            # The artifact is whole: the child has nothing left to give, and its own exit
            # (interpreter and torch teardown, ~1.4 s measured) is not worth waiting for.
            child.kill()
    except CompileFailed:
        child.kill()
        raise
    finally:
        returncode = child.proc.wait()  # the timer still ends a child that lingers
        stops.end()
        feeder.join(timeout=5)
        child_input.close()
        if staging:
            kernel_cache.unhide(staging)
        child.close()
    stops.raise_if_stopped(data is not None)
    if data is None:
        how = _how_it_ended(returncode, settings.sandbox)
        text = child.error_text()
        raise CompileFailed(f"compile child failed ({how}):\n{text}", lasting=returncode == 1)
    artifact = pb.Artifact.FromString(data)  # protobuf parse: no code runs
    if not (artifact.inductor or artifact.package):
        raise CompileFailed("compile child returned an empty artifact")
    metrics.handoff(handoff_s)
    return ChildResult(data, handoff_s, kernels, tuple(child_input.staged))


def _stage(child: child_pool.Child, kernels_from: tuple[str, ...], settings: WorkerSettings) -> str:
    """Stage the kernel cache directories `kernels_from` for `child`; its staging directory
    ("" where the kernel cache is off)."""
    staging = staging_dir(child.private_dir) if settings.kernel_cache_mb else ""
    if staging:
        try:
            for directory in kernels_from:
                kernel_cache.stage(directory, staging)
            kernel_cache.hide(staging)
        except OSError as e:  # the compile goes on with what was staged
            log.warning("could not stage the kernels: %s", e)
    return staging
