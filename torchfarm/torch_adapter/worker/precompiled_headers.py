"""Inductor's precompiled C++ headers, built once per worker and bound read-only into children.

Inductor precompiles the header every CPU kernel includes (`torch/csrc/inductor/cpp_prefix.h`,
a ~150 MB `.gch` here) the first time a process compiles a kernel, and then passes it to every
g++ call as `-include <dir>/<key>.h`: kernel-heavy compiles take half the time. `<dir>` is
`codecache._HEADER_DIR`, fixed at import as `<tempfile.gettempdir()>/torchinductor_<user>/
precompiled_headers`, outside TORCHINDUCTOR_CACHE_DIR; `<key>` hashes the g++ command line
(ISA flags, include paths, defines), the preprocessed header and the compiler's version, never
the directory. Inductor writes `<key>.h` and `<key>.h.gch` there unless they exist, and takes a
lock in `<dir>/locks`. A compile child starting from an empty, size-capped /tmp therefore
built the 150 MB header itself on every compile, or failed with "cannot write PCH file: No
space left on device" under a small cap.

The worker builds them once, in a sandboxed child like a compile child (same paths, flags and
user, so the same key), into a directory of its own, and records what it built in a manifest;
children get each file bound read-only at the path Inductor looks at, and the flag on. Their
own `<dir>` stays in their tmpfs, so the lock (and any header of other flags) is theirs.

Uses `torch._inductor.codecache._HEADER_DIR` (checked by the build) and
`config.cpp_cache_precompile_headers`, set from the child's environment by the compile itself
(`enabled_here`): torch 2.11 has the flag on by default and reads no environment variable for
it. Verified: torch 2.11.0, 2.13.0, 2.15.0.
"""

from __future__ import annotations

import json
import os

from torchfarm.settings import env

FLAG_ENV = "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"  # Inductor's own name (2.13 on)
MANIFEST = "manifest.json"

# Run in the build child: compile one CPU kernel with headers on (Inductor precompiles the
# header on the way), check Inductor looked where the children will, list what it built.
BUILD_SCRIPT = """
import json, os, sys, torch
from torch._inductor import codecache
expected = sys.argv[1]
assert codecache._HEADER_DIR == expected, (codecache._HEADER_DIR, expected)
x = torch.randn(8, 8)
torch.testing.assert_close(torch.compile(lambda x: (x.sin() + 1).sum(1))(x), (x.sin() + 1).sum(1))
built = sorted(n for n in os.listdir(expected) if n.endswith((".h", ".h.gch")))
print(json.dumps(built))
"""


def header_dir(work_dir: str, user: str) -> str:
    """Where Inductor looks for precompiled headers in a child whose TMPDIR is `work_dir` and
    whose $USER is `user` (runtime.cache_dir_utils.default_cache_dir)."""
    return os.path.join(work_dir, f"torchinductor_{user}", "precompiled_headers")


def build_environment(child_env: dict[str, str]) -> dict[str, str]:
    """The build child's environment: a compile child's, with the headers on."""
    return {**child_env, FLAG_ENV: "1"}


def set_store(directory: str) -> None:
    """Worker main process, before its pool forks: the headers will be built into `directory`."""
    env.export(PRECOMPILED_HEADERS_DIR=directory)  # its manifest appears once they are in


def record(directory: str, built: list[str]) -> None:
    """Mark the headers in `directory` ready for children (atomically: they read it at once)."""
    names = [n for n in built if os.path.isfile(os.path.join(directory, n))]
    if not any(n.endswith(".gch") for n in names):
        raise RuntimeError(f"Inductor built no precompiled header (listed {built!r})")
    partial = os.path.join(directory, f".{MANIFEST}.partial")
    with open(partial, "w") as f:
        json.dump(names, f)
    os.replace(partial, os.path.join(directory, MANIFEST))


def _ready() -> tuple[str, list[str]]:
    directory = env.get("PRECOMPILED_HEADERS_DIR")
    if not directory:  # not a worker
        return "", []
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            return directory, json.load(f)
    except (OSError, ValueError):
        return directory, []


def child_binds(work_dir: str, user: str) -> list[tuple[str, str]]:
    """(worker file, path in the child) of each prebuilt header; none until they are in."""
    directory, names = _ready()
    target = header_dir(work_dir, user)
    return [(os.path.join(directory, n), os.path.join(target, n)) for n in names]


def child_environment() -> dict[str, str]:
    """Headers on where they are prebuilt; off before (a child would build its own 150 MB)."""
    return {FLAG_ENV: "1" if _ready()[1] else "0"}


def enabled_here() -> bool:
    """In a compile child: whether the worker turned the headers on for it."""
    return os.environ.get(FLAG_ENV) == "1"
