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


def test_the_helper_compiles_backwards_but_not_where_a_gpu_compile_tunes_kernels():
    helps = compile_child._helper_compiles
    tuned = '{"coordinate_descent_tuning": true}'
    assert helps(pb.Options(), "cuda") and helps(pb.Options(mode="reduce-overhead"), "cuda")
    assert helps(pb.Options(mode="max-autotune"), "cpu")  # the CPU's timings: measured apart
    for options in (
        pb.Options(mode="max-autotune"),
        pb.Options(mode="max-autotune-no-cudagraphs"),
        pb.Options(config_patches_json=tuned),
        pb.Options(config_patches_json='{"max_autotune_gemm": true}'),
    ):
        assert not helps(options, "cuda"), options
    off = '{"max_autotune": false, "max_autotune_gemm": false, "coordinate_descent_tuning": false}'
    assert helps(pb.Options(mode="max-autotune-no-cudagraphs", config_patches_json=off), "cuda")
    assert not helps(pb.Options(compiler="aoti"), "cpu")  # no Dynamo graph's backward
    assert helps(pb.Options(mode="no-such-mode"), "cuda")  # the compile refuses it itself
