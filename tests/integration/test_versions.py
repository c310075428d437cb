"""The end-to-end check that `make test-versions` runs on every other supported torch: a
fresh process misses and the farm compiles, another fresh process hits the same entry
(the payload's key is stable across processes) and loads it without a compiler, both
equal to eager; and a torch.export program through AOTInductor, a miss then a hit, whose
package equals eager."""

import torch

from tests.integration.helpers import TOKENS, run_client
from tests.models import exported_block, relative_diff
from torchfarm.client import exported
from torchfarm.compiler import aoti
from torchfarm.settings import ClientSettings
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


def test_an_exported_program_through_aoti_on_this_torch(farm, tmp_path):
    settings = ClientSettings(
        addr=farm.addr, token=TOKENS["alice"], verify_keys=farm.verify_keys, progress=False
    )
    model, program = exported_block(seed=0, max_batch=256)  # not test_export's programs
    sources = []
    for name in ("first", "second"):
        artifact, source = exported.package_artifact(program, settings=settings)
        sources.append(source)
        path = tmp_path / f"{name}.pt2"
        aoti.write_package(str(path), artifact, program)
        assert relative_diff(exported.aoti_load_package(path), model) < 1e-5
    assert sources == ["miss", "hit"]
