"""A tenant's built C++ kernels, kept on the worker host for that tenant's later compiles.

Inductor names each C++ object after a hash of its source and its compile command (flags,
ISA), and skips the compiler when the file is already in its cache dir: that layout is the
seam. A compile child starts with an empty Inductor cache; for a private job its parent
stages the tenant's objects (hard links) in a directory bound read-only into the child's
sandbox, the child links them into its own cache dir and, after compiling, reports the objects
it built, which the parent keeps for the tenant. Nothing else of Inductor's cache is kept (FX
graph, AOTAutograd, output code, autotune results), so a reused object changes how long a
compile takes, not what it produces.

Per (toolchain, pool, tenant), for private jobs only: a child runs the tenant's code and can
report any bytes under any name, so what a tenant's cache holds is the tenant's to choose, and
may reach only entries that the tenant alone loads (docs/reliability.md, "Kernel reuse").
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import inspect
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator

from torchfarm.proto import torchfarm_pb2 as pb

# `<2 chars>/c<hash>[.main|.optimized].so|.o`, the 2 chars being the hash's first two, as
# Inductor's codecache.write names a C++ source's objects. Nothing else is kept or linked.
_NAME = re.compile(r"([0-9a-z]{2})/c(\1[0-9a-z]{18,62})(?:\.main|\.optimized)?\.(?:so|o)")


def is_kernel_name(name: str) -> bool:
    """A C++ object's path in Inductor's cache dir, and nothing that could leave it."""
    return _NAME.fullmatch(name) is not None


def _names(directory: str) -> list[str]:
    """The kernel objects under `directory`, as `<2 chars>/<file>`: regular files or links."""
    found: list[str] = []
    try:
        subdirs = os.listdir(directory)
    except FileNotFoundError:
        return found
    for sub in subdirs:
        path = os.path.join(directory, sub)
        if len(sub) == 2 and os.path.isdir(path) and not os.path.islink(path):
            found += [f"{sub}/{f}" for f in os.listdir(path) if is_kernel_name(f"{sub}/{f}")]
    return found


# ---- the compile child's side ------------------------------------------------------------
@contextlib.contextmanager
def looking_up(staged: str, cache_dir: str) -> Iterator[None]:
    """While entered, each C++ source Inductor writes into `cache_dir` finds the staged
    objects of its name linked beside it, so Inductor builds none of them. Lookup is by exact
    name: the staging dir cannot be listed (`hide`), so a child reaches only the objects of
    sources it has itself (the names hash the sources)."""
    from torchfarm.torch_adapter import cpp_libraries

    def link(source_path: str) -> None:
        stem = source_path[: -len(".cpp")]
        for suffix in (".so", ".o"):
            name = os.path.relpath(stem + suffix, cache_dir)
            staged_path = os.path.join(staged, name)
            exists = os.path.exists(staged_path) and not os.path.lexists(stem + suffix)
            if is_kernel_name(name) and exists:
                os.symlink(staged_path, stem + suffix)

    with cpp_libraries.sources_written(link):
        yield


@contextlib.contextmanager
def recording(sources: list[pb.KernelSource]) -> Iterator[None]:
    """Record each CPU library Inductor's CppCodeCache classes are asked to build, as the
    pool's kernel builder takes it (extra flags, another device or class: left out)."""
    from torchfarm.torch_adapter import cpp_libraries

    def load_async(cls, original, main_code, device_type="cpu", *args, **kwargs):
        call = inspect.signature(original).bind(cls, main_code, device_type, *args, **kwargs)
        given = call.arguments
        optimized = given.get("optimized_code")
        if device_type == "cpu" and not given.get("extra_flags") and cls.__name__ in CODE_CACHES:
            sources.append(
                pb.KernelSource(
                    code_cache=cls.__name__,
                    main_code=main_code,
                    has_optimized=optimized is not None,
                    optimized_code=optimized or "",
                    needs_vec_isa=_TRISTATE[given.get("needs_vec_isa")],
                    kernel_needs_vec_isa=_TRISTATE[given.get("kernel_needs_vec_isa")],
                )
            )
        return original(cls, main_code, device_type, *args, **kwargs)

    with cpp_libraries.wrapped_load_async(load_async):
        yield


CODE_CACHES = ("CppCodeCache", "CppPythonBindingsCodeCache")  # what a kernel build builds
_TRISTATE = {None: 0, False: 1, True: 2}  # KernelSource.needs_vec_isa


def report(cache_dir: str, staged: str, built: bool = True) -> pb.KernelFiles:
    """The objects this compile built (regular files; with `built`), and the staged libraries
    it loaded (mapped in this process)."""
    files = pb.KernelFiles()
    with open("/proc/self/maps") as f:
        mapped = {line.split(None, 5)[-1].strip() for line in f if "/" in line}
    for name in _names(cache_dir):
        path = os.path.join(cache_dir, name)
        if not os.path.islink(path):
            if built:
                with open(path, "rb") as f:
                    files.built[name] = f.read()
        elif os.path.join(staged, name) in mapped:
            files.reused.append(name)
    return files


