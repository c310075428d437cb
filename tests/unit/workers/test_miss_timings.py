"""A miss's timings: of the child's, only its helper's backward (the backward_* and helper_*
fields, where the helper compiled it); every other field the worker's, nothing else through."""

from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.workers.run import CHILDS_TIMINGS, miss_timings

# Field 99, length-delimited: a field no MissTimings has, as a hostile child could send one.
UNKNOWN_FIELD = b"\x9a\x06\x05hello"


def _childs(backward: str) -> pb.Artifact:
    """An artifact whose child set every MissTimings field to 99 and added an unknown one."""
    artifact = pb.Artifact(compile_seconds=12.5, backward=backward)
    every = pb.MissTimings(**{f.name: 99.0 for f in pb.MissTimings.DESCRIPTOR.fields})
    artifact.backward_timings.MergeFromString(every.SerializeToString() + UNKNOWN_FIELD)
    return artifact


def test_of_a_helped_backward_only_the_childs_fields_are_kept():
    assert set(CHILDS_TIMINGS) == {
        "backward_at_s",
        "backward_wait_s",
        "backward_load_s",
        "helper_began_s",
        "helper_lowered_s",
        "helper_compiled_s",
    }
    timings = miss_timings(_childs("helper"), queued_s=0.5, handoff_s=0.0, child_s=13.0)
    theirs = {name: 99.0 for name in CHILDS_TIMINGS}
    assert timings == pb.MissTimings(
        queued_s=0.5, handoff_s=0.0, child_s=13.0, compile_s=12.5, **theirs
    )
    assert b"hello" not in timings.SerializeToString()


def test_without_the_helpers_backward_no_child_timing_is_kept():
    for backward in ("child", ""):
        timings = miss_timings(_childs(backward), queued_s=0, handoff_s=0, child_s=3.5)
        assert timings == pb.MissTimings(compile_s=12.5, child_s=3.5)
