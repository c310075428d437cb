"""Several gateways behind TORCHFARM_ADDR: the target gRPC is given, calls balanced over them
(round-robin), and a call whose gateway is gone made again on another. Two real gRPC servers
of the Farm service, answering Lookup with their own name."""

from concurrent import futures

import grpc
import pytest

from torchfarm.client import remote
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc
from torchfarm.settings import ClientSettings


@pytest.mark.parametrize(
    "addr,target",
    [
        ("gateway.example:8470", "gateway.example:8470"),  # a name: all its addresses
        ("dns:///gateways.example:8470", "dns:///gateways.example:8470"),
        ("10.0.0.1:8470, 10.0.0.2:8470", "ipv4:10.0.0.1:8470,10.0.0.2:8470"),
        ("[::1]:1,[fe80::2]:2", "ipv6:[::1]:1,[fe80::2]:2"),
    ],
)
def test_the_target_of_an_address_or_a_list(addr, target):
    assert remote.target(addr) == target


@pytest.mark.parametrize(
    "addr,says",
    [("a.example:1,b.example:2", "IP:port only"), ("10.0.0.1:1,[::1]:2", "all IPv4 or all IPv6")],
)
def test_a_list_gRPC_cannot_resolve_is_refused_clearly(addr, says):
    with pytest.raises(remote.FarmError, match=says):
        remote.target(addr)


class _Named(pb_grpc.FarmServicer):
    def __init__(self, name: str):
        self.name = name

    def Lookup(self, request, context):
        return pb.LookupReply(candidates=[pb.Candidate(digest=self.name)])


def _server(name: str) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_FarmServicer_to_server(_Named(name), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_calls_are_balanced_and_a_gone_gateway_is_skipped():
    (one, port_one), (two, port_two) = _server("one"), _server("two")
    settings = ClientSettings(addr=f"127.0.0.1:{port_one},127.0.0.1:{port_two}")
    try:
        answers = [remote.lookup("0" * 64, settings)[0].digest for _ in range(20)]
        assert set(answers) == {"one", "two"}  # round-robin, not the first address alone
        one.stop(0).wait()
        assert {remote.lookup("0" * 64, settings)[0].digest for _ in range(10)} == {"two"}
    finally:
        two.stop(0)
