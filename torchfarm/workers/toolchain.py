"""Per-toolchain work done once per worker, off its start-up path, reused by every child.

Inductor does some work once per cache dir that depends only on the machine and the
toolchain: the vector-ISA probe (torch_adapter/isa_probe.py) and the precompiled C++ header
(torch_adapter/precompiled_headers.py). A compile child starts in a fresh private cache dir,
so it would redo both on every compile (~12 s and ~25 s here). The worker does them once in
the background, in that order (the header's flags follow the ISA the children pick); a child
started before they are in compiles without them, a little slower, never differently.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading

from torchfarm.settings import WorkerSettings
from torchfarm.torch_adapter import isa_probe, precompiled_headers
from torchfarm.workers import sandbox

log = logging.getLogger("torchfarm.worker")

HEADER_BUILD_TIMEOUT_S = 900  # ~25 s alone on the 2-core machine, more beside compiles


def start_in_background(settings: WorkerSettings) -> None:
    """Worker main process, before its pool forks: probe the ISA, then build the headers."""
    marker = isa_probe.declare()
    headers = tempfile.mkdtemp(prefix="torchfarm-pch-")  # ~150 MB once built
    precompiled_headers.set_store(headers)
    atexit.register(_remove_in, os.getpid(), headers)

    def prepare() -> None:
        isa_probe.settle(marker)
        if settings.sandbox != "bwrap":  # unconfined children have no binds: no headers
            return
        try:
            build_headers(settings, headers)
        except (OSError, subprocess.SubprocessError, RuntimeError, ValueError, IndexError) as e:
            log.warning("precompiled headers not built, compiles go on without them: %s", e)

    threading.Thread(target=prepare, name="toolchain-prep", daemon=True).start()


def _remove_in(owner: int, directory: str) -> None:
    """At exit of the worker's main process only (its forked pool inherits the hook)."""
    if os.getpid() == owner:
        shutil.rmtree(directory, ignore_errors=True)


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
    log.info("precompiled headers ready for compile children: %s", directory)
