"""The pool's GEMM measurements (torch_adapter/worker/gemm_problems.py): the key Inductor files a
GEMM's timings under is parsed back into the problem, anything else is none; a problem out of
range is refused before anything is allocated (a measurement's timings found by a later
compile: tests/integration/torch_adapter/test_gemm_problems.py)."""

import pytest

from torchfarm.errors import BuildRefused
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.torch_adapter.worker import gemm_problems

# An addmm of a GPT's attention projection, as a compile on an H200 keyed it (torch 2.11).
ADDMM = (
    "[('cuda', 'torch.bfloat16', 1024, 768, 0, 1, 0), ('cuda', 'torch.bfloat16', 1024, 256, "
    "256, 1, 0), ('cuda', 'torch.bfloat16', 256, 768, 1, 256, 0)]"
)


def test_a_recorded_key_is_the_problem_and_anything_else_is_none():
    gemm = gemm_problems.problem("addmm", ADDMM, "highest", "cuda")
    assert gemm is not None and gemm.op == "addmm" and gemm.precision == "highest"
    assert [(list(i.size), list(i.stride), i.offset, i.dtype) for i in gemm.inputs] == [
        ([1024, 768], [0, 1], 0, "torch.bfloat16"),
        ([1024, 256], [256, 1], 0, "torch.bfloat16"),
        ([256, 768], [1, 256], 0, "torch.bfloat16"),
    ]
    assert gemm_problems.problems([("addmm", ADDMM, "highest")] * 2, "cuda") == [gemm]
    policy = ADDMM + ":benchmark_policy=eager"  # torch 2.15's key: the measurement's own policy
    assert gemm_problems.problem("addmm", policy, "highest", "cuda") == gemm
    for op, key, device in (
        ("addmm", ADDMM, "cpu"),  # another device than the pool's
        ("convolution", ADDMM, "cuda"),
        ("addmm", ADDMM.replace("768, 1, 256", "768, 1"), "cuda"),  # a number short
        ("addmm", ADDMM.replace("1024, 768", "1024, 768.0"), "cuda"),
        ("addmm", "__import__('os').system('true')", "cuda"),  # not a literal: never run
        ("addmm", "[" * 10000, "cuda"),
        ("mm", ADDMM, "cuda"),  # three operands for two
    ):
        assert gemm_problems.problem(op, key, "highest", device) is None, (op, key)
    assert gemm_problems.problem("addmm", ADDMM, "fastest", "cuda") is None


def _bmm(
    *sizes: tuple[int, ...], dtype: str = "torch.float32", precision: str = "highest"
) -> pb.GemmProblem:
    inputs = [pb.GemmInput(dtype=dtype, size=s, stride=[s[1] * s[2], s[2], 1]) for s in sizes]
    return pb.GemmProblem(op="bmm", inputs=inputs, precision=precision)


def _broadcast_bmm(k: int) -> pb.GemmProblem:
    """A bmm (64, 64, k) x (64, k, 64) of operands broadcast along k (stride 0)."""
    a = pb.GemmInput(dtype="torch.float32", size=[64, 64, k], stride=[64, 1, 0])
    b = pb.GemmInput(dtype="torch.float32", size=[64, k, 64], stride=[64, 0, 1])
    return pb.GemmProblem(op="bmm", inputs=[a, b], precision="highest")


def test_a_problem_out_of_range_is_refused():
    gemm_problems.check(_broadcast_bmm(1 << 10))
    gemm_problems.check(_bmm((8, 64, 96), (8, 96, 64)))
    for forged in (
        pb.GemmProblem(op="_int_mm", inputs=_bmm((8, 4, 4), (8, 4, 4)).inputs),
        _bmm((8, 64, 96), (8, 96, 64), precision="fast"),
        _bmm((8, 64, 96)),  # an operand short
        _bmm((8, 64, 96), (8, 64, 96)),  # shapes bmm refuses
        _bmm((8, 64, 96), (8, 96, 64), dtype="torch.int8"),
        _bmm((8, 1 << 20, 1 << 10), (8, 1 << 10, 64)),  # 32 GB
        _bmm((8, 0, 96), (8, 96, 64)),
        _broadcast_bmm(1 << 24),  # a few bytes of operands for 2^42 multiply-adds
        _bmm((8, 64, 96), (8, 96, 1 << 41)),
    ):
        with pytest.raises(BuildRefused):
            gemm_problems.check(forged)
    mixed = _bmm((8, 64, 96), (8, 96, 64))
    mixed.inputs[1].dtype = "torch.float16"
    negative = _bmm((8, 64, 96), (8, 96, 64))
    negative.inputs[0].stride[0] = -1
    for forged in (mixed, negative):
        with pytest.raises(BuildRefused):
            gemm_problems.check(forged)
