"""The backward helper's report to its compile child (the GEMM candidates it benchmarked),
left in the cache dir the two share: whole or not at all, and junk reads as nothing."""

import os

from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.workers import compile_child


def test_the_helpers_report_reaches_its_child_whole_and_junk_reads_as_none(tmp_path):
    assert compile_child._helper_report(str(tmp_path)) == pb.KernelFiles()  # none left
    compile_child._leave_report(str(tmp_path), pb.KernelFiles(gemm_candidates_benchmarked=4))
    assert compile_child._helper_report(str(tmp_path)).gemm_candidates_benchmarked == 4
    assert os.listdir(tmp_path) == [compile_child.HELPER_REPORT]  # no temporary file left
    (tmp_path / compile_child.HELPER_REPORT).write_bytes(b"\xff\xff\xff")
    assert compile_child._helper_report(str(tmp_path)) == pb.KernelFiles()
