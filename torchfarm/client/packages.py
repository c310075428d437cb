"""Skipping Dynamo's tracing on a hit (issue 19 item 4): a compiled function's Dynamo package.

The first process traces as always; after the function's first call it saves, on the farm,
what Dynamo produced (guards, transformed bytecode per frame: torch_adapter/trace/dynamo_package.py)
with, per Dynamo graph, the farm request that compiled it and the artifact served. A later
process with the same key fetches that package at compile time, fetches every graph's artifact
in parallel through the backend's own fetch path, loads them and installs the package: its
frames run without being traced. Dynamo still checks the saved guards on every call; inputs or
globals that fail them are traced and compiled as before.

The package holds the client's source and pickled guarded values, so it is the tenant's own
(gateway/packages.py scopes it by tenant) and authenticated here with an HMAC: bytes that fail
the check are never unpickled. Its key is a secret that never leaves the client
(TORCHFARM_PACKAGE_KEY, else this user's key file, made 0600 on first use), bound to the
tenant's token. Not the token alone (issue 27): the gateway sees the token on every call, and
it crosses the network in plaintext without TLS, so whoever saw it could have sealed a pickle
this client would run. The cost: a package is restorable only where the secret is, so the
ranks and machines of one job share it by TORCHFARM_PACKAGE_KEY; elsewhere they trace and save
packages of their own (their keys differ, so they never overwrite each other's). Any failure
while restoring falls back to tracing, silently but for a log line.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import importlib.metadata
import inspect
import json
import logging
import os
import pickle
import platform
import secrets
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import torch

from torchfarm.client import fetch, graph, records, remote
from torchfarm.client.pool import pool
from torchfarm.compiler import serialize, trace_state
from torchfarm.contract.cache_key import public_key
from torchfarm.errors import FarmError, TorchfarmError
from torchfarm.proto import torchfarm_pb2 as pb
from torchfarm.settings import ClientSettings, user_cache_dir
from torchfarm.torch_adapter.trace import dynamo_package
from torchfarm.torch_adapter.trace.guard_text import hints, symbol_inputs

log = logging.getLogger("torchfarm")
FORMAT = b"torchfarm-dynamo-package-1"
_MAC_BYTES = 32
MIN_SECRET_CHARS = 32  # 128 bits as hex; the key file holds 64 hex digits
_FARM_SOURCES = ("hit", "miss", "merged")


@dataclasses.dataclass(frozen=True)
class GraphRef:
    """How a later process gets one Dynamo graph's code without tracing it."""

    request: bytes  # the CompileRequest the backend sent (payload, target, options)
    sizes: list[int]  # its SymInt inputs' sizes in that trace: choose among entries
    digest: str  # the artifact that trace loaded: Dynamo's saved guards include its guards
    device_index: int | None
    key: str = ""  # its graph key: a hit names the entry, hashing no payload ("": compute it)


@dataclasses.dataclass(frozen=True)
class Contents:
    dynamo: bytes  # dynamo_package.dumps
    graphs: dict[str, GraphRef]  # by Dynamo's backend id
    # Why the first process could not save the package (dynamo and graphs empty): later
    # processes compile as without the skip instead of recording and failing again
    left_out: str = ""


class PackageLeftOut(TorchfarmError):
    """The farm holds, for this package key, the reason its package cannot be saved."""


# Every graph's request this process sent, by backend id (filled by the backend's observer).
_requests: dict[str, tuple[pb.CompileRequest, list[int], int | None]] = {}


def _observe(gm: torch.fx.GraphModule, request: pb.CompileRequest) -> None:
    sizes = hints(symbol_inputs(serialize.example_inputs(gm)))
    _requests[dynamo_package.backend_id(gm)] = (request, sizes, serialize.local_device_index(gm))


def mac_key(secret: bytes, token: str) -> bytes:
    """The key that authenticates this user's packages of one tenant: the client's secret
    (package_secret) over the tenant's token, so neither the farm nor whoever saw the token
    can forge a package, and one tenant's package never opens as another's."""
    return hmac.new(secret, FORMAT + b"\0" + token.encode(), hashlib.sha256).digest()


def package_secret(settings: ClientSettings) -> bytes:
    """TORCHFARM_PACKAGE_KEY, else this user's key file (made on first use)."""
    secret = settings.package_key.encode() if settings.package_key else _key_file_secret()
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"TORCHFARM_PACKAGE_KEY: at least {MIN_SECRET_CHARS} characters")
    return secret


def key_file() -> Path:
    return user_cache_dir() / "package.key"


