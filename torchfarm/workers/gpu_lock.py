"""Take a GPU's autotuning measurements one at a time, across a worker's compile processes.

Max-autotune keeps whichever candidate (GEMM template, Triton config, coordinate-descent step)
measured fastest on the compiling GPU. A worker compiles several graphs on one GPU at once
(TORCHFARM_WORKER_CONCURRENCY), and a training graph's backward beside its forward
(torch_adapter/compile/concurrent_backward.py), and the pool's builder measures GEMMs for the
pool (torch_adapter/worker/gemm_problems.py): a timing taken while another process benchmarks
on the same GPU measures both. The lock keeps any two from overlapping. It cannot keep out
work that is not the farm's: a training job on the same GPU (a one-GPU machine's embedded
farm) still runs beside the measurements, and on an H200 that made the farm pick cuBLAS GEMMs
and its host-bound max-autotune step 1.03-1.14x local's, against 0.93-1.01x on a quiet GPU
(docs/benchmarks.md, "max-autotune on the GPU: the bench's own steps").

So each GPU measurement of a compile process holds an exclusive flock on its GPU's lock file,
which the worker creates (`lock_file`) and binds read-only into the sandbox (an flock needs
only a descriptor open for reading). Only measurements wait, never compilation, and none waits
longer than WAIT_S: then it measures anyway, so a stuck holder costs accuracy, never a compile.
A process that dies holding the lock releases it (the kernel drops an flock with its file).
Which of Inductor's benchmarks hold it: torch_adapter/worker/gpu_benchmark_lock.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator

from torchfarm.torch_adapter.worker import gpu_benchmark_lock

log = logging.getLogger("torchfarm.worker")

WAIT_S = 30.0  # the longest a measurement waits for another process's
_POLL_S = 0.002


def lock_file(gpu: str, directory: str = "") -> str:
    """The lock file of `gpu` (as CUDA_VISIBLE_DEVICES names it), created if missing, in
    `directory` (default ~/.cache/torchfarm/gpu-locks): one per GPU for all of a user's
    workers on the host that name it alike. "" where it cannot be made: compiles then measure
    unlocked, as they did before, rather than not start."""
    directory = directory or os.path.join(
        os.path.expanduser("~"), ".cache", "torchfarm", "gpu-locks"
    )
    path = os.path.join(directory, re.sub(r"[^A-Za-z0-9._-]", "_", gpu) + ".lock")
    try:
        os.makedirs(directory, exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
    except OSError as e:
        log.warning("no benchmark lock for GPU %s (%s): its compiles measure unlocked", gpu, e)
        return ""
    return path


class _Lock:
    """This process's hold on one lock file: reentrant (Inductor's benchmark helpers call one
    another), shared by its threads, taken afresh by a forked process (an flock belongs to
    the open file, which a fork would share)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._threads = threading.RLock()
        self._depth = 0
        self._fd = -1

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._threads:
            if self._depth == 0:
                self._take()
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0 and self._fd >= 0:
                    os.close(self._fd)  # releases the flock
                    self._fd = -1

    def _take(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._fd = fd
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    print(
                        f"torchfarm: {self.path} held for more than {WAIT_S:g} s by another "
                        "compile: this autotuning measurement runs beside it",
                        file=sys.stderr,
                    )
                    return
                time.sleep(_POLL_S)


def install(path: str) -> None:
    """From here on, every GPU benchmark of this process's Inductor holds `path`'s lock."""
    gpu_benchmark_lock.install(_Lock(path).held)
