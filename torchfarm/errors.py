"""torchfarm's exceptions: one root, so that `except TorchfarmError` catches whatever the package
raises on purpose. A class keeps the builtin base that callers catch it by (RuntimeError,
ValueError). One caught in another component than the one raising it, or by users, is defined
here, unless it carries a reason of its module's; the others live next to their code. Grouped
by who raises them; where each lives, and why:

TorchfarmError
  client: the Dynamo backend, in the user's process
  + FarmError (RuntimeError) ........ here: raised across client/, caught by the CLI and users
    + UntrustedEntry ................ here: raised by client/remote.py, a miss in client/graph.py
    + FarmBusy ...................... client/remote.py: its retry loop's signal, caught there
    + GatewayLost ................... client/remote.py: likewise (another gateway is asked)
  + PackageLeftOut .................. client/packages.py: the decorator compiles without the skip
  local farm: `torchfarm up`
  + FarmNotReady (RuntimeError) ..... here: caught by the CLI and by LocalFarm's users
  gateway
  + AccessRefused ................... gateway/auth.py: with its Refusal, server.py's status
  + TooLarge ........................ gateway/coordinator.py: caught by server.py alone
  + _NotQueued ...................... gateway/coordinator.py: private to it
  worker
  + CompileFailed (RuntimeError) .... workers/sandbox.py: caught by workers/run.py alone
  + _Stop ........................... workers/run.py: private to it
  cache/store
  + CacheFull ....................... here: raised by the store, caught by the worker
  + WrongBlobStore .................. here: raised by the store, caught by gateway and CLI
  + CacheOperationRefused ........... cache/admin.py: with its Problem (a status, a message)
  + BadBlobName (ValueError) ........ cache/keys.py: a bad entry, caught as ValueError there
  + CommandFailed ................... cache/cli.py: private to the cache CLI
  compiler/torch_adapter
  + NotSaveable (RuntimeError) ...... here: raised by the adapter, caught by compiler/
  + BuildRefused (ValueError) ....... here: raised by the adapter's checks, caught by workers/
  + MissingNativeObject (RuntimeError)  compiler/native.py: a fallback, never caught by name
  + Unsupported (ValueError) ........ compiler/descriptor.py: a graph keyed by its payload
  + Mismatch (ValueError) ........... compiler/descriptor.py: a payload refused, as a failure
  + _NotBuilt ....................... torch_adapter/compile/cpp_libraries.py: private to it
  contract/settings: none (a bad value is a ValueError, a bad call a gRPC status)

Outside the root: torch_adapter/compile/concurrent_backward.py's Stopped and _Restrided are
BaseExceptions, not errors: they end (Stopped) or restart (_Restrided) a helper's compile
through torch's own `except Exception` handlers.
"""


class TorchfarmError(Exception):
    """The root of every exception torchfarm defines."""


class FarmError(TorchfarmError, RuntimeError):
    """The farm could not provide an artifact; the message says why."""


class UntrustedEntry(FarmError):
    """An entry or artifact that no trusted key signed: never loaded, the graph compiles here."""


class FarmNotReady(TorchfarmError, RuntimeError):
    """The farm did not become ready: a process exited, a worker's canary failed, or time
    ran out; the message says which, with the worker's error where there is one."""


class CacheFull(TorchfarmError):
    """The cache's storage refused a write (Redis at its memory limit, the blob store full or
    refusing); nothing was kept."""


class WrongBlobStore(TorchfarmError):
    """This process's TORCHFARM_BLOB_URL names another store than the cache's workers use."""


class NotSaveable(TorchfarmError, RuntimeError):
    """Inductor compiled the graph, but AOTAutograd made no cache entry of it."""


class BuildRefused(TorchfarmError, ValueError):
    """A pool's build refuses what a tenant's compile child reported (a Triton kernel module
    that is not one Inductor writes, a GEMM problem out of bounds): it is not built."""
