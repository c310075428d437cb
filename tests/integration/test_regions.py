"""Regional compilation through the farm (TORCHFARM_REGIONS=1, torch_adapter/regions.py): a
model's blocks of one shape compile once, and a sibling of another depth, for another tenant,
finds every region of its graph compiled, equal to eager."""

from tests.integration.helpers import run_client

REGIONS = {"TORCHFARM_REGIONS": "1"}


def test_blocks_compile_once_and_a_deeper_sibling_of_another_tenant_finds_every_region(farm, store):
    compiles = lambda: int(store.counters.farm().get("compiles", 0))  # noqa: E731
    before = compiles()
    first = run_client(farm, "model_client.py", "stack2", "train", env=REGIONS)
    # input projection, one block (both layers send the same region), head
    assert first["sources"] == ["miss"] * 3, first
    assert compiles() - before == 3
    assert first["out_err"] < 1e-4 and first["grad_err"] < 1e-4, first

    sibling = run_client(farm, "model_client.py", "stack3", "train", tenant="bob", env=REGIONS)
    assert sibling["sources"] == ["hit"] * 3, sibling
    assert compiles() - before == 3
    assert sibling["out_err"] < 1e-4 and sibling["grad_err"] < 1e-4, sibling
    assert sibling["local_inductor_compiles"] == 0, sibling
