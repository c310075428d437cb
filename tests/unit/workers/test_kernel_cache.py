"""Kernel caches on the worker host (a tenant's, the pool's): which names they take, budget and
pruning, staging for a child, the child's side (lookup by name, reports), the pool's build
settings (its builds with g++: tests/integration/workers/test_kernel_cache.py)."""

import json
import os

import pytest

from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.workers import kernel_cache

OBJ = "ab/cab" + "c" * 49  # an Inductor object's stem: `<2 chars>/c<hash>`, 2 chars = hash[:2]


@pytest.mark.parametrize(
    "name", [f"{OBJ}.so", f"{OBJ}.o", f"{OBJ}.main.so", f"{OBJ}.main.o", f"{OBJ}.optimized.o"]
)
def test_inductors_object_names_are_kernels(name):
    assert kernel_cache.is_kernel_name(name)


@pytest.mark.parametrize(
    "name",
    [
        f"../{OBJ}.so",
        f"/{OBJ}.so",
        f"ab/../../{OBJ[3:]}.so",
        "zz/cab" + "c" * 49 + ".so",  # the directory is not the hash's first two characters
        f"{OBJ}.py",  # output code: not kept
        f"{OBJ}.cpp",
        f"{OBJ}.best_config",  # autotune results: not kept
        f"{OBJ}.so.tmp",
        f"fxgraph/{OBJ}.so",
        "ab/cab.so",  # too short to be Inductor's hash
    ],
)
def test_anything_else_is_not(name):
    assert not kernel_cache.is_kernel_name(name)


def _cache(tmp_path, max_bytes=1000):
    return kernel_cache.KernelCache(str(tmp_path / "root"), "toolchain", max_bytes)


def test_each_pool_and_tenant_has_its_own_private_directory(tmp_path):
    cache = _cache(tmp_path)
    dirs = {
        cache.tenant_dir(pool, tenant)
        for pool in ("cpu-a", "cpu-b")
        for tenant in ("alice", "bob", "../bob")
    }
    assert len(dirs) == 6
    for d in dirs:
        pool = os.path.dirname(os.path.dirname(d))  # a tenant's slice is in its pool's dir
        assert os.path.dirname(pool) == str(tmp_path / "root" / "toolchain" / "pools")
        assert all(os.stat(p).st_mode & 0o777 == 0o700 for p in (d, os.path.dirname(d), pool))
    assert len({os.path.dirname(os.path.dirname(d)) for d in dirs}) == 2


def test_keep_stores_well_formed_new_objects_only(tmp_path):
    cache = _cache(tmp_path)
    d = cache.tenant_dir("cpu", "alice")
    os.makedirs(os.path.join(d, "ab"))
    with open(os.path.join(d, f"{OBJ}.so"), "wb") as f:
        f.write(b"first")
    files = pb.KernelFiles(
        built={f"{OBJ}.so": b"second", f"{OBJ}.o": b"obj", "../escape.so": b"x", "ab/x.py": b"y"}
    )
    assert cache.keep(d, files) == (1, 0)
    assert open(os.path.join(d, f"{OBJ}.so"), "rb").read() == b"first"  # first one stays
    assert open(os.path.join(d, f"{OBJ}.o"), "rb").read() == b"obj"
    assert not os.path.exists(os.path.join(d, "..", "escape.so"))
    assert sorted(os.listdir(os.path.join(d, "ab"))) == [f"{OBJ[3:]}.o", f"{OBJ[3:]}.so"]


def test_a_report_over_the_budget_is_not_kept(tmp_path):
    cache = _cache(tmp_path, max_bytes=10)
    d = cache.tenant_dir("cpu", "alice")
    assert cache.keep(d, pb.KernelFiles(built={f"{OBJ}.so": b"x" * 11})) == (0, 0)
    assert kernel_cache._names(d) == []


def test_the_least_recently_used_objects_are_pruned_past_the_budget(tmp_path):
    cache = _cache(tmp_path, max_bytes=25)
    d = cache.tenant_dir("cpu", "alice")
    names = [f"{OBJ}.so", f"{OBJ}.o", f"{OBJ}.main.so"]
    cache.keep(d, pb.KernelFiles(built={n: b"x" * 10 for n in names[:2]}))
    for age, name in zip((300, 200), names[:2]):  # .so older than .o
        os.utime(os.path.join(d, name), (1e9 - age, 1e9 - age))
    # the oldest is reused now, then a third object arrives: the .o (least recent) goes
    assert cache.keep(d, pb.KernelFiles(built={names[2]: b"x" * 10}, reused=[names[0]])) == (1, 1)
    assert sorted(kernel_cache._names(d)) == sorted([names[0], names[2]])


