"""The compile sandbox's pure parts: its bwrap command, the child's environment, the report
stream read with caps, the bounded error text, and the worker settings (the startup self-check
builds a real sandbox: tests/integration/workers/test_sandbox.py)."""

import collections
import io
import os

import pytest

from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import WorkerSettings, sizing
from torchfarm.settings.sizing import compile_memory_mb, compile_share_mb
from torchfarm.workers import child_pool, sandbox
from torchfarm.workers.compile_child import FRAME

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
LAYOUT = sandbox.HostLayout(
    top_level={"bin": "usr/bin", "lib64": ""},
    python_roots=("/opt/python3.11", "/srv/app/.venv"),
    package_dir="/srv/app/torchfarm",
    etc=("/etc/ld.so.cache",),
    gpu_nodes=("/dev/nvidia0", "/dev/nvidiactl"),
)


def _binds(args: list[str]) -> dict[str, str]:
    """destination -> source of every bind in a bwrap command."""
    return {
        args[i + 2]: args[i + 1]
        for i, a in enumerate(args)
        if a in ("--ro-bind", "--bind", "--dev-bind", "--ro-bind-try", "--bind-try")
    }


def test_the_child_is_unprivileged_in_new_namespaces():
    args = sandbox.bwrap_args(WorkerSettings(), LAYOUT)
    for option in ("--unshare-user", "--unshare-net", "--unshare-pid", "--unshare-ipc"):
        assert option in args
    assert args[args.index("--uid") + 1] == args[args.index("--gid") + 1] == "65534"
    assert args[args.index("--cap-drop") + 1] == "ALL"
    assert "--die-with-parent" in args and "--new-session" in args
    assert args[-2:] == ["--remount-ro", "/"]  # bwrap's own root: no writable leftovers


def test_the_child_sees_only_read_only_binds_of_what_a_compile_needs():
    args = sandbox.bwrap_args(WorkerSettings(), LAYOUT)
    assert _binds(args) == {
        "/usr": "/usr",
        "/lib64": "/lib64",
        "/etc/ld.so.cache": "/etc/ld.so.cache",
        "/opt/python3.11": "/opt/python3.11",
        "/srv/app/.venv": "/srv/app/.venv",
        "/run/torchfarm/torchfarm": "/srv/app/torchfarm",  # the package, never its checkout
    }
    assert "--bind" not in args and "--dev-bind" not in args  # nothing of the host writable
    assert args[args.index("--symlink") + 1 : args.index("--symlink") + 3] == ["usr/bin", "/bin"]


def test_the_work_dir_is_a_private_tmpfs_of_the_configured_size():
    args = sandbox.bwrap_args(WorkerSettings(compile_disk_mb=100), LAYOUT)
    i = args.index(sandbox.WORK_DIR)
    assert args[i - 3 : i] == ["--size", str(100 << 20), "--tmpfs"]
    assert args[args.index("--chdir") + 1] == sandbox.WORK_DIR


def test_cuda_children_get_the_gpu_nodes_and_cpu_children_do_not():
    cuda = _binds(sandbox.bwrap_args(WorkerSettings(device="cuda"), LAYOUT))
    assert cuda["/dev/nvidia0"] == "/dev/nvidia0" and cuda["/dev/nvidiactl"] == "/dev/nvidiactl"
    assert not any("nvidia" in a for a in sandbox.bwrap_args(WorkerSettings(), LAYOUT))


def test_extra_binds_are_read_only():
    args = sandbox.bwrap_args(WorkerSettings(sandbox_binds=("/opt/cuda",)), LAYOUT)
    assert args[args.index("/opt/cuda") - 1] == "--ro-bind"


def test_this_hosts_layout_binds_no_checkout_working_directory_home_or_tmp():
    layout = sandbox.HostLayout.probe()
    assert os.path.isfile(os.path.join(layout.package_dir, "__init__.py"))
    sources = set(_binds(sandbox.bwrap_args(WorkerSettings(), layout)).values())
    forbidden = {"/", "/tmp", "/etc", os.getcwd(), ROOT, os.path.expanduser("~"), "/root"}
    assert not sources & forbidden, sources & forbidden


