"""Where Inductor builds and loads the C++ library of a CPU kernel: CppCodeCache.load_async.

`wrapped_load_async(replacement)` replaces the classmethod while entered; the replacement
gets `(cls, original, main_code, *args, optimized_code=None, **kwargs)` and returns what
load_async returns (a callable giving the library). `load_library` is Inductor's own
dlopen of a built file. `build` runs the builds of one load_async, and loads nothing (a
pool's kernel builds: workers/kernel_builder.py). `remember_headers` computes, in a warm
process, the precompiled-header keys that every load_async otherwise computes anew in each
process forked from it.

Uses torch._inductor.codecache.CppCodeCache.load_async (signature main_code, device_type,
submit_fn, extra_flags, optimized_code[, needs_vec_isa, kernel_needs_vec_isa]: not on 2.11/2.12),
the same on CppPythonBindingsCodeCache, and CppCodeCache._load_library. `benchmarks_marked` wraps
torch._inductor.autotune_process.CppBenchmarkRequest.precompile and make_run_fn (each builds
the candidate's library with CppCodeCache.load, in the calling thread). Verified: torch
2.11.0, 2.13.0, 2.15.0. `sources_written` wraps codecache.write(content, extension, ...) ->
(basename, path): checked on 2.13.0 only. `remember_headers` uses
codecache._precompile_header(header, hashable_cmd_line, **compile_command) (functools.cache'd;
load_async calls it by its module-level name) and _worker_compile_cpp(lock_path, builders),
which it calls to build the header: checked on 2.11.0 (no vector-ISA keywords) and 2.13.0.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torch._inductor import codecache

from torchfarm.errors import TorchfarmError


def load_library(cls: Any, path: str, key: str) -> object:
    """dlopen a built library as Inductor's cache class `cls` does (a module or a CDLL)."""
    return cls._load_library(path, key)


def library_path(lib: Any) -> str:
    """The file a loaded library came from."""
    return getattr(lib, "__file__", None) or lib._name  # module or ctypes.CDLL


def build(
    code_cache: str,
    main_code: str,
    optimized_code: str | None,
    needs_vec_isa: bool | None,
    kernel_needs_vec_isa: bool | None,
) -> None:
    """Build the objects of one library as Inductor's class `code_cache` (CppCodeCache,
    CppPythonBindingsCodeCache) does for a compile: load_async's builds, run now; the loader
    it returns is never called, so nothing built is loaded."""
    builds: list = []  # run after load_async, which holds the lock that a build takes
    cls = getattr(codecache, code_cache)
    cls.load_async(
        main_code,
        "cpu",
        submit_fn=builds.append,
        optimized_code=optimized_code,
        **_vec_isa_keywords(cls, needs_vec_isa, kernel_needs_vec_isa),
    )
    for build_now in builds:
        build_now()


def _vec_isa_keywords(cls: Any, needs: bool | None, kernel_needs: bool | None) -> dict:
    """load_async's vector-ISA keywords, where this torch has them (not 2.11's nor 2.12's)."""
    if "needs_vec_isa" not in inspect.signature(cls.load_async).parameters:
        return {}
    return {"needs_vec_isa": needs, "kernel_needs_vec_isa": kernel_needs}


class _NotBuilt(TorchfarmError):
    """A precompiled header that is not built here: its key is not remembered."""


def _built_only(lock_path: str, builders: Any) -> None:
    if not all(os.path.exists(b.get_target_file_path()) for b in builders):
        raise _NotBuilt(lock_path)


