"""Files that several processes may write at once (ranks of one job share a cache dir)."""

from __future__ import annotations

import os


def write_atomically(path: str, data: bytes) -> None:
    """Write `data` to `path` so that a reader sees the whole file or none of it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
