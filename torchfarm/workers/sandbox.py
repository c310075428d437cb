"""Run one compile in a child process that can do nothing else.

The child gets a fresh private directory (its Inductor and Triton caches live there), no
network (bubblewrap `--unshare-net`), a read-only view of the system, an empty environment
apart from what compiling needs, resource limits and a wall-clock timeout. It hands back an
Artifact as protobuf bytes; the parent parses them as protobuf only.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from google.protobuf import json_format

from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import WorkerSettings

log = logging.getLogger("torchfarm.worker")
STAGES = ("compiling", "autotuning")  # what the child may report in workdir/stage
STAGE_POLL_S = 0.5


class CompileFailed(RuntimeError):
    """The compile child failed, crashed or ran out of time; the message says which.
    `lasting`: the child raised, so compiling the same job again would fail the same way."""

    def __init__(self, message: str, lasting: bool = False) -> None:
        super().__init__(message)
        self.lasting = lasting


def check_available(settings: WorkerSettings) -> None:
    """Refuse to run without a sandbox unless the operator asked for that explicitly."""
    if settings.sandbox == "bwrap":
        if not shutil.which("bwrap"):
            raise SystemExit(
                "torchfarm worker: bubblewrap (bwrap) not found. Install it "
                "(apt-get install bubblewrap) or run with --sandbox none "
                "(compiles untrusted graphs unconfined)."
            )
    elif settings.sandbox == "none":
        log.warning(
            "!!! SANDBOX DISABLED: untrusted graphs are unpickled and compiled without "
            "isolation. Use only with clients you trust. !!!"
        )
    else:
        raise SystemExit(f"torchfarm worker: unknown sandbox {settings.sandbox!r}")


def _code_paths_under_tmp() -> list[str]:
    """Python and torchfarm may live under /tmp (a CI clone); keep them visible, read-only."""
    import torchfarm

    paths = {
        sys.prefix,
        sys.base_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
        os.path.dirname(os.path.dirname(os.path.abspath(torchfarm.__file__))),
        *(p for p in sys.path if p and os.path.isdir(p)),
    }
    return sorted(p for p in paths if p.startswith("/tmp/"))


def _bwrap(workdir: str, device: str) -> list[str]:
    cmd = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    for path in _code_paths_under_tmp():
        cmd += ["--ro-bind", path, path]
    cmd += [
        "--bind",
        workdir,
        workdir,
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--die-with-parent",
        "--new-session",
    ]
    if device == "cuda":  # autotuning benchmarks need the GPU, and nothing else
        for node in sorted(os.listdir("/dev")):
            if node.startswith("nvidia"):
                cmd += ["--dev-bind", f"/dev/{node}", f"/dev/{node}"]
    return cmd


def _run_reporting(
    cmd: list[str], workdir: str, settings: WorkerSettings, on_stage: Callable[[str], None] | None
) -> tuple[int, str]:
    """Run the child to its end or the timeout, passing on each new stage it writes to
    workdir/stage; its exit status and stderr."""
    stage_path, seen = os.path.join(workdir, "stage"), ""
    deadline = time.monotonic() + settings.compile_timeout_s
    with tempfile.TemporaryFile() as stderr:  # outside the child's view
        proc = subprocess.Popen(
            cmd,
            env=_environment(workdir),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            preexec_fn=_limits(settings.memory_limit_mb, settings.device),
        )
        while True:
            try:
                proc.wait(timeout=min(STAGE_POLL_S, max(0.0, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    proc.kill()
                    proc.wait()
                    raise CompileFailed(
                        f"{TIMED_OUT}compile exceeded {settings.compile_timeout_s:.0f} s "
                        "(TORCHFARM_COMPILE_TIMEOUT_WORKER)"
                    ) from None
            stage = _read_stage(stage_path)
            if on_stage and stage and stage != seen:
                seen = stage
                on_stage(stage)
        stderr.seek(0)
        return proc.returncode, stderr.read()[-64_000:].decode(errors="replace")


def _read_stage(path: str) -> str:
    """The child's current stage, if it wrote a known one (it is hostile: nothing else)."""
    try:
        with open(path, "rb") as f:
            stage = f.read(32).decode(errors="replace")
    except OSError:
        return ""
    return stage if stage in STAGES else ""


def _limits(memory_mb: int, device: str):
    # CUDA reserves far more address space than it uses: RLIMIT_AS would stop it starting.
    if memory_mb > 0 and device == "cuda":
        log.warning(
            "TORCHFARM_COMPILE_MEMORY_MB is ignored on CUDA workers (address-space "
            "limits break CUDA); limit the worker's container memory instead"
        )
        memory_mb = 0

    def apply() -> None:
        if memory_mb > 0:
            limit = memory_mb << 20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _environment(workdir: str) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": workdir,
        "TMPDIR": os.path.join(workdir, "tmp"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(workdir, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(workdir, "triton"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    for name in ("PYTHONPATH", "CXX", "CC", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_VISIBLE_DEVICES"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


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


# Prefix of a job error that the gateway turns into DEADLINE_EXCEEDED (others: ABORTED).
TIMED_OUT = "DEADLINE_EXCEEDED: "


def run_compile(
    payload: bytes,
    target: pb.Target,
    options: pb.Options,
    size_hints: dict[str, int],
    settings: WorkerSettings,
    on_stage: Callable[[str], None] | None = None,
) -> bytes:
    """Compile `payload` for `target` in a sandboxed child; the Artifact's protobuf bytes.
    `on_stage(stage)` hears the child's stage (compiling / autotuning) as it changes."""
    with tempfile.TemporaryDirectory(prefix="torchfarm-compile-") as workdir:
        os.makedirs(os.path.join(workdir, "tmp"))
        with open(os.path.join(workdir, "payload.bin"), "wb") as f:
            f.write(payload)
        with open(os.path.join(workdir, "request.json"), "w") as f:
            f.write(
                json_format.MessageToJson(
                    pb.CompileRequest(target=target, options=options, size_hints=size_hints)
                )
            )
        with open(os.path.join(workdir, "op_libraries"), "w") as f:
            f.write(settings.op_libraries)
        cmd = [sys.executable, "-m", "torchfarm.workers.compile_child", workdir]
        if settings.sandbox == "bwrap":
            cmd = _bwrap(workdir, settings.device) + cmd
        returncode, stderr = _run_reporting(cmd, workdir, settings, on_stage)
        out_path = os.path.join(workdir, "artifact.pb")
        if returncode != 0 or not os.path.exists(out_path):
            how = _how_it_ended(returncode, settings.sandbox)
            raise CompileFailed(
                f"compile child failed ({how}):\n{stderr[-3000:]}", lasting=returncode == 1
            )
        with open(out_path, "rb") as f:
            data = f.read()
    artifact = pb.Artifact.FromString(data)  # protobuf parse: no code runs
    if not artifact.inductor:
        raise CompileFailed("compile child returned an empty artifact")
    return data