def test_staging_links_the_objects_and_hides_their_names(tmp_path):
    cache = _cache(tmp_path)
    d = cache.tenant_dir("cpu", "alice")
    cache.keep(d, pb.KernelFiles(built={f"{OBJ}.so": b"lib"}))
    staging = tmp_path / "staging"
    staging.mkdir()
    assert kernel_cache.stage(d, str(staging)) == 1
    staged = staging / f"{OBJ}.so"
    assert os.stat(staged).st_ino == os.stat(os.path.join(d, f"{OBJ}.so")).st_ino  # a link
    kernel_cache.hide(str(staging))
    for directory in (staging, staging / "ab"):  # searchable, not listable, by the owner
        assert os.stat(directory).st_mode & 0o777 == 0o300
    kernel_cache.unhide(str(staging))
    assert os.stat(staging / "ab").st_mode & 0o777 == 0o700


def test_objects_built_for_a_running_compile_are_staged_hidden_by_name(tmp_path):
    cache = _cache(tmp_path)
    pool = cache.pool_dir("cpu")
    other = "cd/ccd" + "d" * 49 + ".so"
    cache.keep(pool, pb.KernelFiles(built={f"{OBJ}.so": b"lib", other: b"other"}))
    staging = tmp_path / "staging"
    staging.mkdir()
    kernel_cache.hide(str(staging))  # as it is while its child compiles
    names = [f"{OBJ}.so", "../escape.so", f"{OBJ}.o"]  # not a kernel name; pruned meanwhile
    assert kernel_cache.stage_built(pool, names, str(staging)) == [f"{OBJ}.so"]
    assert os.stat(staging / "ab").st_mode & 0o777 == 0o300  # a new directory, hidden too
    assert os.stat(staging / f"{OBJ}.so").st_ino == os.stat(os.path.join(pool, f"{OBJ}.so")).st_ino
    assert kernel_cache.stage_built(pool, [f"{OBJ}.so"], str(staging)) == [f"{OBJ}.so"]  # again
    kernel_cache.unhide(str(staging))
    assert not (staging / "cd").exists()  # only what was asked for


def _timings(**by_choice: float) -> bytes:
    """Inductor's GEMM timings file with one bmm key's timings."""
    cache = {"bmm": {"[key]": {"highest": by_choice}}}
    return json.dumps({"system": {"device": "cpu"}, "cache": cache}).encode()


def test_gemm_timings_kept_or_staged_add_to_those_there(tmp_path):
    cache = _cache(tmp_path)
    name = f"tuning/cache/{'c' * 64}"
    pool, alice = cache.pool_dir("cpu"), cache.tenant_dir("cpu", "alice")
    cache.keep(pool, pb.KernelFiles(built={name: _timings(aten=2.0, cpp=1.0)}))
    cache.keep(pool, pb.KernelFiles(built={name: _timings(cpp=0.5, triton=3.0)}))
    with open(os.path.join(pool, name)) as f:
        kept = json.load(f)["cache"]["bmm"]["[key]"]["highest"]
    assert kept == {"aten": 2.0, "cpp": 0.5, "triton": 3.0}  # the later measurement wins
    cache.keep(alice, pb.KernelFiles(built={name: _timings(mine=9.0)}))
    staging = tmp_path / "staging"
    staging.mkdir()
    assert kernel_cache.stage(pool, str(staging)) == kernel_cache.stage(alice, str(staging)) == 1
    with open(staging / name) as f:  # a private job's child sees the pool's and its tenant's
        assert json.load(f)["cache"]["bmm"]["[key]"]["highest"] == {**kept, "mine": 9.0}
    with open(os.path.join(pool, name)) as f:  # in a copy: the pool's file is as it was
        assert json.load(f)["cache"]["bmm"]["[key]"]["highest"] == kept
    cache.keep(alice, pb.KernelFiles(built={name: b"not json"}))  # a tenant's own to spoil
    with open(os.path.join(alice, name), "rb") as f:
        assert f.read() == b"not json"


def test_the_pools_directory_is_apart_from_every_tenants(tmp_path):
    cache = _cache(tmp_path)
    pool = cache.pool_dir("cpu")
    assert pool not in {cache.tenant_dir("cpu", t) for t in ("", "pool", "cpu")}
    assert pool == cache.pool_dir("cpu") and os.stat(pool).st_mode & 0o777 == 0o700
    assert os.path.dirname(pool) == os.path.dirname(os.path.dirname(cache.tenant_dir("cpu", "a")))


