"""A tenant's kernels and tuning results, kept on the worker host for its later compiles.

Inductor names each C++ object after a hash of its source and its compile command (flags,
ISA), and skips the compiler when the file is already in its cache dir: that layout is the
seam. A compile child starts with an empty Inductor cache; for a private job its parent
stages the tenant's objects (hard links) in a directory bound read-only into the child's
sandbox, the child links them into its own cache dir and, after compiling, reports the objects
it built, which the parent keeps for the tenant. Nothing of Inductor's cache that decides what
an artifact holds is kept (FX graph, AOTAutograd, output code), so a reused object changes how
long a compile takes, not what it produces.

Per (toolchain, pool, tenant), for private jobs only: a child runs the tenant's code and can
report any bytes under any name, so what a tenant's cache holds is the tenant's to choose, and
may reach only entries that the tenant alone loads (docs/reliability.md, "Kernel reuse").

On GPU pools a tenant's directory also keeps, for its private compiles, what Triton and
Inductor's tuning made (issue 28): Triton's compiled entries (`triton/<key>/`, found through
Triton's own cache manager, torch_adapter/worker/triton_cache.py) and the autotune results (a
kernel's `.best_config`, kept under its text, `tuning/text/`, placed where Inductor looks for
that kernel's result just before it compiles it; `tuning/cache/<hash>`, Inductor's GEMM
timings, copied in at the start). Tuning results choose among configs Inductor generated for
the kernel (a result tuned again replaces the kept one). The same rule holds: they are the
tenant's, read by the tenant's private compiles only. The pool's own directory holds GEMM
timings too, but only those its builder measured (torch_adapter/worker/gemm_problems.py); a timings
file kept adds to the one there (`_merge_timings`), and one staged beside another (the pool's,
then a private job's tenant's) adds to it in a copy.

A pool's slices share one directory, so that `torchfarm cache drop-kernels` can discard them
all: the worker compares the pool's generation (cache/pools.py) with the one its directory
was kept under before it stages a job's kernels (`renew`), and keeps none of a compile that
the generation changed under.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import hashlib
import inspect
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from torchfarm.proto import torchfarm_pb2 as pb

# `<2 chars>/c<hash>[.main|.optimized].so|.o`, the 2 chars being the hash's first two, as
# Inductor's codecache.write names a C++ source's objects.
_CPP = re.compile(r"([0-9a-z]{2})/c(\1[0-9a-z]{18,62})(?:\.main|\.optimized)?\.(?:so|o)")
# A Triton entry's files (`triton/<base32 key>/<kernel>.json|.cubin|.hsaco`: its metadata and
# binary, all that Triton needs to serve it, as with TRITON_STORE_BINARY_ONLY; never its IRs,
# a group file, which holds paths, nor a launcher's C source or library), and Inductor's
# tuning results (a kernel's `.best_config` beside its module; the GEMM timings file).
TRITON, TUNING = "triton", "tuning"
_TRITON = re.compile(
    TRITON + r"/([A-Z2-7]{52})/(?!__grp__)[A-Za-z_]\w{0,200}\.(?:json|cubin|hsaco)"
)
# What one compile reports of its Triton entries at most: the report travels on the child's
# pipe beside the artifact, under the same cap (TORCHFARM_MAX_ARTIFACT_BYTES); entries past it
# are not kept, which costs later compiles their reuse, never this one.
MAX_TRITON_REPORT_BYTES = 256 << 20
_TRITON_ENTRY = re.compile(TRITON + r"/[A-Z2-7]{52}")
_TUNING = re.compile(
    TUNING + r"/(?:(?:[0-9a-z]{2}|text)/[0-9a-f]{64}\.best_config|cache/[0-9a-f]{64})"
)
_GEMM_TIMINGS = "cache"  # Inductor's cache_dir()/cache/<system hash>: PersistentCache


def is_gemm_timings(name: str) -> bool:
    """Inductor's GEMM timings file (`tuning/cache/<system hash>`)."""
    return name.startswith(f"{TUNING}/{_GEMM_TIMINGS}/") and is_kernel_name(name)


def is_kernel_name(name: str) -> bool:
    """A file a kernel cache directory may hold, and nothing that could leave it."""
    return any(p.fullmatch(name) for p in (_CPP, _TRITON, _TUNING))


def _unit(name: str) -> str:
    """What is kept, used and pruned as one: a Triton entry's directory, else the file."""
    match = _TRITON.fullmatch(name)
    return f"{TRITON}/{match.group(1)}" if match else name


