"""Issue 19 on a real farm: a program's later graphs prefetched on its head's hit, per tenant;
a miss that explains itself against the nearest entry of the same program."""

import random
from pathlib import Path

import pytest

from tests.integration.helpers import run_client


def _scale() -> str:
    """A constant of this test's graphs: keys no other test (or earlier run) has."""
    return f"{random.uniform(1.5, 2.5):.6f}"


@pytest.fixture(scope="module")
def program(farm, tmp_path_factory) -> tuple[str, dict, dict]:
    """A program of keys no other test has, its first run (three misses) and that run's
    environment: both tests go on from it (the second run's hits, a miss at another size)
    instead of each compiling a program of its own first."""
    scale = _scale()
    env = {"XDG_CACHE_HOME": str(tmp_path_factory.mktemp("cache_home"))}
    return scale, env, run_client(farm, "program_client.py", scale, "64", env=env)


def test_the_second_run_gets_graphs_two_and_three_from_prefetch(farm, program):
    scale, env, first = program
    assert first["sources"] == ["miss", "miss", "miss"], first["whys"]
    assert first["prefetched"] == [False, False, False]
    assert first["out_err"] < 1e-3
    second = run_client(farm, "program_client.py", scale, "64", env=env)
    assert second["sources"] == ["hit", "hit", "hit"], second["whys"]
    assert second["prefetched"] == [False, True, True]
    assert second["keys"] == first["keys"]
    assert second["out_err"] < 1e-3
    # bob hits alice's public entries, but gets no manifest of her program
    other = run_client(farm, "program_client.py", scale, "64", tenant="bob", env=env)
    assert other["sources"] == ["hit", "hit", "hit"], other["whys"]
    assert other["prefetched"] == [False, False, False]
    assert other["out_err"] < 1e-3


def test_a_miss_names_what_differs_from_the_nearest_entry(farm, program):
    scale, env, first = program
    # the session's farm may hold this program at another scale: either way, it says so
    assert first["sources"] == ["miss", "miss", "miss"], first["whys"]
    assert all(e.startswith("miss: ") for e in first["explanations"]), first["explanations"]
    other_size = run_client(farm, "program_client.py", scale, "48", env=env)
    assert other_size["sources"] == ["miss", "miss", "miss"], other_size["whys"]
    assert (
        other_size["explanations"]
        == ["miss: differs from the nearest entry in graph (ops, shapes, dtypes or constants)"] * 3
    )
    assert other_size["out_err"] < 1e-3
    kept = (Path(env["XDG_CACHE_HOME"]) / "torchfarm" / "misses.jsonl").read_text()
    assert "differs from the nearest entry in graph" in kept
