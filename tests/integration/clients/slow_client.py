"""model_client.py with its compiles slowed on the farm: the payload sleeps SECONDS in the
worker's compile child before it unpickles the real graph, so a tiny graph compiles as long as
an exhaustive autotune of a large model. The sleep is part of the payload, so it is part of
the key too: each SECONDS is a graph of its own. So the client sends no descriptor (its graph
would have the plain model's, key v4, and find that one's entry): the key is the payload's.

Usage: slow_client.py SECONDS MODEL {infer,train}   (TORCHFARM_ADDR / TORCHFARM_TOKEN from the env)
"""

import operator
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model_client  # noqa: E402

from torchfarm.compiler import descriptor, serialize  # noqa: E402


class _Call:
    """Unpickles as fn(*args)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def slowed(dumps, seconds: float):
    def dumps_slowly(gm) -> bytes:
        sleep = _Call(exec, f"import time\ntime.sleep({seconds})")
        return pickle.dumps(_Call(operator.getitem, (sleep, _Call(serialize.loads, dumps(gm))), 1))

    return dumps_slowly


def keyed_by_payload(gm) -> bytes:
    raise descriptor.Unsupported("slow_client.py: its payload is not its graph's")


if __name__ == "__main__":
    serialize.dumps = slowed(serialize.dumps, float(sys.argv[1]))
    descriptor.describe = keyed_by_payload
    model_client.main(sys.argv[2], sys.argv[3])