def _names(directory: str, pattern: re.Pattern | None = None, prefix: str = "") -> list[str]:
    """The kernel cache files under `directory` (regular files or links), named relative to
    it after `prefix` (`triton/` for a Triton cache dir, `tuning/` for an Inductor one)."""
    found: list[str] = []
    for root, dirs, files in os.walk(directory):
        rel = os.path.relpath(root, directory)
        dirs[:] = [] if rel.count(os.sep) >= 2 else [d for d in dirs if d != "sources"]
        for f in files:
            name = prefix + os.path.normpath(os.path.join(rel, f))
            if is_kernel_name(name) and (pattern is None or pattern.fullmatch(name)):
                found.append(name)
    return found


# ---- the compile child's side ------------------------------------------------------------
@dataclasses.dataclass
class TuningLookups:
    """What the child's compile did with tuning results, for its report: the kept name of each
    kernel's result file (by its path in the cache dir), and the staged name it was found under."""

    names: dict[str, str] = dataclasses.field(default_factory=dict)
    found: dict[str, str] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def looking_up(staged: str, cache_dir: str) -> Iterator[TuningLookups]:
    """While entered, each C++ source Inductor writes into `cache_dir` finds the staged
    objects of its name linked beside it, so Inductor builds none of them. Lookup is by exact
    name: the staging dir cannot be listed (`hide`), so a child reaches only the objects of
    sources it has itself (the names hash the sources). Tuning results: `_tuning_found`."""
    from torchfarm.torch_adapter.compile import cpp_libraries

    lookups = TuningLookups()
    link = functools.partial(_link_staged, staged, cache_dir)
    with cpp_libraries.sources_written(link), _tuning_found(staged, cache_dir, lookups):
        yield lookups


def _link_staged(staged: str, cache_dir: str, source_path: str) -> None:
    """The staged objects of the source at `source_path` (in `cache_dir`), linked beside it."""
    stem = source_path[: -len(".cpp")]
    for suffix in (".so", ".o"):
        name = os.path.relpath(stem + suffix, cache_dir)
        staged_path = os.path.join(staged, name)
        exists = os.path.exists(staged_path) and not os.path.lexists(stem + suffix)
        if is_kernel_name(name) and exists:
            with contextlib.suppress(FileExistsError):  # linked meanwhile (the same source)
                os.symlink(staged_path, stem + suffix)


@contextlib.contextmanager
def built_by_pool(ask: Callable[[pb.KernelSource], bool], staged: str, cache_dir: str):
    """While entered, each C++ library Inductor is about to build (one that `recording` would
    record) is first asked of the pool: `ask(source)` returns once the pool's builder has built
    it and staged its objects (True) or will not (False); staged, they are linked beside the
    source and Inductor builds nothing of it. So a shared compile's objects are built once, by
    the pool, and are in the pool's cache when the compile ends (issue 53: a sibling right after
    finds them). Asked from Inductor's build (its compile threads, or here after load_async
    where it has none), outside load_async's lock."""
    from torchfarm.torch_adapter.compile import cpp_libraries

    written = threading.local()  # the sources the load_async call of this thread writes

    def on_written(path: str) -> None:
        paths = getattr(written, "paths", None)
        if paths is not None:
            paths.append(path)

    def load_async(cls, original, main_code, device_type="cpu", *args, **kwargs):
        source, call = _kernel_source(cls, original, main_code, device_type, args, kwargs)
        if source is None:
            return original(cls, main_code, device_type, *args, **kwargs)
        paths: list[str] = []
        submit_fn, later = call.arguments.get("submit_fn"), []

        def pool_first(build: Callable[[], object]) -> Callable[[], object]:
            def run() -> object:
                if ask(source):
                    for path in paths:
                        _link_staged(staged, cache_dir, path)
                return build()

            return run

        def submit(build: Callable[[], object]) -> Future:
            if submit_fn is not None:
                return submit_fn(pool_first(build))
            later.append((Future(), pool_first(build)))  # run once load_async let its lock go
            return later[-1][0]

        call.arguments["submit_fn"] = submit
        written.paths = paths
        try:
            loader = original(*call.args, **call.kwargs)
        finally:
            written.paths = None
        for future, run in later:
            try:
                future.set_result(run())
            except Exception as e:
                future.set_exception(e)
        return loader

    with cpp_libraries.sources_written(on_written), cpp_libraries.wrapped_load_async(load_async):
        yield