def test_pip_target_packages_on_the_workers_pythonpath_reach_the_child(tmp_path, monkeypatch):
    site, checkout = tmp_path / "site", tmp_path / "checkout"
    (checkout / "torchfarm").mkdir(parents=True)
    site.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(checkout), "", str(tmp_path)]))
    layout = sandbox.HostLayout.probe()
    assert layout.python_path == (str(site),)  # not the checkout, not the working directory
    binds = _binds(sandbox.bwrap_args(WorkerSettings(), layout))
    assert binds[str(site)] == str(site)
    env = sandbox.child_environment("/tmp", "/run/torchfarm", layout.python_path)
    assert env["PYTHONPATH"] == f"/run/torchfarm{os.pathsep}{site}"


def test_the_childs_environment_carries_no_secret(monkeypatch):
    monkeypatch.setenv("TORCHFARM_REDIS_URL", "redis://:secret@host/0")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    env = sandbox.child_environment("/tmp", "/run/torchfarm")
    assert not [k for k in env if k.startswith(("TORCHFARM", "AWS", "REDIS"))]
    assert env["PYTHONPATH"] == "/run/torchfarm" and env["HOME"] == env["TMPDIR"] == "/tmp"


def _frames(*reports: pb.CompileChildReport) -> io.BytesIO:
    data = b"".join(FRAME.pack(len(r.SerializeToString())) + r.SerializeToString() for r in reports)
    return io.BytesIO(data)


def test_stages_are_passed_on_and_the_artifact_returned():
    stages: list[int] = []
    stream = _frames(
        pb.CompileChildReport(stage=pb.Progress.AUTOTUNING),
        pb.CompileChildReport(stage=pb.Progress.QUEUED),  # not the child's to say: ignored
        pb.CompileChildReport(stage=pb.Progress.COMPILING),
        pb.CompileChildReport(artifact=b"artifact bytes"),
    )
    assert sandbox._read_reports(stream, WorkerSettings(), stages.append) == b"artifact bytes"
    assert stages == [pb.Progress.AUTOTUNING, pb.Progress.COMPILING]


def test_the_kernels_a_child_reports_are_handed_to_the_caller():
    built = pb.KernelFiles(built={"ab/cabcdefghijklmnopqrstuvwxyz.so": b"elf"}, reused=["x"])
    stream = _frames(
        pb.CompileChildReport(kernels=built), pb.CompileChildReport(artifact=b"artifact bytes")
    )
    kernels = pb.KernelFiles()
    assert sandbox._read_reports(stream, WorkerSettings(), None, kernels) == b"artifact bytes"
    assert kernels == built


def test_the_staging_dir_is_bound_read_only_and_only_when_asked():
    assert sandbox.KERNEL_DIR not in _binds(sandbox.bwrap_args(WorkerSettings(), LAYOUT))
    args = sandbox.bwrap_args(WorkerSettings(), LAYOUT, kernels="/var/tmp/child-1/kernels")
    assert _binds(args)[sandbox.KERNEL_DIR] == "/var/tmp/child-1/kernels"
    assert args[args.index(sandbox.KERNEL_DIR) - 2] == "--ro-bind"
    # bound before the root is made read-only (bwrap creates the mount point)
    assert args.index(sandbox.KERNEL_DIR) < args.index("--remount-ro")


def test_the_gpus_benchmark_lock_is_bound_read_only_and_only_when_given():
    assert sandbox.GPU_LOCK not in _binds(sandbox.bwrap_args(WorkerSettings(device="cuda"), LAYOUT))
    args = sandbox.bwrap_args(WorkerSettings(device="cuda"), LAYOUT, gpu_lock="/home/w/0.lock")
    assert _binds(args)[sandbox.GPU_LOCK] == "/home/w/0.lock"
    assert args[args.index(sandbox.GPU_LOCK) - 2] == "--ro-bind"
    assert args.index(sandbox.GPU_LOCK) < args.index("--remount-ro")


