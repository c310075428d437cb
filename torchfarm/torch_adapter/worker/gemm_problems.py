"""The pool's GEMM timings, measured by the pool itself (issue 28).

Max-autotune benchmarks the candidates of each GEMM (a Triton or C++ template per config, and
ATen's kernel) and files the timings in Inductor's local cache under the op, its operands'
layouts and the matmul precision (`PersistentCache.lookup`; compile/gemm_benchmarks.py counts
them). A later compile that finds every candidate's timing there benchmarks none. A tenant's
compile child could report any timings, and a forged one would make everyone's GEMM of that
shape take a slow candidate. So a shared job's child reports only the problem: the op it
selected for and the operands' layouts, parsed back from the key Inductor filed the timings
under (`problem`). The pool's builder then measures the problem itself (`measure`): it makes
tensors of those layouts on its own device, runs the op on them through max-autotune, and
Inductor benchmarks every candidate, ATen's included, and keys the timings. Nothing of the
tenant's reaches the measurement but these numbers, each range-checked (`check`); a hostile
payload can only make the pool measure GEMMs of its choosing, once each. A tuned choice is kept
because it measured fastest on the pool's own GPU, never because a child said so.

The op runs twice in the measured graph, on two sets of operands: Inductor's second selection
for one GEMM in a compile can offer a candidate its first did not (22 against 21 on an H200,
torch 2.11: one config is left out the first time), and a later compile whose first
selection is a second one would then miss.

Uses PersistentCache.lookup's key (AlgorithmSelectorCache.key_of: device type, dtype, sizes,
strides, offset; create_inputs_key), torch.get/set_float32_matmul_precision and the
max-autotune-no-cudagraphs mode. Verified: torch 2.11.0 on an H200 (the five GEMMs of a GPT
recorded, measured, and found by a sibling's compile under the same keys), 2.13.0 and 2.15.0
on the CPU (C++ GEMM templates).
"""

from __future__ import annotations

import ast

from torchfarm.errors import BuildRefused
from torchfarm.proto import torchfarm_pb2 as pb