def _key_file_secret() -> bytes:
    """The key file's secret; made (64 random hex digits, mode 0600) if there is none. Written
    aside, then linked into place, which never replaces a file: processes that start together
    (a job's ranks) all read the one that won."""
    path = key_file()
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, aside = tempfile.mkstemp(dir=path.parent, prefix=".package.key.")  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
        finally:
            os.unlink(aside)
    with open(path, "rb") as f:
        status = os.fstat(f.fileno())
        if status.st_uid != os.geteuid() or status.st_mode & 0o077:
            raise PermissionError(
                f"{path} must be this user's own, mode 0600: it keys the Dynamo packages this "
                "client unpickles"
            )
        return f.read().strip()


def seal(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest() + data


def unseal(key: bytes, sealed: bytes) -> bytes | None:
    """The data, or None when the HMAC fails (then nothing of it is unpickled)."""
    mac, data = sealed[:_MAC_BYTES], sealed[_MAC_BYTES:]
    return data if hmac.compare_digest(mac, hmac.new(key, data, hashlib.sha256).digest()) else None


def package_key(mac: bytes, target: Callable, options: dict) -> str:
    """The MAC key's hash (tenant and secret: processes with another secret never overwrite
    this one's packages), torch / Python / torchfarm versions, the traced code's module
    source, its qualified name, the model's configuration (structure, parameter shapes and
    dtypes) and the compile's options. Sources Dynamo inlined from other modules are checked by the
    package itself on install (a change falls back to tracing and re-saves)."""
    fn = dynamo_package.entry_function(target)
    module = inspect.getmodule(fn)
    parts = {
        "tenant": hashlib.sha256(mac).hexdigest(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torchfarm": importlib.metadata.version("torchfarm"),
        "checks": dynamo_package.CHECKS,  # what a saved frame's guards mean
        "name": f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}",
        "source": hashlib.sha256(inspect.getsource(module).encode()).hexdigest() if module else "",
        "options": options,
        "state": trace_state.capture().SerializeToString().hex(),
    }
    if isinstance(target, torch.nn.Module):
        parts["config"] = repr(target)
        parts["tensors"] = [
            (name, list(t.shape), str(t.dtype), str(t.device))
            for name, t in [*target.named_parameters(), *target.named_buffers()]
        ]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class Skipper:
    """One compiled function's package: restored at compile time where the farm has one, saved
    after the first call where any frame of it was traced."""

    def __init__(self, target: Callable, settings: ClientSettings, options: dict):
        self.target, self.settings = target, settings
        self.mac = mac_key(package_secret(settings), settings.token)
        self.key = package_key(self.mac, target, options)
        self.graphs: dict[str, GraphRef] = {}
        self.restored = False
        self.saved = False
        self.found = True  # a package or a left-out reason is on the farm (or it failed to say)
        if _observe not in graph.request_observers:
            graph.request_observers.append(_observe)
        self.package = self._restore()

    def _restore(self) -> dynamo_package.Package:
        """The restored package, else one recording; raises PackageLeftOut where the farm
        says no package can be saved."""
        started = time.monotonic()
        try:
            contents = self._fetch_contents()
            if contents is not None and contents.left_out:
                raise PackageLeftOut(f"a first process could not save it: {contents.left_out}")
            if contents is not None:
                package = dynamo_package.new_package()
                dynamo_package.install(
                    package, self.target, contents.dynamo, _load_graphs(contents, self.settings)
                )
                self.graphs, self.restored = dict(contents.graphs), True
                log.info(
                    "dynamo package %s: restored %d graphs in %.2f s (no tracing)",
                    self.key[:16],
                    len(contents.graphs),
                    time.monotonic() - started,
                )
                return package
        except PackageLeftOut:
            raise
        except Exception as e:  # any other failure: trace as before
            log.info("dynamo package %s not restored (%s: %s)", self.key[:16], type(e).__name__, e)
        package = dynamo_package.new_package()
        dynamo_package.record(package, self.target)
        return package

    def _fetch_contents(self) -> Contents | None:
        reply = _call(self.settings, "GetPackage", pb.GetPackageRequest(key=self.key))
        if not reply.found:
            log.info("dynamo package %s: none on the farm", self.key[:16])
            self.found = False
            return None
        data = unseal(self.mac, reply.package)
        if data is None:
            log.warning("dynamo package %s failed its HMAC check: ignored", self.key[:16])
            return None
        contents = pickle.loads(data)
        if not isinstance(contents, Contents):
            raise TypeError(f"not a package: {type(contents).__name__}")
        return contents

    def after_first_call(self) -> None:
        """Saves the package unless it was restored whole (no frame traced). Never raises."""
        if self.saved:
            return
        self.saved = True
        try:
            try:
                dynamo = dynamo_package.dumps(self.package)
                ids = dynamo_package.backend_ids(dynamo)
            except Exception as e:
                self._leave_out(f"{type(e).__name__}: {e}")
                raise
            if not ids:  # every graph's frame left out: a restore would trace them all anyway
                self._leave_out("no frame with a graph could be saved")
                return
            if self.restored and ids <= set(self.graphs):
                return
            graphs = {bid: self.graphs.get(bid) or _graph_ref(bid) for bid in ids}
            log.info(
                "dynamo package %s: saved (%d bytes)",
                self.key[:16],
                self._put(Contents(dynamo, graphs)),
            )
        except Exception as e:
            log.info("dynamo package %s not saved (%s: %s)", self.key[:16], type(e).__name__, e)

    def _leave_out(self, why: str) -> None:
        """Tell later processes to compile without the skip (PackageLeftOut), unless the farm
        may hold another process's package (never overwritten)."""
        if not self.found:
            self._put(Contents(b"", {}, left_out=why[:500]))
            log.info("dynamo package %s: left out (%s)", self.key[:16], why)

    def _put(self, contents: Contents) -> int:
        """Seal and store `contents` on the farm; its size in bytes."""
        sealed = seal(self.mac, pickle.dumps(contents))
        _call(self.settings, "PutPackage", pb.PutPackageRequest(key=self.key, package=sealed))
        return len(sealed)


def _graph_ref(bid: str) -> GraphRef:
    """The farm request and artifact of a graph traced here; raises where the farm did not
    serve it (compiled locally: a later process would have nothing to fetch)."""
    request, sizes, device_index = _requests[bid]
    record = next(r for r in reversed(records.history) if r.label == request.label)
    if record.source not in _FARM_SOURCES or not record.digest:
        raise LookupError(f"{request.label} was not served by the farm ({record.source})")
    key = public_key(request.graph, request.target, request.options, request.descriptor)
    return GraphRef(request.SerializeToString(), sizes, record.digest, device_index, key)


def _load_graphs(contents: Contents, settings: ClientSettings) -> dict[str, Callable]:
    """Every graph's code: fetched in parallel (the backend's fetch path, signatures checked),
    loaded here one after another (loading is not proven thread-safe)."""
    requests = {
        bid: pb.CompileRequest.FromString(ref.request) for bid, ref in contents.graphs.items()
    }
    started = time.monotonic()
    jobs = {
        bid: pool(max(1, settings.parallel_graphs)).submit(
            functools.partial(fetch_graph, requests[bid], settings, ref)
        )
        for bid, ref in contents.graphs.items()
    }
    loaded = {}
    for bid, job in jobs.items():
        fetched = job.result()
        ref = contents.graphs[bid]
        if fetched.header.digest != ref.digest:
            raise LookupError(
                f"the farm served {fetched.header.digest[:16]}, the package needs {ref.digest[:16]}"
            )
        loaded[bid] = graph.load_code(
            fetched.artifact, requests[bid].options, ref.device_index, fetched.timings
        )
        records.add_served(records.served(requests[bid].label, started, fetched))
    return loaded


def fetch_graph(
    request: pb.CompileRequest, settings: ClientSettings, ref: GraphRef
) -> fetch.Fetched:
    """One graph's artifact as the backend fetches it (the one place that follows the
    backend's fetch path when it changes): one Get for the very entry the package names, by
    its key and digest; nothing of the graph is serialized or hashed (payload_s 0); the
    payload goes only if the farm lost the entry."""
    ask = pb.Ask(
        key=ref.key
        or public_key(request.graph, request.target, request.options, request.descriptor),
        private=request.private,
        sizes=ref.sizes,
        label=request.label,
        digest=ref.digest,
    )
    symints = dynamo_package.sized_symints(ref.sizes)
    question = fetch.Question(request, ask, symints, {"payload_s": 0.0, "key_s": 0.0})
    return fetch.fetch(question, settings)


def _call(settings: ClientSettings, method: str, request):
    try:
        return getattr(remote._stub(settings), method)(
            request, timeout=settings.inactivity_timeout_s, metadata=remote._metadata(settings, "")
        )
    except grpc.RpcError as e:
        raise FarmError(f"{e.code().name}: {e.details()}") from None
