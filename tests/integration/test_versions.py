"""The end-to-end check that `make test-versions` runs on every other supported torch: a
fresh process misses and the farm compiles, another fresh process hits the same entry
(the payload's key is stable across processes) and loads it without a compiler, both
equal to eager."""

import torch

from tests.integration.helpers import run_client
from torchfarm.torch_adapter import gate

ATOL = 1e-4


def test_a_miss_then_a_hit_in_fresh_processes_on_this_torch(farm, store, compiler_log):
    assert gate.release(torch.__version__) in gate.VERIFIED
    compiles_before = store.counters.farm().get("compiles", 0)
    first = run_client(farm, "model_client.py", "mlp12", "train")
    assert first["sources"] == ["miss"]
    bindir, log = compiler_log
    second = run_client(farm, "model_client.py", "mlp12", "train", path_prefix=bindir)
    assert second["sources"] == ["hit"]
    assert store.counters.farm().get("compiles", 0) == compiles_before + 1
    assert second["local_inductor_compiles"] == 0
    calls = log.read_text().splitlines() if log.exists() else []
    assert not [c for c in calls if ".cpp" in c or " -c " in c or " -o " in c], calls
    for result in (first, second):
        assert result["out_err"] < ATOL and result["grad_err"] < ATOL