# ---- the worker's side -------------------------------------------------------------------
class KernelCache:
    """Each (pool, tenant)'s objects under `root/<toolchain id>/`, at most `max_bytes` each."""

    def __init__(self, root: str, toolchain: str, max_bytes: int) -> None:
        self.root, self.max_bytes = os.path.join(root, toolchain), max_bytes

    def tenant_dir(self, pool: str, tenant: str) -> str:
        """The tenant's directory for `pool` (created, 0700): named by a hash, so no tenant or
        pool name becomes a path."""
        return self._dir(hashlib.sha256(f"{pool}\0{tenant}".encode()).hexdigest()[:32])

    def pool_dir(self, pool: str) -> str:
        """The pool's directory (created, 0700), which only the pool's kernel builds fill
        (workers/kernel_builder.py); its name has a prefix no tenant's hash has."""
        return self._dir("pool-" + hashlib.sha256(pool.encode()).hexdigest()[:32])

    def _dir(self, name: str) -> str:
        path = os.path.join(self.root, name)
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    @staticmethod
    def built_before(pool_dir: str, source: pb.KernelSource) -> bool:
        """Whether a build of `source` stored objects that are all still there."""
        try:
            with open(_source_marker(pool_dir, source)) as f:
                names = f.read().split()
        except FileNotFoundError:
            return False
        return bool(names) and all(
            is_kernel_name(n) and os.path.exists(os.path.join(pool_dir, n)) for n in names
        )

    @staticmethod
    def mark_built(pool_dir: str, source: pb.KernelSource, names: list[str]) -> None:
        """Remember the objects a build of `source` made, so that it is not built again."""
        _write_atomically(_source_marker(pool_dir, source), "\n".join(names).encode())

    def keep(self, tenant_dir: str, files: pb.KernelFiles) -> tuple[int, int]:
        """Store the objects a child of this tenant (or a kernel build of the pool's) built
        (well-formed names only, none over the budget, none already there), mark the ones it
        reused as used now, then prune the least recently used past the budget; (objects
        stored, objects reused)."""
        self.touch(tenant_dir, files.reused)
        stored = 0
        if sum(len(data) for data in files.built.values()) <= self.max_bytes:
            for name, data in files.built.items():
                path = os.path.join(tenant_dir, name)
                if is_kernel_name(name) and not os.path.exists(path):
                    _write_atomically(path, data)
                    stored += 1
        self.prune(tenant_dir)
        return stored, len(files.reused)

    @staticmethod
    def touch(directory: str, names) -> None:
        """Mark the objects `names` of `directory` as used now (least recently used go first)."""
        now = time.time()
        for name in names:
            if is_kernel_name(name):
                try:
                    os.utime(os.path.join(directory, name), (now, now))
                except FileNotFoundError:
                    pass

    def prune(self, tenant_dir: str) -> None:
        """Remove the least recently used objects until the directory fits the budget."""
        entries = []
        for name in _names(tenant_dir):
            try:
                st = os.stat(os.path.join(tenant_dir, name))
            except FileNotFoundError:  # pruned by a compile beside this one
                continue
            entries.append((st.st_mtime, st.st_size, name))
        total = sum(size for _, size, _ in entries)
        for _, size, name in sorted(entries):
            if total <= self.max_bytes:
                break
            try:
                os.remove(os.path.join(tenant_dir, name))
            except FileNotFoundError:
                pass
            total -= size


def stage(tenant_dir: str, staging: str) -> int:
    """Hard-link (else copy) the tenant's objects into a child's staging directory, which its
    sandbox sees read-only; the number staged."""
    staged = 0
    for name in _names(tenant_dir):
        source, dest = os.path.join(tenant_dir, name), os.path.join(staging, name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        try:
            os.link(source, dest)
        except OSError as e:
            if e.errno != errno.EXDEV:  # pruned by a compile beside this one
                continue
            shutil.copyfile(source, dest)  # the staging dir is on another filesystem
        staged += 1
    return staged


def hide(staging: str) -> None:
    """Make a staging dir searchable but not listable (its owner, whom the sandbox maps the
    child to, gets execute only, and cannot chmod a read-only bind): a child opens an object
    whose name it computed from a source, and learns no other."""
    for sub in os.listdir(staging):
        os.chmod(os.path.join(staging, sub), 0o100)
    os.chmod(staging, 0o100)


def unhide(staging: str) -> None:
    """Undo `hide`, so that an unprivileged worker can remove the directory."""
    try:
        os.chmod(staging, 0o700)
        for sub in os.listdir(staging):
            os.chmod(os.path.join(staging, sub), 0o700)
    except OSError:  # gone already: nothing to remove
        pass


def _source_marker(pool_dir: str, source: pb.KernelSource) -> str:
    digest = hashlib.sha256(source.SerializeToString(deterministic=True)).hexdigest()
    return os.path.join(pool_dir, "sources", digest)


def _write_atomically(path: str, data: bytes) -> None:
    """Readers (children being staged, compiles beside this one) see all of it or nothing."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
