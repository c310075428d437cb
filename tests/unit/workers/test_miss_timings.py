"""The miss's timings: the child's part (its helper's backward) kept, the worker's own
fields never the child's."""

from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.workers.run import miss_timings


def test_the_childs_backward_timings_are_kept_and_its_other_fields_overwritten():
    artifact = pb.Artifact(
        compile_seconds=12.5,
        backward_timings=pb.MissTimings(
            backward_at_s=9.0,
            backward_wait_s=2.5,
            backward_load_s=0.25,
            queued_s=99.0,  # a child's word on the worker's clock counts for nothing
            handoff_s=99.0,
            child_s=99.0,
            compile_s=99.0,
            store_s=99.0,
        ),
    )
    timings = miss_timings(artifact, queued_s=0.5, handoff_s=0.0, child_s=13.0)
    assert timings == pb.MissTimings(
        queued_s=0.5,
        handoff_s=0.0,
        child_s=13.0,
        compile_s=12.5,
        backward_at_s=9.0,
        backward_wait_s=2.5,
        backward_load_s=0.25,
    )


def test_a_compile_without_a_helper_has_no_backward_timings():
    timings = miss_timings(pb.Artifact(compile_seconds=3.0), queued_s=0, handoff_s=0, child_s=3.5)
    assert timings == pb.MissTimings(compile_s=3.0, child_s=3.5)
