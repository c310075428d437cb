"""How a gateway says "busy, ask again": a stream refused for want of a slot
(gateway/admission.py) ends RESOURCE_EXHAUSTED with RETRY_AFTER_MS in its trailing metadata,
the least wait in milliseconds before asking again, and SCOPE, whose capacity was spent.

TENANT: the tenant's own streams hold its share (a fleet's ranks starting together outnumber
it while their graph compiles, and each is served once the compile is done: a hit holds a
slot for milliseconds). The client waits, longer each time and with jitter, and asks again,
up to its compile timeout. GATEWAY: others hold the gateway's streams, which may last; the
client compiles locally at once, never waiting on them (issue 50). Other RESOURCE_EXHAUSTED
refusals (a payload too large, a full cache, a tenant's compile limit) carry no such
metadata and stay errors."""

RETRY_AFTER_MS = "torchfarm-retry-after-ms"
STREAM_RETRY_AFTER_MS = 200  # what a refused stream slot says: a hit frees one in ms
SCOPE = "torchfarm-busy"
TENANT, GATEWAY = "tenant", "gateway"
MAX_WAIT_S = 5.0  # the longest single wait of a client asking again
