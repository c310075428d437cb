"""Entry point of the sandboxed compile child: `python -m torchfarm.workers.compile_child`.

It speaks the contract's child protocol (CompileChildRequest / CompileChildReport in
torchfarm.proto) over pipes only: one request on stdin, length-prefixed reports on stdout.
So nothing of a tenant's compile is a file the host can see, and a crashed worker leaves
nothing behind; the one exception is the C++ objects a private job's child reports, which its
parent checks and keeps for that tenant's later compiles (kernel_cache.py); a shared job's
child reports the C++ sources it built, which only ever reach a kernel build of the pool's
(kernel_builder.py). Everything it
reads is hostile; it runs with no network, no secrets, no capabilities and no access to the
cache.

A child is started ahead of need (workers/child_pool.py): it first warms up with nothing of a
tenant's (torch, Inductor, Triton and the operator's TORCHFARM_OP_LIBRARIES imported, on CUDA
the context made and Triton's driver stubs built), reports `ready`, and only then reads its
one request. It compiles that one and exits, so no two tenants ever share a process.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import struct
import sys
import tempfile
from typing import BinaryIO

from torchfarm.compiler import compilers
from torchfarm.contract.options import compiler_of
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.workers import kernel_cache

# Each report on the child's stdout is preceded by its length, 8 bytes big-endian.
FRAME = struct.Struct(">Q")

_reports: BinaryIO | None = None  # the real stdout; fd 1 itself then points at stderr


def report(message: pb.CompileChildReport) -> None:
    """Send one report to the parent."""
    assert _reports is not None, "report() before main() took over stdout"
    data = message.SerializeToString()
    _reports.write(FRAME.pack(len(data)) + data)
    _reports.flush()


def _on_stage(stage: pb.Progress.Stage.ValueType) -> None:
    report(pb.CompileChildReport(stage=stage))


def warm_up(device: str, op_libraries: list[str], isa_checks: str = "") -> None:
    """Everything a compile needs that no request decides, done before the request exists."""
    import torch
    import torch._inductor.codecache
    import torch._inductor.compile_fx  # noqa: F401  (the standalone_compile path)

    import torchfarm.compiler.inductor  # noqa: F401

    for module in op_libraries:
        importlib.import_module(module)
    if device == "cuda":
        torch.zeros(1, device="cuda")  # the CUDA context
        try:
            from triton.runtime import driver
        except ImportError:  # a CUDA build without Triton: nothing more to build
            return
        from torchfarm.torch_adapter import compile_workers

        driver.active.utils  # noqa: B018  (compiles Triton's C driver stubs into its cache dir)
        compile_workers.start_and_wait()  # Inductor's Triton compile workers, answering
    else:
        from torch._inductor import cpu_vec_isa

        from torchfarm.torch_adapter import isa_probe, standalone

        # The ISA probe (instant where the worker's probe vouched), remembered in-process; its
        # test programs go to a directory removed at once, so the request finds an empty home.
        with (
            tempfile.TemporaryDirectory() as probe_dir,
            standalone.cache_dir_at(probe_dir),
            isa_probe.vouched_checks(isa_checks),
        ):
            cpu_vec_isa.pick_vec_isa()


def _arguments(argv: list[str]) -> argparse.Namespace:
    """What to warm up for: the worker's device and TORCHFARM_OP_LIBRARIES (nothing secret)."""
    parser = argparse.ArgumentParser(prog="torchfarm.workers.compile_child")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--op-libraries", default="", help="comma-separated modules")
    parser.add_argument("--kernels", default="", help="staged C++ objects (kernel_cache.py)")
    parser.add_argument("--isa-checks", default="", help="the worker's ISA probe (isa_probe.py)")
    parser.add_argument(
        "--tuning-gpus", default="", help="GPUs to benchmark candidates on (tuning_devices.py)"
    )
    parser.add_argument(
        "--compilers", default=compilers.DEFAULT, help="the pool's TORCHFARM_COMPILERS"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    global _reports
    args = _arguments(sys.argv[1:] if argv is None else argv)
    # Whatever the compile prints goes to stderr (the error text), never into the reports.
    _reports = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    warm_up(args.device, [m for m in args.op_libraries.split(",") if m], args.isa_checks)
    report(pb.CompileChildReport(ready=True))
    data = sys.stdin.buffer.read()
    if not data:  # the worker closed the pipe without a request: it is going away
        return 0
    request = pb.CompileChildRequest.FromString(data)
    cache_dir = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    sources: list[pb.KernelSource] = []
    with contextlib.ExitStack() as kernels:
        if args.kernels:  # before anything of the tenant's runs
            kernels.enter_context(kernel_cache.looking_up(args.kernels, cache_dir))
        if request.kernel_sources:
            kernels.enter_context(kernel_cache.recording(sources))

        for module in request.op_libraries:
            importlib.import_module(module)
        compiler = compilers.load(compiler_of(request.options), compilers.parse(args.compilers))
        context = compilers.CompileContext(
            on_stage=_on_stage, tuning_gpus=tuple(g for g in args.tuning_gpus.split(",") if g)
        )
        artifact = compiler.compile(request, context)
    if args.kernels:
        files = kernel_cache.report(cache_dir, args.kernels, built=request.kernel_cache)
        files.sources.extend(sources)
        report(pb.CompileChildReport(kernels=files))
    report(pb.CompileChildReport(artifact=artifact.SerializeToString()))
    return 0


if __name__ == "__main__":  # run the importable module's main, so report() has one state
    from torchfarm.workers import compile_child

    sys.exit(compile_child.main())
