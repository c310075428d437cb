"""A miss in words: both values for readable parts, names only for the others; the last
misses kept for `torchfarm doctor`."""

from torchfarm.client import explain
from torchfarm.proto import torchfarm_pb2 as pb

TARGET = pb.Target(device="cpu", torch_version="2.13.0")
OPTIONS = pb.Options(mode="default")


def test_readable_parts_show_both_values():
    explanation = pb.MissExplanation(
        nearest_found=True,
        differs=[
            pb.PartDifference(part="options.mode", entry_value="max-autotune"),
            pb.PartDifference(part="target.torch_version", entry_value="2.11.0"),
        ],
    )
    assert explain.describe(explanation, TARGET, OPTIONS) == (
        "miss: differs from the nearest entry in mode (default vs max-autotune) and "
        "torch build (2.13.0 vs 2.11.0)"
    )


def test_private_parts_are_named_only():
    explanation = pb.MissExplanation(
        nearest_found=True,
        differs=[pb.PartDifference(part="graph"), pb.PartDifference(part="options.config_patches")],
    )
    text = explain.describe(explanation, TARGET, OPTIONS)
    assert text == (
        "miss: differs from the nearest entry in graph (ops, shapes, dtypes or constants) and "
        "Inductor config patches"
    )


def test_failed_guards_and_no_program():
    failed = pb.MissExplanation(nearest_found=True, failed_guards=["t0 <= 64"])
    assert explain.describe(failed, TARGET, OPTIONS).endswith("guards fail here: t0 <= 64")
    assert "no entry of this program" in explain.describe(pb.MissExplanation(), TARGET, OPTIONS)


def test_the_last_misses_are_kept_bounded(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for i in range(explain.KEPT + 5):
        explain.remember(f"graph {i}", "k" * 64, f"miss {i}")
    assert [m["explanation"] for m in explain.recent(2)] == [
        f"miss {explain.KEPT + 3}",
        f"miss {explain.KEPT + 4}",
    ]
    assert len((tmp_path / "torchfarm" / "misses.jsonl").read_text().splitlines()) == explain.KEPT