def test_renew_discards_every_slice_of_the_pool_once_for_each_new_generation(tmp_path):
    cache = _cache(tmp_path)
    slices = [cache.pool_dir("cpu"), cache.tenant_dir("cpu", "alice"), cache.tenant_dir("cpu", "b")]
    other = cache.tenant_dir("cpu-b", "alice")
    for d in (*slices, other):
        cache.keep(d, pb.KernelFiles(built={f"{OBJ}.so": b"lib"}))
    assert not cache.renew("cpu", 0)  # never dropped: kept under generation 0
    assert all(kernel_cache._names(d) == [f"{OBJ}.so"] for d in slices)
    assert cache.renew("cpu", 1)
    assert not any(os.path.exists(d) for d in slices)  # every slice, at once
    assert kernel_cache._names(other) == [f"{OBJ}.so"]  # another pool's stays
    assert sorted(os.listdir(cache.root)) == sorted(  # the two pools' dirs, nothing left over
        os.path.basename(os.path.dirname(cache.pool_dir(p))) for p in ("cpu", "cpu-b")
    )
    cache.keep(cache.pool_dir("cpu"), pb.KernelFiles(built={f"{OBJ}.so": b"new"}))
    assert not cache.renew("cpu", 1)  # kept under 1 now
    assert kernel_cache._names(cache.pool_dir("cpu")) == [f"{OBJ}.so"]
    assert cache.renew("cpu", 0)  # a generation that differs, e.g. a Redis started afresh


def test_a_source_counts_as_built_while_all_its_objects_are_there(tmp_path):
    cache = _cache(tmp_path)
    pool = cache.pool_dir("cpu")
    source = pb.KernelBuild(cpp=pb.KernelSource(code_cache="CppCodeCache", main_code="int x;"))
    assert not cache.built_before(pool, source)
    cache.keep(pool, pb.KernelFiles(built={f"{OBJ}.so": b"lib", f"{OBJ}.o": b"obj"}))
    cache.mark_built(pool, source, [f"{OBJ}.so", f"{OBJ}.o"])
    assert cache.built_before(pool, source)
    other = pb.KernelSource(code_cache="CppCodeCache", main_code="y")
    assert not cache.built_before(pool, pb.KernelBuild(cpp=other))
    same_text = pb.TritonSource(kernel_name="CppCodeCache", module="int x;")
    assert not cache.built_before(pool, pb.KernelBuild(triton=same_text))
    # A Triton kernel is built once, whatever result a later compile sends with it.
    kernel = pb.TritonSource(kernel_name="k", module="m", result=b"{}")
    cache.mark_built(pool, pb.KernelBuild(triton=kernel), [f"{OBJ}.so"])
    kernel.result = b'{"XBLOCK": 2}'
    assert cache.built_before(pool, pb.KernelBuild(triton=kernel))
    os.remove(os.path.join(pool, f"{OBJ}.o"))  # pruned: build it again
    assert not cache.built_before(pool, source)


def test_a_source_written_finds_the_staged_objects_of_its_name(tmp_path, monkeypatch):
    from torch._inductor import codecache

    staging, inductor = tmp_path / "staging", tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    key, path = codecache.write("int staged;", "main.cpp")
    name = os.path.relpath(path, inductor)[: -len(".cpp")]  # `<2 chars>/<key>.main`
    os.remove(path)
    (staging / name).parent.mkdir(parents=True)
    (staging / f"{name}.so").write_bytes(b"staged")
    with kernel_cache.looking_up(str(staging), str(inductor)):
        codecache.write("int staged;", "main.cpp")
        codecache.write("int other;", "main.cpp")
    assert os.readlink(inductor / f"{name}.so") == str(staging / f"{name}.so")
    assert not os.path.lexists(inductor / f"{name}.o")  # not staged: Inductor builds it
    linked = [n for n in kernel_cache._names(str(inductor)) if os.path.islink(inductor / n)]
    assert linked == [f"{name}.so"]


def test_the_child_reports_what_it_built_not_what_was_staged(tmp_path):
    staging, inductor = tmp_path / "staging", tmp_path / "inductor"
    (staging / "ab").mkdir(parents=True)
    (staging / f"{OBJ}.so").write_bytes(b"staged")
    (inductor / "ab").mkdir(parents=True)
    os.symlink(staging / f"{OBJ}.so", inductor / f"{OBJ}.so")
    (inductor / f"{OBJ}.o").write_bytes(b"built")
    (inductor / "ab" / "cab.py").write_bytes(b"output code")
    (inductor / "fxgraph").mkdir()
    files = kernel_cache.report(str(inductor), str(staging))
    assert dict(files.built) == {f"{OBJ}.o": b"built"}
    assert list(files.reused) == []  # staged, but this process never loaded it
    assert not kernel_cache.report(str(inductor), str(staging), built=False).built