def text_name(kernel_name: str, source: str) -> str:
    """A Triton kernel's result, named by the kernel's text without its name: Inductor names a
    kernel by its position in the graph, and its module (whose hash names Inductor's own
    result file) holds that name, so the same kernel elsewhere in a sibling would be another."""
    digest = hashlib.sha256(source.replace(kernel_name, "").encode()).hexdigest()
    return f"{TUNING}/text/{digest}.best_config"


@contextlib.contextmanager
def _tuning_found(staged: str, cache_dir: str, lookups: TuningLookups) -> Iterator[None]:
    """The staged GEMM timings copied into `cache_dir` now; a staged `.best_config` copied
    beside each Triton kernel's module just before Inductor compiles and tunes it, found under
    the kernel's text (`text_name`) or else Inductor's own name for it (Inductor then takes
    that config and benchmarks none)."""
    timings = os.path.join(staged, TUNING, _GEMM_TIMINGS)
    for name in os.listdir(timings) if os.path.isdir(timings) else ():
        if _TUNING.fullmatch(f"{TUNING}/{_GEMM_TIMINGS}/{name}"):
            _copy(os.path.join(timings, name), os.path.join(cache_dir, _GEMM_TIMINGS, name))
    from torchfarm.torch_adapter.worker import triton_kernels

    def place(kernel_name: str, source: str, result: str) -> None:
        own = f"{TUNING}/{os.path.relpath(result, cache_dir)}"
        if not _TUNING.fullmatch(own) or result in lookups.names:
            return
        lookups.names[result] = by_text = text_name(kernel_name, source)
        for name in (by_text, own):
            if not os.path.exists(result) and os.path.exists(os.path.join(staged, name)):
                _copy(os.path.join(staged, name), result)
                lookups.found[result] = name

    with triton_kernels.results_found(place):
        yield


def _copy(source: str, dest: str) -> None:
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.copyfile(source, dest)


@contextlib.contextmanager
def recording(recorded: pb.KernelFiles, triton: bool = False) -> Iterator[None]:
    """Record, as the pool's kernel builder takes them, each CPU library Inductor's
    CppCodeCache classes are asked to build (`recorded.sources`; extra flags, another device
    or class: left out) and, with `triton`, each Triton kernel a compile asks for, once, with
    the autotune result it has when the compile ends (`recorded.triton_sources`)."""
    from torchfarm.torch_adapter.compile import cpp_libraries
    from torchfarm.torch_adapter.load import autotune_results
    from torchfarm.torch_adapter.worker import triton_kernels

    sources, kernels = recorded.sources, set()

    def load_async(cls, original, main_code, device_type="cpu", *args, **kwargs):
        source = _kernel_source(cls, original, main_code, device_type, args, kwargs)[0]
        if source is not None:
            sources.append(source)
        return original(cls, main_code, device_type, *args, **kwargs)

    def on_kernel(kernel_name: str, module: str) -> None:
        if (kernel_name, module) not in kernels:
            kernels.add((kernel_name, module))
            recorded.triton_sources.add(kernel_name=kernel_name, module=module)

    with contextlib.ExitStack() as hooks:
        hooks.enter_context(cpp_libraries.wrapped_load_async(load_async))
        if triton:
            hooks.enter_context(triton_kernels.seen(on_kernel))
        yield
    for source in recorded.triton_sources:  # the result each kernel's compile ended with
        with contextlib.suppress(FileNotFoundError):
            source.result = _read(autotune_results.module_result_path(source.module))


CODE_CACHES = ("CppCodeCache", "CppPythonBindingsCodeCache")  # what a kernel build builds
_TRISTATE = {None: 0, False: 1, True: 2}  # KernelSource.needs_vec_isa


def _kernel_source(
    cls, original, main_code: str, device_type: str, args: tuple, kwargs: dict
) -> tuple[pb.KernelSource | None, inspect.BoundArguments]:
    """A load_async call as the pool's kernel builder takes it (None where it cannot: extra
    flags, another device or class), and the call's arguments."""
    call = inspect.signature(original).bind(cls, main_code, device_type, *args, **kwargs)
    given = call.arguments
    optimized = given.get("optimized_code")
    if device_type != "cpu" or given.get("extra_flags") or cls.__name__ not in CODE_CACHES:
        return None, call
    source = pb.KernelSource(
        code_cache=cls.__name__,
        main_code=main_code,
        has_optimized=optimized is not None,
        optimized_code=optimized or "",
        needs_vec_isa=_TRISTATE[given.get("needs_vec_isa")],
        kernel_needs_vec_isa=_TRISTATE[given.get("kernel_needs_vec_isa")],
    )
    return source, call


