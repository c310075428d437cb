"""A GPU's autotuning measurements one at a time (workers/gpu_lock.py): the lock file, the
flock's reentrancy and bounded wait (between real processes, and Inductor's GPU benchmark
path holding it: tests/integration/torch_adapter/test_gpu_benchmark_lock.py)."""

import fcntl
import os
import time

from torchfarm.workers import gpu_lock


def _taken_elsewhere(path: str) -> bool:
    """Whether another open file holds `path`'s flock (an flock belongs to the open file, so
    this process's own other descriptor conflicts too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_a_gpu_gets_one_lock_file_of_a_safe_name(tmp_path):
    path = gpu_lock.lock_file("GPU-1f2e/../x", str(tmp_path))
    assert os.path.dirname(path) == str(tmp_path) and os.path.isfile(path)
    assert os.path.basename(path) == "GPU-1f2e_.._x.lock"
    assert gpu_lock.lock_file("GPU-1f2e/../x", str(tmp_path)) == path


def test_a_lock_that_cannot_be_made_is_none_and_says_so(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert gpu_lock.lock_file("0", str(blocker / "gpu-locks")) == ""
    assert "measure unlocked" in caplog.text


def test_nested_holds_take_the_lock_once_and_the_last_exit_releases_it(tmp_path):
    path = gpu_lock.lock_file("0", str(tmp_path))
    lock = gpu_lock._Lock(path)
    with lock.held():
        with lock.held():  # a benchmark helper calling another: no wait on itself
            assert _taken_elsewhere(path)
        assert _taken_elsewhere(path)
    assert not _taken_elsewhere(path)


def test_a_measurement_waits_at_most_the_bound_then_runs_beside_the_holder(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(gpu_lock, "WAIT_S", 0.3)
    path = gpu_lock.lock_file("0", str(tmp_path))
    holder = os.open(path, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        start = time.monotonic()
        with gpu_lock._Lock(path).held():
            waited = time.monotonic() - start
        assert 0.3 <= waited < 5
        assert "runs beside it" in capsys.readouterr().err
    finally:
        os.close(holder)