def test_the_settings_size_it_turn_it_off_and_refuse_a_negative_size(monkeypatch):
    from torchfarm.settings import WorkerSettings

    for name in ("TORCHFARM_KERNEL_CACHE_MB", "TORCHFARM_KERNEL_CACHE"):
        monkeypatch.delenv(name, raising=False)
    default = WorkerSettings.from_env()
    assert (default.kernel_cache_mb, default.kernel_cache_dir) == (2048, "")
    monkeypatch.setenv("TORCHFARM_KERNEL_CACHE_MB", "0")
    monkeypatch.setenv("TORCHFARM_KERNEL_CACHE", "/srv/kernels")
    off = WorkerSettings.from_env()
    assert (off.kernel_cache_mb, off.kernel_cache_dir) == (0, "/srv/kernels")
    monkeypatch.setenv("TORCHFARM_KERNEL_CACHE_MB", "-1")
    with pytest.raises(ValueError, match="TORCHFARM_KERNEL_CACHE_MB"):
        WorkerSettings.from_env()


@pytest.mark.parametrize("compile_threads", [True, False])
def test_a_library_is_asked_of_the_pool_before_inductor_builds_it(
    tmp_path, monkeypatch, compile_threads
):
    """With Inductor's compile threads (a submit_fn) or without: the pool is asked for each
    library with its source before Inductor's build looks for the objects, and the objects it
    staged are linked in; a library the pool does not build is built by Inductor."""
    from concurrent.futures import ThreadPoolExecutor

    from torch._inductor import codecache

    staging, inductor = tmp_path / "staging", tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    asked, built = [], []

    def load_async(  # Inductor's, less its compile command: write, submit the build, load
        cls,
        main_code,
        device_type="cpu",
        submit_fn=None,
        extra_flags=(),
        optimized_code=None,
        needs_vec_isa=None,
        kernel_needs_vec_isa=None,
    ):
        binary = codecache.write(main_code, "main.cpp")[1][: -len(".cpp")] + ".so"

        def build():
            if not os.path.exists(binary):
                built.append(main_code)
                open(binary, "w").close()

        future = submit_fn(build) if submit_fn and not os.path.exists(binary) else None
        return lambda: (future and future.result(), build(), binary)[-1]

    def ask(source: pb.KernelSource) -> bool:  # the pool builds what says "pooled"
        asked.append(source)
        for path in inductor.glob("*/*.cpp") if "pooled" in source.main_code else ():
            stem = os.path.relpath(path, inductor)[: -len(".cpp")]
            (staging / stem).parent.mkdir(parents=True, exist_ok=True)
            (staging / f"{stem}.so").write_bytes(b"built by the pool")
        return "pooled" in source.main_code

    monkeypatch.setattr(codecache.CppCodeCache, "load_async", classmethod(load_async))
    executor = ThreadPoolExecutor(1)
    submit = executor.submit if compile_threads else None
    with kernel_cache.built_by_pool(ask, str(staging), str(inductor)):
        loaders = [
            codecache.CppCodeCache.load_async(code, "cpu", submit, needs_vec_isa=False)
            for code in ("int pooled;", "int mine;")
        ]
        for load in loaders:
            load()
    executor.shutdown()
    assert [(s.main_code, s.code_cache, s.needs_vec_isa) for s in asked] == [
        ("int pooled;", "CppCodeCache", 1),  # 1: False
        ("int mine;", "CppCodeCache", 1),
    ]
    linked = [n for n in kernel_cache._names(str(inductor)) if os.path.islink(inductor / n)]
    assert len(linked) == 1 and os.readlink(inductor / linked[0]) == str(staging / linked[0])
    assert built == ["int mine;"]


def test_an_object_staged_across_filesystems_is_copied_whole_or_not_at_all(monkeypatch, tmp_path):
    """Where the staging dir is on another filesystem (EXDEV) the object is copied, whole; one
    pruned before its copy stages nothing and says so (False), never raises."""
    import errno

    def across(source, dest):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", across)
    (tmp_path / "obj.so").write_bytes(b"lib")
    assert kernel_cache._link(str(tmp_path / "obj.so"), str(tmp_path / "staged.so"))
    assert (tmp_path / "staged.so").read_bytes() == b"lib"
    assert not kernel_cache._link(str(tmp_path / "pruned.so"), str(tmp_path / "none.so"))
    assert not (tmp_path / "none.so").exists()