def remember_headers(code_caches: tuple[str, ...]) -> int:
    """In this process, Inductor's key of each precompiled header that a library of
    `code_caches` can ask for (the header run through g++ -E and hashed: ~0.4 s, and the
    compiler's version), where that header is built already; how many. Inductor keeps them for
    the process's life (functools.cache), so a process forked from this one builds with them at
    once instead of paying that per library. Builds nothing (a header not built is left to the
    build that asks for it) and loads nothing; what load_async wrote goes to the cache dir."""
    precompile = codecache._precompile_header
    missing: set[str] = set()
    remembered: set[str] = set()

    def known(header: str, cmd_line: str, **command: Any) -> str:
        variant = repr((header, cmd_line, sorted(command.items())))
        if variant in missing:  # asked again by another combination: no second g++ -E
            raise _NotBuilt(header)
        try:
            path = precompile(header, cmd_line, **command)
        except _NotBuilt:
            missing.add(variant)
            raise
        remembered.add(variant)
        return path

    saved = precompile, codecache._worker_compile_cpp
    setattr(codecache, "_precompile_header", known)  # noqa: B010
    setattr(codecache, "_worker_compile_cpp", _built_only)  # noqa: B010
    try:
        for name, optimized, needs, kernel_needs in itertools.product(
            code_caches, (None, "\n"), (True, False), (True, False)
        ):
            cls = getattr(codecache, name)
            isa = _vec_isa_keywords(cls, needs, kernel_needs)
            if not isa and (needs, kernel_needs) != (True, True):
                continue  # a torch without them: one variant per class and optimized_code
            with contextlib.suppress(_NotBuilt):  # its builds are never run
                cls.load_async(
                    "\n", "cpu", submit_fn=lambda build: None, optimized_code=optimized, **isa
                )
    finally:
        codecache._precompile_header, codecache._worker_compile_cpp = saved
        for name in code_caches:  # no loader of these sources left for a real build to find
            getattr(codecache, name).cache.clear()
    return len(remembered)


@contextlib.contextmanager
def wrapped_load_async(replacement: Callable) -> Iterator[None]:
    """CppCodeCache.load_async(...) calls `replacement(cls, original, ...)` while entered;
    `inspect.signature(original)` is Inductor's, however many replacements are nested."""
    saved = codecache.CppCodeCache.__dict__["load_async"]
    original = saved.__func__

    def load_async(cls, main_code, *args, **kwargs):
        return replacement(cls, original, main_code, *args, **kwargs)

    load_async.__wrapped__ = original  # type: ignore[attr-defined]  # its signature, nested too
    setattr(codecache.CppCodeCache, "load_async", classmethod(load_async))  # noqa: B010
    try:
        yield
    finally:
        setattr(codecache.CppCodeCache, "load_async", saved)  # noqa: B010


@contextlib.contextmanager
def sources_written(callback: Callable[[str], None]) -> Iterator[None]:
    """`callback(path)` after Inductor writes each C++ source into its cache dir
    (`<dir>/<2 chars>/<key>.<kind>.cpp`), which is before it looks for the objects built from
    it (`<key>.<kind>.so|.o` beside it) and builds the missing ones. Uses codecache.write,
    which load_async calls by its module-level name."""
    original = codecache.write

    def write(content, extension, *args, **kwargs):
        basename, path = original(content, extension, *args, **kwargs)
        if extension.endswith("cpp"):
            callback(path)
        return basename, path

    codecache.write = write
    try:
        yield
    finally:
        codecache.write = original


@contextlib.contextmanager
def benchmarks_marked() -> Iterator[Callable[[], bool]]:
    """While entered, the function it gives tells whether the calling thread is building or
    loading the library of a C++ template candidate that max-autotune benchmarks (not a
    kernel of the output code: a chosen template is rendered into it anew)."""
    # a compile's import (Inductor's IR and AOTAutograd's compile path): a load never needs it
    from torch._inductor.autotune_process import CppBenchmarkRequest

    inside = threading.local()
    saved = {name: CppBenchmarkRequest.__dict__[name] for name in ("precompile", "make_run_fn")}

    def marked(method):
        @functools.wraps(method)
        def run(*args, **kwargs):
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                return method(*args, **kwargs)
            finally:
                inside.depth -= 1

        return run

    for name, method in saved.items():
        setattr(CppBenchmarkRequest, name, marked(method))
    try:
        yield lambda: getattr(inside, "depth", 0) > 0
    finally:
        for name, method in saved.items():
            setattr(CppBenchmarkRequest, name, method)
