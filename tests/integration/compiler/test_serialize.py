"""Graph serialization across processes: the same model gives the same bytes in two
processes run from different paths (the rest: tests/unit/compiler/test_serialize.py)."""

import subprocess
import sys

SCRIPT = """
import hashlib, torch
from torchfarm.compiler import serialize
torch.manual_seed({seed})
m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
def backend(gm, example_inputs):
    print(hashlib.sha256(serialize.dumps(gm)).hexdigest())
    return gm.forward
torch.compile(m, backend=backend, dynamic=True)(torch.randn(8, 16))
"""


def _payload_digest(tmp_path, name: str, seed: int) -> str:
    folder = tmp_path / name
    folder.mkdir()
    script = folder / f"{name}.py"
    script.write_text(SCRIPT.format(seed=seed))
    out = subprocess.run(
        [sys.executable, str(script)], cwd=folder, capture_output=True, text=True, check=True
    )
    return out.stdout.split()[-1]


def test_same_model_gives_same_bytes_in_two_processes_and_paths(tmp_path):
    # Different script paths, working directories and weights (seeds): the same bytes.
    assert _payload_digest(tmp_path, "user_a", 0) == _payload_digest(tmp_path, "user_b", 1)
