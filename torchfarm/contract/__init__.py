"""The torch-free contract layer: what client, gateway and worker must agree on besides the
protobuf messages (mode names, canonical options, the cache key, pool names, what shape
guards mean). Nothing here imports torch, so the gateway and the CLI stay light."""