# Inductor's selection name -> the ranks of its operands, as key_of lists them.
OPS: dict[str, tuple[int, ...]] = {
    "mm": (2, 2),
    "addmm": (2, 2, 2),
    "bmm": (3, 3),
    "baddbmm": (3, 3, 3),
}
DTYPES = {"torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2}  # -> bytes per element
PRECISIONS = ("highest", "high", "medium")
MAX_TENSOR_BYTES = 1 << 30  # an operand's storage, or the result, at most
MAX_NUMBER = 1 << 40  # a size, stride or offset
# Multiply-adds of one run: a large training GEMM's (16k tokens x 4096 x 14336 is 2^39.8), so
# that broadcast (stride 0) operands cannot ask the pool for unbounded work in little memory.
MAX_MULTIPLY_ADDS = 1 << 40
MODE = "max-autotune-no-cudagraphs"  # what the pool measures with (cudagraphs decide no GEMM)


def problem(op: str, inputs_key: str, precision: str, device: str) -> pb.GemmProblem | None:
    """The problem that Inductor's lookup of `op` under `inputs_key` (create_inputs_key: a list
    of (device, dtype, *size, *stride, offset), and from 2.15 a suffix naming the benchmark
    policy, which the measurement's own config decides) stands for, on `device`; None where
    the pool does not measure it (another op, another device, out of range)."""
    if op not in OPS:
        return None
    operands = inputs_key[: inputs_key.rfind("]") + 1]  # 2.15 appends `:benchmark_policy=...`
    try:
        keys = ast.literal_eval(operands)  # literals only: nothing runs
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    if not isinstance(keys, list) or len(keys) != len(OPS[op]):
        return None
    found = pb.GemmProblem(op=op, precision=precision)
    for key, rank in zip(keys, OPS[op], strict=True):
        if not isinstance(key, tuple) or len(key) != 3 + 2 * rank or key[0] != device:
            return None
        numbers = key[2:]
        if not all(type(n) is int for n in numbers):
            return None
        found.inputs.add(
            dtype=str(key[1]), size=numbers[:rank], stride=numbers[rank:-1], offset=numbers[-1]
        )
    try:
        check(found)
    except BuildRefused:
        return None
    return found


def problems(benchmarked: list[tuple[str, str, str]], device: str) -> list[pb.GemmProblem]:
    """The distinct problems of gemm_benchmarks' (op, inputs key, precision) list."""
    found: dict[bytes, pb.GemmProblem] = {}
    for op, inputs_key, precision in benchmarked:
        gemm = problem(op, inputs_key, precision, device)
        if gemm is not None:
            found.setdefault(gemm.SerializeToString(deterministic=True), gemm)
    return list(found.values())


def check(gemm: pb.GemmProblem) -> None:
    """BuildRefused unless `gemm` is an op of OPS on operands of its ranks, of one known dtype,
    within MAX_TENSOR_BYTES, whose shapes the op accepts, within MAX_MULTIPLY_ADDS."""
    import torch

    ranks = OPS.get(gemm.op)
    if ranks is None:
        raise BuildRefused(f"not a GEMM the pool measures: {gemm.op[:40]!r}")
    if gemm.precision not in PRECISIONS:
        raise BuildRefused(f"unknown matmul precision {gemm.precision[:40]!r}")
    if [len(i.size) for i in gemm.inputs] != list(ranks):
        raise BuildRefused(f"{gemm.op} takes operands of ranks {ranks}")
    if len({i.dtype for i in gemm.inputs}) != 1 or gemm.inputs[0].dtype not in DTYPES:
        raise BuildRefused("operands of one dtype among " + ", ".join(DTYPES))
    for operand in gemm.inputs:
        if len(operand.stride) != len(operand.size):
            raise BuildRefused("a stride per dimension")
        if not all(0 < n <= MAX_NUMBER for n in operand.size) or not all(
            0 <= n <= MAX_NUMBER for n in (*operand.stride, operand.offset)
        ):
            raise BuildRefused("sizes, strides or offset out of range")
        if _storage(operand) * DTYPES[operand.dtype] > MAX_TENSOR_BYTES:
            raise BuildRefused("an operand over the pool's limit")
    try:
        result = getattr(torch, gemm.op)(*(_tensor(i, "meta") for i in gemm.inputs))
    except RuntimeError as e:
        raise BuildRefused(f"{gemm.op} refuses these shapes: {str(e)[:200]}") from None
    if result.numel() * result.element_size() > MAX_TENSOR_BYTES:
        raise BuildRefused("a result over the pool's limit")
    if result.numel() * gemm.inputs[-2].size[-1] > MAX_MULTIPLY_ADDS:  # the first matrix's K
        raise BuildRefused("more work than the pool measures")


def measure(gemm: pb.GemmProblem, device: str) -> None:
    """Benchmark `gemm`'s candidates on `device` as a max-autotune compile would, so that
    Inductor files their timings in the cache dir (its `cache/<system hash>`). Builder child
    only: it compiles and runs kernels."""
    import torch

    from torchfarm.torch_adapter.compile import standalone

    check(gemm)
    op, count = getattr(torch, gemm.op), len(gemm.inputs)
    operands = [_tensor(i, device) for _ in range(2) for i in gemm.inputs]

    def twice(*operands):
        return op(*operands[:count]), op(*operands[count:])

    torch.set_float32_matmul_precision(gemm.precision)
    options = {**standalone.mode_options(MODE), "fx_graph_cache": False}
    torch.compile(twice, fullgraph=True, dynamic=False, options=options)(*operands)


def _storage(operand: pb.GemmInput) -> int:
    """Elements the operand's storage needs."""
    return operand.offset + 1 + sum((s - 1) * t for s, t in zip(operand.size, operand.stride))


def _tensor(operand: pb.GemmInput, device: str):
    import torch

    dtype = getattr(torch, operand.dtype.removeprefix("torch."))
    storage = torch.empty(_storage(operand), dtype=dtype, device=device)
    if device != "meta":
        storage.normal_()
    return storage.as_strided(list(operand.size), list(operand.stride), operand.offset)