def test_each_child_gets_its_own_staging_dir_only_with_the_cache_on(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox.HostLayout, "probe", classmethod(lambda cls: LAYOUT))
    on, off = tmp_path / "on", tmp_path / "off"
    on.mkdir()
    off.mkdir()
    cmd, _, _ = sandbox.child_command(WorkerSettings(), str(on))
    assert _binds(cmd)[sandbox.KERNEL_DIR] == sandbox.staging_dir(str(on))
    assert os.path.isdir(sandbox.staging_dir(str(on)))
    assert cmd[cmd.index("--kernels") + 1] == sandbox.KERNEL_DIR
    cmd, _, _ = sandbox.child_command(WorkerSettings(kernel_cache_mb=0), str(off))
    assert "--kernels" not in cmd and sandbox.KERNEL_DIR not in _binds(cmd)
    assert not os.listdir(off)


def test_an_artifact_over_the_cap_is_refused_before_it_is_read():
    settings = WorkerSettings(max_artifact_bytes=1000)
    stream = io.BytesIO(FRAME.pack(10**12))  # announces a terabyte, sends nothing
    with pytest.raises(sandbox.CompileFailed, match="TORCHFARM_MAX_ARTIFACT_BYTES") as e:
        sandbox._read_reports(stream, settings, None)
    assert e.value.lasting
    exact = _frames(pb.CompileChildReport(artifact=b"x" * 1001))
    with pytest.raises(sandbox.CompileFailed, match="1001 bytes, over 1000"):
        sandbox._read_reports(exact, settings, None)


def test_a_truncated_or_malformed_report_stream():
    assert sandbox._read_reports(io.BytesIO(b"\0\0"), WorkerSettings(), None) is None
    with pytest.raises(sandbox.CompileFailed, match="malformed"):
        sandbox._read_reports(io.BytesIO(FRAME.pack(3) + b"\xff\xff\xff"), WorkerSettings(), None)


def test_the_error_text_keeps_only_its_end():
    kept: collections.deque[bytes] = collections.deque()
    child_pool._tail(io.BytesIO(b"x" * 100_000 + b"the end"), kept)
    text = b"".join(kept)
    assert text.endswith(b"the end") and len(text) < sandbox.ERROR_TAIL_BYTES + 4096


