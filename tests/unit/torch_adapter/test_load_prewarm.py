import subprocess
import sys


def test_resolving_the_backend_imports_the_load_path_and_prewarms_on_a_thread():
    # A fresh interpreter: importing the backend (as Dynamo does for backend="torchfarm")
    # imports the load's modules and starts the thread; a load's wait() sees it finished.
    code = """
import sys
import torchfarm.client.backend
from torchfarm.torch_adapter import load_prewarm
assert "torch._inductor.compile_fx" in sys.modules
assert load_prewarm._thread is not None, "no prewarm started"
load_prewarm.wait()
assert not load_prewarm._thread.is_alive()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
