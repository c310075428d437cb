"""A process that exits while graphs are still being fetched exits at once: the pool's
threads do not hold it (the farm here is a gRPC server whose Get misses, then never
finishes the compile)."""

import subprocess
import sys
import textwrap
import threading
import time
from concurrent import futures

import grpc

from torchfarm import signing
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc

CLIENT = textwrap.dedent(
    """
    import sys
    import torch
    from torchfarm.client.backend import torchfarm_backend
    from torchfarm.client.deferred import DeferredGraph

    def capture(gm, example_inputs):
        compiled = torchfarm_backend(gm, example_inputs, addr=sys.argv[1])
        assert isinstance(compiled, DeferredGraph), compiled
        return gm.forward  # never calls the deferred graph: its fetch stays in flight

    torch.compile(lambda x: x.sin() + 1, backend=capture)(torch.randn(4))
    print("submitted", flush=True)
    sys.stdin.readline()  # the farm has the payload: exit with its compile in flight
    """
)


class EndlessFarm(pb_grpc.FarmServicer):
    def __init__(self, verify_key: str):
        self.verify_key = verify_key
        self.compiling = threading.Event()

    def Info(self, request, context):
        return pb.InfoReply(verify_keys=[self.verify_key])

    def Get(self, requests, context):
        next(requests)  # the ask
        yield pb.CompileEvent(missing=pb.Missing())
        next(requests)  # the payload
        self.compiling.set()
        while context.is_active():
            yield pb.CompileEvent(progress=pb.Progress(stage=pb.Progress.COMPILING))
            time.sleep(0.5)


def test_a_process_exits_with_a_graph_in_flight(tmp_path):
    farm = EndlessFarm(signing.generate(str(tmp_path / "signing.key")).public_key)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_FarmServicer_to_server(farm, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, f"127.0.0.1:{port}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert client.stdout is not None and client.stdin is not None
        assert client.stdout.readline().strip() == "submitted"
        assert farm.compiling.wait(60)
        client.stdin.write("exit\n")
        client.stdin.flush()
        assert client.wait(timeout=120) == 0
    finally:
        client.kill()  # a client that hung (the failure this test looks for) does not stay
        server.stop(0)