def report(
    cache_dir: str,
    staged: str,
    built: bool = True,
    triton_dir: str = "",
    lookups: TuningLookups | None = None,
) -> pb.KernelFiles:
    """The objects this compile built (regular files; with `built`), and the staged libraries
    it loaded (mapped in this process) and Triton entries it took (from `triton_dir`). With
    `built`, also the Triton entries and the tuning results in `cache_dir` it made, and which
    staged results it used."""
    files = pb.KernelFiles()
    with open("/proc/self/maps") as f:
        mapped = {line.split(None, 5)[-1].strip() for line in f if "/" in line}
    for name in _names(cache_dir, _CPP):
        path = os.path.join(cache_dir, name)
        if not os.path.islink(path):
            if built:
                files.built[name] = _read(path)
        elif os.path.join(staged, name) in mapped:
            files.reused.append(name)
    if triton_dir:
        _report_triton(triton_dir, staged, files, built)
    _report_tuning(cache_dir, staged, files, lookups or TuningLookups(), built)
    return files


def _report_triton(triton_dir: str, staged: str, files: pb.KernelFiles, built: bool) -> None:
    """An entry whose key is staged came from there (Triton's lookup copies it in, and
    compiles nothing): reused; any other was compiled here (reported with `built`)."""
    prefix = TRITON + "/"
    entries: dict[str, list[str]] = {}
    for name in _names(triton_dir, _TRITON, prefix):
        entries.setdefault(_unit(name), []).append(name)
    reported = 0
    for unit, names in sorted(entries.items()):
        if staged and os.path.isdir(os.path.join(staged, unit)):
            files.reused.append(unit)
            continue
        if not built:
            continue
        data = {name: _read(os.path.join(triton_dir, name[len(prefix) :])) for name in names}
        reported += sum(len(d) for d in data.values())
        if reported <= MAX_TRITON_REPORT_BYTES:
            files.built.update(data)


def _report_tuning(
    cache_dir: str, staged: str, files: pb.KernelFiles, lookups: TuningLookups, built: bool
) -> None:
    """A result found staged and unchanged is one reused, worth the tuning time it records (a
    claim: statistics only); with `built`, new or changed results are kept, a Triton kernel's
    under its text's name."""
    prefix = TUNING + "/"
    for own in _names(cache_dir, _TUNING, prefix):
        path = os.path.join(cache_dir, own[len(prefix) :])
        data = _read(path)
        found = lookups.found.get(path)
        if found is not None and _read(os.path.join(staged, found)) == data:
            files.tuning_reused += 1
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                seconds = float(json.loads(data).get("time_taken_ms", 0)) / 1e3
                files.tuning_seconds_saved += seconds
            continue
        if not built:
            continue
        try:  # the GEMM timings, copied in at the start, kept only if they grew
            unchanged = found is None and _read(os.path.join(staged, own)) == data
        except FileNotFoundError:
            unchanged = False
        if not unchanged:
            files.built[lookups.names.get(path, own)] = data


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# ---- the worker's side -------------------------------------------------------------------
GENERATION = "generation"  # in a pool's directory: the generation its kernels were kept under


