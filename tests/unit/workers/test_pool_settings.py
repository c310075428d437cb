"""How many compiles a worker runs at once and how many children it keeps warm: defaults,
validation, and which GPU each CUDA child gets."""

import os

import pytest

from torchfarm.settings import WorkerSettings
from torchfarm.settings.sizing import default_concurrency, visible_gpus
from torchfarm.workers import sandbox


def test_defaults_for_a_cpu_box_and_a_gpu_node(monkeypatch):
    for name in ("TORCHFARM_WORKER_CONCURRENCY", "TORCHFARM_WARM_CHILDREN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    cpu = WorkerSettings.from_env()
    assert cpu.concurrency == 2 and cpu.warm_children == 2  # a 2-core box: two at once
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    gpu = WorkerSettings.from_env(device="cuda")
    assert gpu.concurrency == 16 and gpu.warm_children == 16  # two per visible GPU
    monkeypatch.setattr(os, "cpu_count", lambda: 256)
    assert default_concurrency("cpu") == 8
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert default_concurrency("cuda") == 4  # one GPU, 16 cores: the cores' figure


def test_explicit_sizes_and_a_pool_of_no_warm_children(monkeypatch):
    monkeypatch.setenv("TORCHFARM_WORKER_CONCURRENCY", "3")
    monkeypatch.setenv("TORCHFARM_WARM_CHILDREN", "0")
    settings = WorkerSettings.from_env()
    assert (settings.concurrency, settings.warm_children) == (3, 0)
    # Resolved once: the copy a task rebuilds from the settings' dict is equal (one pool).
    assert WorkerSettings(**{**settings.__dict__}) == settings


@pytest.mark.parametrize(
    "name,value,says",
    [
        ("TORCHFARM_WORKER_CONCURRENCY", "two", "TORCHFARM_WORKER_CONCURRENCY must be a whole"),
        ("TORCHFARM_WORKER_CONCURRENCY", "-1", "TORCHFARM_WORKER_CONCURRENCY must be at least 1"),
        ("TORCHFARM_WARM_CHILDREN", "-2", "TORCHFARM_WARM_CHILDREN must be at least 0"),
        ("TORCHFARM_WARM_UP_TIMEOUT", "0", "TORCHFARM_WARM_UP_TIMEOUT must be positive"),
    ],
)
def test_bad_sizes_are_refused_with_the_variable_named(monkeypatch, name, value, says):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=says):
        WorkerSettings.from_env()


def test_cuda_children_take_the_visible_gpus_in_turn_each_with_its_gpus_lock(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert visible_gpus() == ("2", "5")
    settings = WorkerSettings(device="cuda", sandbox="none", spread_tuning=True)
    gpus = []
    for number in range(3):
        private_dir = str(tmp_path / str(number))
        cmd, env, _ = sandbox.child_command(settings, private_dir, number=number)
        gpus.append(env["CUDA_VISIBLE_DEVICES"])
        staging = sandbox.staging_dir(private_dir)  # unconfined: the host paths themselves
        lock = str(tmp_path / "home/.cache/torchfarm/gpu-locks" / f"{gpus[-1]}.lock")
        assert cmd[-13:] == [
            "--device", "cuda", "--op-libraries", "", "--tuning-gpus", "2,5",
            "--compilers", "inductor,aoti", "--concurrent-backward", "--kernels", staging,
            "--gpu-lock", lock,
        ]  # fmt: skip
        assert os.path.isfile(lock)
    assert gpus == ["2", "5", "2"]
    cpu, _, _ = sandbox.child_command(WorkerSettings(sandbox="none"), str(tmp_path / "cpu"))
    assert "--gpu-lock" not in cpu


def test_the_pools_kernel_builder_measures_under_its_gpus_lock(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    builder = ("-m", "torchfarm.workers.kernel_builder", "--device", "cuda")
    settings = WorkerSettings(device="cuda", sandbox="none")
    cmd, env, _ = sandbox.child_command(settings, str(tmp_path / "b"), builder)
    lock = str(tmp_path / "home/.cache/torchfarm/gpu-locks/3.lock")
    assert cmd[-2:] == ["--gpu-lock", lock] and env["CUDA_VISIBLE_DEVICES"] == "3"


def test_a_child_starts_without_the_lock_where_it_cannot_be_made(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    (tmp_path / "home").write_text("")  # a file: nothing can be made under it
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    settings = WorkerSettings(device="cuda", sandbox="none")
    cmd, env, _ = sandbox.child_command(settings, str(tmp_path / "0"))
    assert "--gpu-lock" not in cmd and env["CUDA_VISIBLE_DEVICES"] == "0"


def test_a_child_benchmarks_on_every_gpu_of_the_worker_where_spreading_is_on(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    monkeypatch.delenv("TORCHFARM_SPREAD_TUNING", raising=False)
    assert sandbox.tuning_gpus(WorkerSettings.from_env(device="cuda")) == ()  # off by default
    monkeypatch.setenv("TORCHFARM_SPREAD_TUNING", "1")
    assert sandbox.tuning_gpus(WorkerSettings.from_env(device="cuda")) == ("2", "5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # one GPU: nothing to spread over
    assert sandbox.tuning_gpus(WorkerSettings.from_env(device="cuda")) == ()
    assert sandbox.tuning_gpus(WorkerSettings(device="cpu", spread_tuning=True)) == ()


def test_without_cuda_visible_devices_the_gpus_are_cudas_ordinals(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # A container given the host's fourth GPU alone: CUDA calls it 0, not 3.
    monkeypatch.setattr(os, "listdir", lambda path: ["nvidia3", "nvidiactl", "nvidia-uvm", "null"])
    assert visible_gpus() == ("0",)
    assert default_concurrency("cuda") == 2
