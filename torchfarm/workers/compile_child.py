"""Entry point of the sandboxed compile child: `python -m torchfarm.workers.compile_child`.

It speaks the contract's child protocol (CompileChildRequest / CompileChildReport in
torchfarm.proto) over pipes only: one request on stdin, length-prefixed reports on stdout.
So nothing of a tenant's compile is ever a file the host can see, and a crashed worker leaves
nothing behind. It imports the operator's TORCHFARM_OP_LIBRARIES first (they register custom
operators), then compiles. Everything it reads is hostile; it runs with no network, no
secrets, no capabilities and no access to the cache.
"""

from __future__ import annotations

import os
import struct
import sys
from typing import BinaryIO

from torchfarm.proto import torchfarm_pb2 as pb

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


def main() -> int:
    global _reports
    # Whatever the compile prints goes to stderr (the error text), never into the reports.
    _reports = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    request = pb.CompileChildRequest.FromString(sys.stdin.buffer.read())

    import importlib

    from torchfarm.compiler.inductor import compile_payload

    for module in request.op_libraries:
        importlib.import_module(module)
    artifact = compile_payload(
        request.graph,
        request.options,
        request.target.threads,
        dict(request.size_hints),
        _on_stage,
    )
    report(pb.CompileChildReport(artifact=artifact.SerializeToString()))
    return 0


if __name__ == "__main__":  # run the importable module's main, so report() has one state
    from torchfarm.workers import compile_child

    sys.exit(compile_child.main())