def test_limits_by_default(monkeypatch):
    for name in ("TORCHFARM_COMPILE_MEMORY_MB", "TORCHFARM_COMPILE_DISK_MB"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TORCHFARM_MAX_ARTIFACT_BYTES", raising=False)
    settings = WorkerSettings.from_env()
    share = compile_share_mb(settings.concurrency, settings.warm_children)
    assert settings.compile_disk_mb == min(4096, share // 4)
    assert settings.memory_limit_mb == compile_memory_mb(share, settings.compile_disk_mb)
    assert settings.max_artifact_bytes == 1 << 30
    monkeypatch.setenv("TORCHFARM_SANDBOX_BINDS", "/opt/a, /opt/b")
    assert WorkerSettings.from_env().sandbox_binds == ("/opt/a", "/opt/b")


def test_a_compiler_named_outside_usr_reaches_the_child_with_its_prefix(tmp_path, monkeypatch):
    # The GPU image's CC=/opt/gcc/bin/gcc: Triton builds its driver stubs with it, and the
    # child failed with "No such file or directory: '/opt/gcc/bin/gcc'" until it was bound.
    prefix, tools = tmp_path / "gcc", tmp_path / "tf-bin"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "gcc").write_text("#!/bin/sh\n")
    tools.mkdir()
    (tools / "ptxas").write_text("#!/bin/sh\n")
    (tools / "unrelated").write_text("")
    monkeypatch.setenv("CC", str(prefix / "bin" / "gcc"))
    monkeypatch.setenv("CXX", "/usr/bin/g++")  # under /usr: bound already
    monkeypatch.setenv("TRITON_PTXAS_PATH", str(tools / "ptxas"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "missing"))
    layout = sandbox.HostLayout.probe()
    assert layout.toolchain == (str(prefix), str(tools / "ptxas"))
    binds = _binds(sandbox.bwrap_args(WorkerSettings(), layout))
    assert binds[str(prefix)] == str(prefix) and str(tools) not in binds
    assert "--bind" not in sandbox.bwrap_args(WorkerSettings(), layout)


def test_a_backward_helper_halves_a_cpu_compiles_memory_cap_and_is_asked_of_the_child(
    monkeypatch, tmp_path
):
    for name in ("TORCHFARM_COMPILE_MEMORY_MB", "TORCHFARM_COMPILE_DISK_MB"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHFARM_CONCURRENT_BACKWARD", "1")
    helped = WorkerSettings.from_env()
    share = compile_share_mb(helped.concurrency, 2 * helped.warm_children)
    assert helped.memory_limit_mb == compile_memory_mb(share, helped.compile_disk_mb, 2)
    assert helped.memory_limit_mb < compile_memory_mb(share, helped.compile_disk_mb)
    monkeypatch.setattr(sandbox.HostLayout, "probe", classmethod(lambda cls: LAYOUT))
    assert "--concurrent-backward" in sandbox.child_command(helped, str(tmp_path))[0]
    monkeypatch.setenv("TORCHFARM_CONCURRENT_BACKWARD", "0")
    alone = WorkerSettings.from_env()
    assert alone.concurrent_backward == "0"
    (tmp_path / "alone").mkdir()
    assert "--concurrent-backward" not in sandbox.child_command(alone, str(tmp_path / "alone"))[0]
    monkeypatch.setenv("TORCHFARM_CONCURRENT_BACKWARD", "yes")
    with pytest.raises(ValueError, match="TORCHFARM_CONCURRENT_BACKWARD must be auto, 1 or 0"):
        WorkerSettings.from_env()


@pytest.mark.parametrize("cores", [2, 16, 32])
def test_the_backward_helper_is_on_by_default_for_gpu_pools_only(monkeypatch, cores):
    """On the GPU zoo it made misses faster, side by side; on CPU pools it is asked for."""
    monkeypatch.delenv("TORCHFARM_CONCURRENT_BACKWARD", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(sizing, "host_memory_mb", lambda: 128 << 10)
    assert not WorkerSettings.from_env().backward_helper
    assert WorkerSettings.from_env(device="cuda").backward_helper
    monkeypatch.setenv("TORCHFARM_CONCURRENT_BACKWARD", "0")
    assert not WorkerSettings.from_env(device="cuda").backward_helper
    monkeypatch.setenv("TORCHFARM_CONCURRENT_BACKWARD", "1")
    assert WorkerSettings.from_env().backward_helper


def test_content_kernel_names_are_asked_of_the_child_and_nothing_else_is_accepted(
    monkeypatch, tmp_path
):
    monkeypatch.setattr(sandbox.HostLayout, "probe", classmethod(lambda cls: LAYOUT))
    monkeypatch.delenv("TORCHFARM_KERNEL_NAMES", raising=False)
    assert (
        "--kernel-names" not in sandbox.child_command(WorkerSettings.from_env(), str(tmp_path))[0]
    )
    monkeypatch.setenv("TORCHFARM_KERNEL_NAMES", "content")
    argv = sandbox.child_command(WorkerSettings.from_env(), str(tmp_path / "content"))[0]
    assert argv[argv.index("--kernel-names") + 1] == "content"
    monkeypatch.setenv("TORCHFARM_KERNEL_NAMES", "short")
    with pytest.raises(ValueError, match="TORCHFARM_KERNEL_NAMES must be unique or content"):
        WorkerSettings.from_env()