class KernelCache:
    """Each pool's kernels under `root/<toolchain id>/pools/<hash>/`: the pool-wide slice and
    one per tenant, at most `max_bytes` each. Names are hashes, so no tenant or pool name
    becomes a path; directories are created 0700. (The layout before `pools/`, a tenant's
    directory beside its pool's, is neither read nor removed.)"""

    def __init__(self, root: str, toolchain: str, max_bytes: int) -> None:
        self.root, self.max_bytes = os.path.join(root, toolchain, "pools"), max_bytes

    def _pool(self, pool: str) -> str:
        return os.path.join(self.root, hashlib.sha256(pool.encode()).hexdigest()[:32])

    def tenant_dir(self, pool: str, tenant: str) -> str:
        """The tenant's slice of `pool`."""
        digest = hashlib.sha256(f"{pool}\0{tenant}".encode()).hexdigest()[:32]
        return self._dir(self._pool(pool), "tenants", digest)

    def pool_dir(self, pool: str) -> str:
        """The pool-wide slice, which only the pool's kernel builds fill
        (workers/kernel_builder.py)."""
        return self._dir(self._pool(pool), "shared")

    @staticmethod
    def _dir(top: str, *subs: str) -> str:
        """`top/subs...`, each of these levels created 0700 where missing."""
        os.makedirs(top, mode=0o700, exist_ok=True)
        for sub in subs:
            top = os.path.join(top, sub)
            os.makedirs(top, mode=0o700, exist_ok=True)
        return top

    def renew(self, pool: str, generation: int) -> bool:
        """Discard every slice of `pool` unless its kernels were kept under `generation` (the
        pool's, which `torchfarm cache drop-kernels` raises: cache/pools.py), then remember
        it; whether it discarded. A directory kept under none counts as generation 0."""
        top = self._pool(pool)
        try:
            with open(os.path.join(top, GENERATION)) as f:
                kept_under = int(f.read())
        except (FileNotFoundError, ValueError):
            kept_under = 0
        if kept_under == generation:
            return False
        os.makedirs(self.root, exist_ok=True)
        trash = tempfile.mkdtemp(dir=self.root, prefix=".dropped-")
        with contextlib.suppress(FileNotFoundError):  # renamed at once: no reader sees half
            os.rename(top, os.path.join(trash, "pool"))
        shutil.rmtree(trash, ignore_errors=True)
        _write_atomically(os.path.join(self._dir(top), GENERATION), str(generation).encode())
        return True

    @staticmethod
    def built_names(pool_dir: str, source: pb.KernelBuild) -> list[str]:
        """The files a build of `source` stored, as `mark_built` remembered them."""
        try:
            with open(source_marker(pool_dir, source)) as f:
                return f.read().split()
        except FileNotFoundError:
            return []

    def built_before(self, pool_dir: str, source: pb.KernelBuild) -> bool:
        """Whether a build of `source` stored files that are all still there."""
        names = self.built_names(pool_dir, source)
        return bool(names) and all(
            is_kernel_name(n) and os.path.exists(os.path.join(pool_dir, n)) for n in names
        )

    @staticmethod
    def mark_built(pool_dir: str, source: pb.KernelBuild, names: list[str]) -> None:
        """Remember the files a build of `source` made, so that it is not built again."""
        _write_atomically(source_marker(pool_dir, source), "\n".join(names).encode())

    def keep(self, tenant_dir: str, files: pb.KernelFiles) -> tuple[int, int]:
        """Store the files a child of this tenant (or a kernel build of the pool's) built
        (well-formed names only, none over the budget; none already there, except tuning
        results, which a later compile refines), mark the ones it reused as used now, then
        prune the least recently used past the budget; (files stored, units reused)."""
        self.touch(tenant_dir, files.reused)
        stored = 0
        if sum(len(data) for data in files.built.values()) <= self.max_bytes:
            # A Triton entry's metadata last: the lookup takes an entry only once it is there.
            for name in sorted(files.built, key=lambda n: (_unit(n), n.endswith(".json"))):
                path = os.path.join(tenant_dir, name)
                replaces = name.startswith(TUNING + "/")
                if is_kernel_name(name) and (replaces or not os.path.exists(path)):
                    if is_gemm_timings(name):
                        _merge_timings(path, files.built[name])
                    else:
                        _write_atomically(path, files.built[name])
                    stored += 1
        self.prune(tenant_dir)
        return stored, len(files.reused)

    @staticmethod
    def touch(directory: str, units) -> None:
        """Mark `units` of `directory` (files, or Triton entries) as used now (least recently
        used go first)."""
        now = time.time()
        for unit in units:
            path = os.path.join(directory, unit)
            if is_kernel_name(unit):
                paths = [path]
            elif _TRITON_ENTRY.fullmatch(unit):
                paths = [os.path.join(path, n) for n in _listdir(path)]
            else:
                continue
            for each in paths:
                with contextlib.suppress(FileNotFoundError):
                    os.utime(each, (now, now))

    def prune(self, tenant_dir: str) -> None:
        """Remove the least recently used units until the directory fits the budget."""
        units: dict[str, list] = {}
        for name in _names(tenant_dir):
            try:
                st = os.stat(os.path.join(tenant_dir, name))
            except FileNotFoundError:  # pruned by a compile beside this one
                continue
            unit = units.setdefault(_unit(name), [0.0, 0, []])  # last used, bytes, files
            unit[0], unit[1] = max(unit[0], st.st_mtime), unit[1] + st.st_size
            unit[2].append(name)
        total = sum(size for _, size, _ in units.values())
        for _, size, names in sorted(units.values(), key=lambda u: u[0]):
            if total <= self.max_bytes:
                break
            for name in sorted(names, key=lambda n: not n.endswith(".json")):  # metadata first
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(tenant_dir, name))
            total -= size


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def stage(tenant_dir: str, staging: str) -> int:
    """Hard-link (else copy) the tenant's objects into a child's staging directory, which its
    sandbox sees read-only; the number staged. A GEMM timings file staged already (the pool's,
    for a private job) gets these timings added, in a copy."""
    staged = 0
    for name in _names(tenant_dir):
        source, dest = os.path.join(tenant_dir, name), os.path.join(staging, name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if is_gemm_timings(name) and os.path.exists(dest):
            with contextlib.suppress(FileNotFoundError):  # pruned by a compile beside this one
                _merge_timings(dest, _read(source))
                staged += 1
            continue
        staged += _link(source, dest)
    return staged


def stage_built(pool_dir: str, names: list[str], staging: str) -> list[str]:
    """Hard-link (else copy) the objects `names` of the pool's directory into a hidden child's
    staging directory while its compile runs (a build it asked for); the names staged."""
    staged = []
    for name in filter(is_kernel_name, names):
        dest = os.path.join(staging, name)
        with contextlib.suppress(FileExistsError):  # hidden as the others
            os.mkdir(os.path.dirname(dest), _HIDDEN)
        if os.path.lexists(dest) or _link(os.path.join(pool_dir, name), dest):
            staged.append(name)
    return staged


def _link(source: str, dest: str) -> bool:
    """`source` hard-linked (else copied) at `dest`, whole or not at all: the child may look
    for `dest` meanwhile; False where it is gone (pruned)."""
    try:
        os.link(source, dest)
    except OSError as e:
        if e.errno != errno.EXDEV:  # pruned by a compile beside this one
            return False
        try:  # the staging dir is on another filesystem
            with open(source, "rb") as f:
                _write_atomically(dest, f.read())
        except FileNotFoundError:  # pruned meanwhile
            return False
    return True


# A hidden staging dir's mode: its owner, whom the sandbox maps the child to, may search it and
# (the parent, for builds a child asks for: `stage_built`) write it, never list it; the child's
# bind is read-only and it cannot chmod one.
_HIDDEN = 0o300


def hide(staging: str) -> None:
    """Make a staging dir searchable but not listable (_HIDDEN): a child opens an object whose
    name it computed from a source, and learns no other."""
    for sub in os.listdir(staging):
        os.chmod(os.path.join(staging, sub), _HIDDEN)
    os.chmod(staging, _HIDDEN)


def unhide(staging: str) -> None:
    """Undo `hide`, so that an unprivileged worker can remove the directory."""
    try:
        os.chmod(staging, 0o700)
        for sub in os.listdir(staging):
            os.chmod(os.path.join(staging, sub), 0o700)
    except OSError:  # gone already: nothing to remove
        pass


def source_marker(pool_dir: str, source: pb.KernelBuild) -> str:
    """Where `mark_built` remembers a build of `source`. A Triton kernel's marker leaves its
    result out: the kernel is built once, with the first result a compile sent (later compiles
    find that one, and send it back as the pool wrote it, or another they tuned again)."""
    if source.triton.result:
        source = pb.KernelBuild(
            triton=pb.TritonSource(
                kernel_name=source.triton.kernel_name, module=source.triton.module
            )
        )
    digest = hashlib.sha256(source.SerializeToString(deterministic=True)).hexdigest()
    return os.path.join(pool_dir, "sources", digest)


def _merge_timings(path: str, data: bytes) -> None:
    """Add the timings `data` holds to the GEMM timings file at `path` (theirs win): a
    tenant's compile, or a pool's measurement, adds to what others kept. Bytes that are not
    Inductor's format replace the file (a tenant's own to spoil; the pool's are measured)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with _locked(os.path.dirname(path)):
        try:
            new = json.loads(data)
            with open(path, "rb") as f:
                old = json.loads(f.read())
            for op, by_inputs in new["cache"].items():
                for inputs, by_precision in by_inputs.items():
                    for precision, timings in by_precision.items():
                        kept = old["cache"].setdefault(op, {}).setdefault(inputs, {})
                        kept.setdefault(precision, {}).update(timings)
            data = json.dumps({**new, "cache": old["cache"]}, indent=4).encode()
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # nothing kept yet, or not a timings file: `data` as it is
        _write_atomically(path, data)


@contextlib.contextmanager
def _locked(directory: str) -> Iterator[None]:
    """An exclusive lock on `directory` (flock), across the worker's processes."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_atomically(path: str, data: bytes) -> None:
    """Readers (children being staged, compiles beside this one) see all of it or nothing."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
