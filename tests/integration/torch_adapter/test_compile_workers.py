"""Inductor's compile worker pool, started by a warm CUDA child
(torch_adapter/worker/compile_workers)."""

import subprocess
import sys

from torchfarm.torch_adapter.worker import compile_workers

_CHECK = """
from torch._inductor.async_compile import AsyncCompile
from torch.utils._triton import has_triton_package
from torchfarm.torch_adapter.worker import compile_workers
compile_workers.start_and_wait(30)
started = AsyncCompile.process_pool.cache_info().currsize == 1
print(has_triton_package(), started)
"""


def test_the_pool_starts_exactly_where_inductor_compiles_triton_kernels_in_it():
    # Here (a CPU build without Triton) nothing may start; with Triton the pool answers.
    out = subprocess.run(
        [sys.executable, "-c", _CHECK],
        env={"TORCHINDUCTOR_COMPILE_THREADS": "2", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout.split()
    assert out[0] == out[1], out


def test_a_pool_that_cannot_start_leaves_the_compile_to_inductor(capsys, monkeypatch):
    from torch._inductor import async_compile

    def broken() -> None:
        raise OSError("no processes in this sandbox")

    monkeypatch.setattr(compile_workers, "_has_triton", lambda: True)  # as on a GPU worker
    monkeypatch.setattr(async_compile, "maybe_warm_pool", broken)
    compile_workers.start_and_wait(1)  # reported, not raised: the child stays usable
    assert "compile workers not ready: no processes in this sandbox" in capsys.readouterr().err
