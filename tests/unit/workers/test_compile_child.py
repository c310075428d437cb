"""A compile child and its backward helper: the child's pipe to the helper (the request, then
the forward's output strides), and the helper's report to its child (the GEMM candidates it
benchmarked) and its backward's key, left in the cache dir the two share: whole or not at
all, and junk reads as nothing."""

import dataclasses
import json
import os
import types

from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.workers import compile_child


def test_the_helpers_report_reaches_its_child_whole_and_junk_reads_as_none(tmp_path):
    assert compile_child._helper_report(str(tmp_path)) == pb.KernelFiles()  # none left
    files = pb.KernelFiles(gemm_candidates_benchmarked=4)
    compile_child._leave(str(tmp_path), compile_child.HELPER_REPORT, files.SerializeToString())
    assert compile_child._helper_report(str(tmp_path)).gemm_candidates_benchmarked == 4
    assert os.listdir(tmp_path) == [compile_child.HELPER_REPORT]  # no temporary file left
    (tmp_path / compile_child.HELPER_REPORT).write_bytes(b"\xff\xff\xff")
    assert compile_child._helper_report(str(tmp_path)) == pb.KernelFiles()


def test_the_helpers_key_reaches_its_child_and_junk_reads_as_none(tmp_path):
    from torchfarm.torch_adapter.compile.concurrent_backward import Key

    assert compile_child._helper_key(str(tmp_path)) is None  # none left
    key = Key("fabc", ["[abc] gm: GraphModule()\n\ndef forward(self):", "[def] default_dtype: x"])
    compile_child._leave(
        str(tmp_path), compile_child.HELPER_KEY, json.dumps(dataclasses.asdict(key)).encode()
    )
    assert compile_child._helper_key(str(tmp_path)) == key
    for junk in (b"\xff", b"[]", b'{"key": "k"}'):
        (tmp_path / compile_child.HELPER_KEY).write_bytes(junk)
        assert compile_child._helper_key(str(tmp_path)) is None


def test_the_helpers_times_reach_its_child_on_its_clock_and_junk_reads_as_none(tmp_path):
    assert compile_child._helper_times(str(tmp_path), 100.0) == pb.MissTimings()  # none left
    left = {"began": 102.5, "lowered": 0.0, "compiled": 99.0}  # not lowered; before started
    compile_child._leave(str(tmp_path), compile_child.HELPER_TIMES, json.dumps(left).encode())
    assert compile_child._helper_times(str(tmp_path), 100.0) == pb.MissTimings(
        helper_began_s=2.5, helper_compiled_s=-1.0
    )
    for junk in (b"\xff", b"[]", b'{"began": "soon"}', b'{"began": [1]}', b"null"):
        (tmp_path / compile_child.HELPER_TIMES).write_bytes(junk)
        assert compile_child._helper_times(str(tmp_path), 100.0) == pb.MissTimings()


def _helper_pipe():
    """A helper as the child sees it (its stdin), and the other end of that pipe."""
    read_end, write_end = os.pipe()
    return types.SimpleNamespace(stdin=os.fdopen(write_end, "wb")), os.fdopen(read_end, "rb")


def test_the_helper_reads_the_request_then_the_forwards_strides_then_the_end():
    helper, stdin = _helper_pipe()
    send = compile_child._hand_over(helper, b"request", compiles=True)
    send([(8, 1, 4, 2), None, (3,)])
    send(None)
    assert compile_child._read_frame(stdin) == b"request"
    assert compile_child._strides(stdin) == [(8, 1, 4, 2), None, (3,)]
    assert compile_child._strides(stdin) is None  # the child closed the pipe


def test_a_helper_with_nothing_to_do_reads_the_end_at_once():
    helper, stdin = _helper_pipe()
    send = compile_child._hand_over(helper, b"request", compiles=False)
    send([(1,)])  # never written: the pipe is closed already
    assert compile_child._read_frame(stdin) is None
