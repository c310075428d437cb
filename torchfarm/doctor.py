"""`torchfarm doctor`: check, in order, everything a client needs from its farm.

address set → gateway reachable and healthy → transport (TLS or plaintext) → token accepted →
this machine's target → its pool's workers passed their canary compile → a round-trip
compile of a tiny graph through the farm, compared with eager. Each failed check says what
to do; later checks that depend on it are skipped. Then why this machine's last graphs missed
(the farm's explanations, client/explain.py).
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from torchfarm.cache.pools import summary
from torchfarm.client import backend, explain, remote
from torchfarm.compiler.target import local_target
from torchfarm.contract.pools import describe, pool_name
from torchfarm.errors import FarmError
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.proto import torchfarm_pb2_grpc as pb_grpc
from torchfarm.settings import ClientSettings


@dataclasses.dataclass
class Check:
    """One line of the report: ok is True, False (failed) or None (skipped, or information)."""

    name: str
    ok: bool | None
    detail: str
    advice: str = ""


def run_checks(settings: ClientSettings, device: str = "cpu") -> list[Check]:
    """Every check, in order (stopping at the first failure that later checks depend on),
    then why this machine's last graphs missed, if the farm said."""
    return [*_farm_checks(settings, device), *_misses()]


def _misses() -> list[Check]:
    """The last misses' explanations (client/explain.py), newest last: information only."""
    return [
        Check(
            "last misses" if i == 0 else "",
            None,
            f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(m.get('time', 0)))} "
            f"{m.get('label', '')} key {str(m.get('key', ''))[:16]}: {m.get('explanation', '')}",
        )
        for i, m in enumerate(explain.recent())
    ]


def _farm_checks(settings: ClientSettings, device: str) -> list[Check]:
    unusable = ""
    try:
        remote.target(settings.addr)
    except FarmError as e:
        unusable = str(e)
    checks = [
        Check(
            "address",
            bool(settings.addr) and not unusable,
            unusable or settings.addr or "TORCHFARM_ADDR is not set",
            ""
            if settings.addr and not unusable
            else "export TORCHFARM_ADDR=host:port of the gateway, or a list ip:port,ip:port "
            "(`torchfarm up` prints it for an embedded farm)",
        )
    ]
    if not checks[-1].ok:
        return checks
    checks.append(_health(settings))
    if not checks[-1].ok:
        return checks
    checks.append(
        Check("transport", True, f"TLS, trusting {settings.tls_ca}")
        if settings.tls_ca
        else Check("transport", None, "plaintext gRPC (set TORCHFARM_TLS_CA for a TLS gateway)")
    )
    checks.append(_auth(settings))
    if not checks[-1].ok:
        return checks
    target = local_target(device)
    checks.append(Check("target", None, f"{describe(target)} → pool {pool_name(target)}"))
    checks.append(_pool(settings, pool_name(target)))
    if checks[-1].ok is False:
        return checks
    checks.append(_round_trip(settings, device))
    return checks


def _health(settings: ClientSettings) -> Check:
    channel = remote.channel(settings.addr, settings.tls_ca)
    try:
        grpc.channel_ready_future(channel).result(timeout=settings.connect_timeout_s)
        status = (
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(), timeout=5)
            .status
        )
    except grpc.FutureTimeoutError:
        tls = (
            "; over TLS: is TORCHFARM_TLS_CA the CA of the gateway's certificate, and does "
            "the certificate name this host?"
            if settings.tls_ca
            else "; a TLS gateway needs TORCHFARM_TLS_CA"
        )
        return Check(
            "gateway",
            False,
            f"{settings.addr} unreachable within {settings.connect_timeout_s:g} s",
            f"is the gateway running, and is this host:port reachable from here{tls}",
        )
    except grpc.RpcError as e:
        return Check(
            "gateway",
            False,
            f"health check failed: {e.code().name}",
            "the address answers but is not a torchfarm gateway?",
        )
    serving = status == health_pb2.HealthCheckResponse.SERVING
    return Check(
        "gateway",
        serving,
        health_pb2.HealthCheckResponse.ServingStatus.Name(status),
        "" if serving else "the gateway is up but not serving: see its log",
    )


def _auth(settings: ClientSettings) -> Check:
    """An empty Lookup: the gateway checks the token before it looks at the request."""
    try:
        remote.lookup("0" * 64, settings)
    except FarmError as e:
        message = str(e)
        if message.startswith(("UNAUTHENTICATED", "PERMISSION_DENIED")):
            return Check(
                "token",
                False,
                message,
                "set TORCHFARM_TOKEN to your tenant's token (ask the farm's operator)",
            )
    return Check("token", True, "accepted" if settings.token else "none needed")


def _pool(settings: ClientSettings, pool: str) -> Check:
    """Does a worker serve this machine's pool, and did it pass its canary compile? (The
    round trip alone cannot tell: a cached answer comes back from a pool that cannot
    compile.)"""
    metadata = [("authorization", f"Bearer {settings.token}")] if settings.token else []
    try:
        reply = pb_grpc.FarmStub(remote.channel(settings.addr, settings.tls_ca)).Info(
            pb.InfoRequest(), metadata=metadata, timeout=settings.connect_timeout_s + 30
        )
    except grpc.RpcError as e:
        return Check("pool", False, f"Info failed: {e.code().name}: {e.details()}")
    pools = {p.name: p for p in reply.pools}
    found = pools.get(pool)
    if found is None:
        return Check(
            "pool",
            False,
            f"no worker serves pool {pool}; pools: {', '.join(sorted(pools)) or 'none'}",
            "start a worker on a machine like this one (`torchfarm worker --pool auto`)",
        )
    workers = f"{found.ready_workers} of {found.workers} workers passed their canary compile"
    if found.state == pb.PoolHealth.READY:
        return Check(
            "pool",
            True,
            f"ready: {workers}; {found.compile_slots} compiles at once, "
            f"{found.warm_children} compile children kept warm",
        )
    if found.state == pb.PoolHealth.STARTING:
        return Check("pool", None, f"starting: {workers} so far (compiles queue meanwhile)")
    return Check(
        "pool",
        False,
        f"{pool} cannot compile: {summary(found.error)}",
        "its workers failed their canary compile and exited: fix what the error names "
        "(the worker's log has all of it), then restart them",
    )


def _round_trip(settings: ClientSettings, device: str) -> Check:
    """Compile a two-op function through the farm, as training code would."""

    def tiny(x):
        return torch.nn.functional.gelu(x) * 2 + 1

    x = torch.randn(8, 16, device=device)
    compiled = torch.compile(
        tiny,
        backend=lambda gm, inputs: backend.torchfarm_backend(
            gm, inputs, addr=settings.addr, token=settings.token
        ),
        dynamic=False,
    )
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(x)
    seconds = time.perf_counter() - started
    record = backend.history[-1] if backend.history else None
    if record is None or record.source not in ("hit", "miss", "merged"):
        reason = "; ".join(str(w.message) for w in caught) or "no farm compile happened"
        return Check(
            "round trip",
            False,
            reason,
            "if it names no pool for this target, start a worker on a machine like "
            "this one (`torchfarm worker --pool auto`); otherwise see the gateway "
            "and worker logs",
        )
    if not torch.allclose(out, tiny(x), rtol=1e-4, atol=1e-5):
        return Check(
            "round trip",
            False,
            "the farm's result differs from eager",
            "report this: it is a torchfarm bug",
        )
    return Check(
        "round trip",
        True,
        f"{record.source} in {seconds:.2f} s, {record.bytes:,} bytes, output equals eager",
    )
