"""Where Inductor builds and loads the C++ library of a CPU kernel: CppCodeCache.load_async.

`wrapped_load_async(replacement)` replaces the classmethod while entered; the replacement
gets `(cls, original, main_code, *args, optimized_code=None, **kwargs)` and returns what
load_async returns (a callable giving the library). `load_library` is Inductor's own
dlopen of a built file.

Uses torch._inductor.codecache.CppCodeCache.load_async (signature main_code, device_type,
submit_fn, extra_flags, optimized_code[, needs_vec_isa, kernel_needs_vec_isa]) and
CppCodeCache._load_library. Verified: torch 2.11.0, 2.13.0, 2.15.0. `sources_written` wraps
codecache.write(content, extension, ...) -> (basename, path): checked on 2.13.0 only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch._inductor import codecache


def load_library(cls: Any, path: str, key: str) -> object:
    """dlopen a built library as Inductor's cache class `cls` does (a module or a CDLL)."""
    return cls._load_library(path, key)


def library_path(lib: Any) -> str:
    """The file a loaded library came from."""
    return getattr(lib, "__file__", None) or lib._name  # module or ctypes.CDLL


@contextlib.contextmanager
def wrapped_load_async(replacement: Callable) -> Iterator[None]:
    """CppCodeCache.load_async(...) calls `replacement(cls, original, ...)` while entered."""
    saved = codecache.CppCodeCache.__dict__["load_async"]
    original = saved.__func__

    def load_async(cls, main_code, *args, **kwargs):
        return replacement(cls, original, main_code, *args, **kwargs)

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
