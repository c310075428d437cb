"""Graphs compile in parallel: DDPOptimizer hands the backend one graph per bucket before
running any, and the client submits them all to the farm before waiting for the first."""

from tests.integration.helpers import run_client

BLOCKS = 6  # tests/models.py's BlockMLP: one graph per block (the head shares the last one)


def test_ddp_buckets_are_all_submitted_before_the_first_is_awaited_and_match_eager(farm):
    first = run_client(farm, "ddp_client.py")
    records = first["records"]
    assert len(records) >= BLOCKS, records
    assert all(r["deferred"] for r in records), records
    assert all(r["source"] in ("miss", "merged", "hit") for r in records), records
    # every graph went to the farm before the first one's code was needed
    assert max(r["submitted"] for r in records) < min(r["awaited"] for r in records), records
    assert first["eager_err"] < 1e-4, first

    # the hit gives exactly the miss's results
    second = run_client(farm, "ddp_client.py")
    assert [r["source"] for r in second["records"]] == ["hit"] * len(records), second
    assert second["eager_err"] < 1e-4 and second["sums"] == first["sums"], second
