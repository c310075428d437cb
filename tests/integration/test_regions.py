"""Regional compilation through the farm (TORCHFARM_REGIONS=1, torch_adapter/regions.py): on
a miss a model's blocks of one shape compile once while the farm compiles the whole graph
too; a sibling of another depth, for another tenant, finds every region of its graph
compiled; a later process of the first model gets the whole graph. Each equal to eager."""

import time

from tests.integration.helpers import run_client

REGIONS = {"TORCHFARM_REGIONS": "1"}


def _wait_for_compiles(count, expected: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while count() < expected:
        assert time.monotonic() < deadline, f"{count()} compiles, expected {expected}"
        time.sleep(1)


def test_blocks_compile_once_and_a_deeper_sibling_of_another_tenant_finds_every_region(farm, store):
    before = int(store.counters.farm().get("compiles", 0))
    compiles = lambda: int(store.counters.farm().get("compiles", 0)) - before  # noqa: E731

    first = run_client(farm, "model_client.py", "stack2", "train", env=REGIONS)
    # input projection, one block (both layers send the same region), head; the whole graph
    # compiles on the farm meanwhile (the client's one call ran the regions)
    assert first["sources"] == ["miss"] * 3, first
    assert first["out_err"] < 1e-4 and first["grad_err"] < 1e-4, first
    _wait_for_compiles(compiles, 4)

    sibling = run_client(farm, "model_client.py", "stack3", "train", tenant="bob", env=REGIONS)
    assert sibling["sources"] == ["hit"] * 3, sibling
    assert sibling["out_err"] < 1e-4 and sibling["grad_err"] < 1e-4, sibling
    assert sibling["local_inductor_compiles"] == 0, sibling

    again = run_client(farm, "model_client.py", "stack2", "train", env=REGIONS)
    assert again["sources"] == ["hit"], again  # the whole graph, no region asked for
    assert again["out_err"] < 1e-4 and again["grad_err"] < 1e-4, again
