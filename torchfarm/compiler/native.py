"""Ship Inductor's compiled C++ objects with the artifact, so that a hit runs no compiler.

On CPU a CompiledArtifact holds C++ source; loading it runs g++ (seconds) and Inductor's
ISA probe. The worker records every object its output code loads, keyed by the sha256 of
its source; the client serves those objects to Inductor's loader instead of compiling. The
libraries of the C++ template candidates that max-autotune benchmarked stay out (a bmm's
training entry was 4.3x its default-mode one with them, issue 52).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator

from torchfarm.compiler import files
from torchfarm.errors import TorchfarmError
from torchfarm.torch_adapter.compile import cpp_libraries


class MissingNativeObject(TorchfarmError, RuntimeError):
    """The artifact lacks an object its code needs; the caller falls back to compiling."""


def _source_digest(main_code: str, optimized_code: str | None) -> str:
    """Names one library: its main source plus the kernel source linked into it."""
    h = hashlib.sha256(main_code.encode())
    h.update(b"\0" + (optimized_code or "").encode())
    return h.hexdigest()


@contextlib.contextmanager
def capture(objects: dict[str, bytes]) -> Iterator[dict[str, bytes]]:
    """Worker side: record into `objects` every C++ library Inductor builds and loads, but
    those only a benchmarked candidate loaded (left out on leaving)."""
    candidates: set[str] = set()
    used: set[str] = set()

    def load_async(cls, original, main_code, *args, optimized_code=None, **kwargs):
        load = original(cls, main_code, *args, optimized_code=optimized_code, **kwargs)
        digest = _source_digest(main_code, optimized_code)
        (candidates if benchmarking() else used).add(digest)

        def load_and_record():
            lib = load()
            with open(cpp_libraries.library_path(lib), "rb") as f:
                objects[digest] = f.read()
            return lib

        return load_and_record

    with (
        cpp_libraries.benchmarks_marked() as benchmarking,
        cpp_libraries.wrapped_load_async(load_async),
    ):
        yield objects
    for digest in candidates - used:
        objects.pop(digest, None)


@contextlib.contextmanager
def provide(
    objects: dict[str, bytes], directory: str, timings: dict[str, float] | None = None
) -> Iterator[None]:
    """Client side: load C++ libraries from `objects` (written under `directory`: `dlopen`
    takes a path), never g++. Adds the time it took to `timings["load_native_s"]`."""
    spent = timings if timings is not None else {}

    def load_async(cls, original, main_code, *args, optimized_code=None, **kwargs):
        started = time.perf_counter()
        digest = _source_digest(main_code, optimized_code)
        binary = objects.get(digest)
        if binary is None:
            raise MissingNativeObject(f"artifact has no object for C++ source {digest[:12]}")
        path = os.path.join(directory, f"{digest}.so")
        if not os.path.exists(path):
            files.write_atomically(path, binary)
        lib = cpp_libraries.load_library(cls, path, f"torchfarm_{digest[:32]}")
        spent["load_native_s"] = spent.get("load_native_s", 0.0) + time.perf_counter() - started
        return lambda: lib

    with cpp_libraries.wrapped_load_async(load_async):
        yield
