"""Per-toolchain work done once per worker, off its start-up path, reused by every child.

Inductor does some work once per cache dir that depends only on the machine and the
toolchain: the vector-ISA probe (torch_adapter/worker/isa_probe.py) and the precompiled C++ header
(torch_adapter/worker/precompiled_headers.py). A compile child starts in a fresh private cache dir,
so it would redo both on every compile (~12 s and ~25 s here). The worker does them once in
the background, in that order (the header's flags follow the ISA the children pick); a child
started before they are in compiles without them, a little slower, never differently. Both
are kept per toolchain, so a worker whose toolchain has them does neither.

The headers are kept per toolchain (TORCHFARM_TOOLCHAIN_CACHE, default
~/.cache/torchfarm/toolchain/<id>, ~150 MB each; the probe's agreement in <id>.vec-isa-ok
beside them): a restarted worker, or another worker of the
same machine and toolchain, binds them at once instead of building again. The id covers what
Inductor's header key covers (torch build, compiler, CPU, interpreter), so a stale store only
names headers a child's Inductor does not look for: it builds its own, never uses a wrong one.
Only the worker's trusted build child, compiling the worker's own kernel, writes there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable

from torchfarm.settings import WorkerSettings, env
from torchfarm.torch_adapter.worker import precompiled_headers
from torchfarm.workers import isa_verdict, sandbox

log = logging.getLogger("torchfarm.worker")

ISA_VERDICT_SUFFIX = ".vec-isa-ok"  # beside the header store: isa_verdict.py's kept agreement
HEADER_BUILD_TIMEOUT_S = 900  # ~25 s alone on the 2-core machine, more beside compiles


def start_in_background(
    settings: WorkerSettings, then: Callable[[WorkerSettings], None] | None = None
) -> None:
    """Worker main process, before its pool forks: probe the ISA, then build the headers,
    then (whether they were built or not) call `then(settings)`."""
    marker = isa_verdict.declare()
    headers = store_dir()
    precompiled_headers.set_store(headers)
    kept_verdict = headers + ISA_VERDICT_SUFFIX
    vouched = isa_verdict.recall(marker, kept_verdict)  # before the canary's child starts

    def prepare_then() -> None:
        try:
            prepare()
        finally:
            if then is not None:
                then(settings)

    def prepare() -> None:
        if not vouched:
            isa_verdict.settle(marker, kept_verdict)
        if settings.sandbox != "bwrap":  # unconfined children have no binds: no headers
            return
        if precompiled_headers.child_binds(sandbox.WORK_DIR, sandbox.CHILD_USER):
            log.info("precompiled headers ready for compile children (kept): %s", headers)
            return
        building = tempfile.mkdtemp(prefix=".build-", dir=os.path.dirname(headers))
        try:
            build_headers(settings, building)
            _publish(building, headers)
            log.info("precompiled headers ready for compile children: %s", headers)
        except (OSError, subprocess.SubprocessError, RuntimeError, ValueError, IndexError) as e:
            log.warning("precompiled headers not built, compiles go on without them: %s", e)
        finally:
            shutil.rmtree(building, ignore_errors=True)

    threading.Thread(target=prepare_then, name="toolchain-prep", daemon=True).start()


def store_dir() -> str:
    """This toolchain's header store (created); a private temporary one where the cache root
    cannot be written."""
    root = env.get("TOOLCHAIN_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "torchfarm", "toolchain"
    )
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
    except OSError:
        root = tempfile.mkdtemp(prefix="torchfarm-toolchain-")
    return os.path.join(root, toolchain_id())


def toolchain_id() -> str:
    """What Inductor's header key depends on, hashed: torch build, C++ compiler, CPU,
    interpreter and environment prefix (the -I paths)."""
    import torch

    compiler = shutil.which(os.environ.get("CXX", "") or "g++") or ""
    stat = os.stat(compiler) if compiler else None
    parts = [
        torch.__version__,
        torch.version.git_version,
        os.path.realpath(compiler) if compiler else "",
        f"{stat.st_size}:{stat.st_mtime_ns}" if stat else "",
        torch.backends.cpu.get_cpu_capability(),
        platform.machine(),
        sys.version,
        sys.prefix,
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _publish(building: str, headers: str) -> None:
    """Move a finished build into place at once; another worker's finished build wins."""
    try:
        os.rename(building, headers)
    except OSError:  # there already (a worker beside this one built it first)
        if not precompiled_headers.child_binds(sandbox.WORK_DIR, sandbox.CHILD_USER):
            shutil.rmtree(headers, ignore_errors=True)
            os.rename(building, headers)


def build_headers(settings: WorkerSettings, directory: str) -> None:
    """Build Inductor's precompiled headers into `directory` in a sandboxed child that differs
    from a compile child only in having the header dir writable (bound to `directory`)."""
    layout = sandbox.HostLayout.probe()
    env = precompiled_headers.build_environment(
        sandbox.child_environment(sandbox.WORK_DIR, sandbox.LIB_DIR, layout.python_path)
    )
    target = precompiled_headers.header_dir(sandbox.WORK_DIR, env["USER"])
    script = [sys.executable, "-c", precompiled_headers.BUILD_SCRIPT, target]
    proc = subprocess.run(
        [*sandbox.bwrap_args(settings, layout), "--bind", directory, target, *script],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=HEADER_BUILD_TIMEOUT_S,
        check=False,
    )
    if proc.returncode:
        raise RuntimeError(f"header build exit {proc.returncode}: {proc.stderr[-1000:]}")
    precompiled_headers.record(directory, json.loads(proc.stdout.strip().splitlines()[-1]))
    log.info("precompiled headers built in %s", directory)
