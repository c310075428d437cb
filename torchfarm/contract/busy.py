"""How a gateway says "busy, ask again": a stream refused for want of a slot (the gateway's
or the tenant's, gateway/admission.py) ends RESOURCE_EXHAUSTED with RETRY_AFTER_MS in its
trailing metadata: the least wait, in milliseconds, before asking again. A client that sees
it waits, longer each time and with jitter, and asks again, up to its compile timeout,
instead of compiling locally: a fleet's ranks starting together outnumber any gateway's
stream slots while their graph compiles, and each is served once the compile is done (a hit
holds a slot for milliseconds). Other RESOURCE_EXHAUSTED refusals (a payload too large, a
full cache, a tenant's compile limit) carry no such metadata and stay errors."""

RETRY_AFTER_MS = "torchfarm-retry-after-ms"
STREAM_RETRY_AFTER_MS = 200  # what a refused stream slot says: a hit frees one in ms
MAX_WAIT_S = 5.0  # the longest single wait of a client asking again
