"""Entry point of the sandboxed compile child: `python -m torchfarm.workers.compile_child DIR`.

Imports the modules named in DIR/op_libraries (the operator's TORCHFARM_OP_LIBRARIES: they
register custom operators), reads DIR/payload.bin and DIR/request.json, writes
DIR/artifact.pb, and keeps DIR/stage
(compiling / autotuning) current for the worker's progress reports. Everything it reads is
hostile; it runs with no network, no secrets and no access to the cache.
"""

import sys


def main(workdir: str) -> int:
    import importlib
    import os

    from google.protobuf import json_format

    from torchfarm.compiler.inductor import compile_payload
    from torchfarm.proto import torchfarm_pb2 as pb

    with open(os.path.join(workdir, "op_libraries")) as f:
        for module in filter(None, (m.strip() for m in f.read().split(","))):
            importlib.import_module(module)
    with open(os.path.join(workdir, "request.json")) as f:
        request = json_format.Parse(f.read(), pb.CompileRequest())
    with open(os.path.join(workdir, "payload.bin"), "rb") as f:
        payload = f.read()

    def on_stage(stage: str) -> None:
        with open(os.path.join(workdir, "stage.tmp"), "w") as f:
            f.write(stage)
        os.replace(os.path.join(workdir, "stage.tmp"), os.path.join(workdir, "stage"))

    artifact = compile_payload(
        payload, request.options, request.target.threads, dict(request.size_hints), on_stage
    )
    tmp = os.path.join(workdir, "artifact.pb.tmp")
    with open(tmp, "wb") as f:
        f.write(artifact.SerializeToString())
    os.replace(tmp, os.path.join(workdir, "artifact.pb"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
