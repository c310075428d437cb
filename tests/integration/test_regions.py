"""Regional compilation through the farm (TORCHFARM_REGIONS=1, torch_adapter/regions.py): on
a miss a model's blocks of one shape compile once while the farm compiles the whole graph
too; a sibling of another depth, for another tenant, finds every region of its graph
compiled; a later process of the first model gets the whole graph. Each equal to eager."""

from tests.integration.helpers import run_client

REGIONS = {"TORCHFARM_REGIONS": "1"}


def test_blocks_compile_once_and_a_deeper_sibling_of_another_tenant_finds_every_region(farm, store):
    before = int(store.counters.farm().get("compiles", 0))

    def compiles() -> int:
        return int(store.counters.farm().get("compiles", 0)) - before

    wait = {**REGIONS, "WAIT_FOR_WHOLE": "1"}
    first = run_client(farm, "model_client.py", "stack2", "train", env=wait)
    # input projection, one block (both layers send the same region), head; then, from the
    # second call, the whole graph, which the graph switched to
    assert first["sources"] == ["miss"] * 4, first
    assert compiles() == 4
    assert first["out_err"] < 1e-4 and first["grad_err"] < 1e-4, first
    assert first["settled_err"] < 1e-4, first

    sibling = run_client(farm, "model_client.py", "stack3", "train", tenant="bob", env=REGIONS)
    assert sibling["sources"] == ["hit"] * 3, sibling  # its whole graph: not asked for yet
    assert sibling["out_err"] < 1e-4 and sibling["grad_err"] < 1e-4, sibling
    assert sibling["local_inductor_compiles"] == 0, sibling
    assert compiles() == 4

    again = run_client(farm, "model_client.py", "stack2", "train", env=REGIONS)
    assert again["sources"] == ["hit"], again  # the whole graph, no region asked for
    assert again["out_err"] < 1e-4 and again["grad_err"] < 1e-4, again
    assert compiles() == 4
