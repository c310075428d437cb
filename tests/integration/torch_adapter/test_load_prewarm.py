import os
import socket
import subprocess
import sys


def _refusing_farm() -> dict[str, str]:
    """This environment with a farm address that refuses connections."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        return dict(os.environ, TORCHFARM_ADDR=f"127.0.0.1:{closed.getsockname()[1]}")


def test_choosing_the_backend_imports_the_load_path_and_prewarms_on_a_thread():
    # A fresh interpreter: importing the backend or its entry module starts nothing; Dynamo's
    # lookup of backend="torchfarm" (in torch.compile, before any trace) imports the load's
    # modules (the client's: nothing of Inductor's compile path, decompositions or debug
    # module) and starts the thread, so both overlap the first trace; a load's wait() sees
    # it finished.
    code = """
import sys
import torch
import torchfarm.client.backend, torchfarm.client.entry
from torchfarm.torch_adapter.load import load_prewarm
assert load_prewarm._thread is None, "importing the backend started the prewarm"
compiled = torch.compile(lambda x: x.sin() + 1, backend="torchfarm")
assert "torchfarm.compiler.inductor" in sys.modules
for unneeded in ("compile_fx", "decomposition", "debug"):  # a load needs none of them
    assert f"torch._inductor.{unneeded}" not in sys.modules, unneeded
assert load_prewarm._thread is not None, "choosing the backend started no prewarm"
compiled(torch.randn(4))
load_prewarm.wait()
assert not load_prewarm._thread.is_alive()
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard: a CUDA build's fresh process took > 120 s on a loaded box
        env=_refusing_farm(),
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_in_no_wait_mode_the_thread_starts_after_the_first_step_and_the_keys_parts_early():
    # TORCHFARM_WAIT=0 (issue 27, finding 7): choosing the backend imports the load's modules
    # but starts no thread to take the GIL from the first step's tracing; `resume` (a no-wait
    # graph's second call) starts it. The target's compiler is probed (a farm address that
    # refuses: the probe does not wait for it).
    code = """
import os, socket, time
import torch
import torchfarm.client.backend
from torchfarm.compiler import target
from torchfarm.torch_adapter.load import load_prewarm
torch.compile(lambda x: x.sin() + 1, backend="torchfarm")(torch.randn(4))
assert "torchfarm.compiler.inductor" in sys.modules
assert "torch._inductor.compile_fx" not in sys.modules  # a load does not need it
assert load_prewarm._thread is None, "the prewarm thread started before the first step"
load_prewarm.resume()
assert load_prewarm._thread is not None
load_prewarm.wait()
deadline = time.monotonic() + 60
while target._compiler.cache_info().currsize == 0:
    assert time.monotonic() < deadline, "the target's compiler was never probed"
    time.sleep(0.01)
print("ok")
"""
    env = dict(_refusing_farm(), TORCHFARM_WAIT="0")
    out = subprocess.run(
        [sys.executable, "-c", "import sys\n" + code],
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard: a CUDA build's fresh process took > 120 s on a loaded box
        env=env,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
