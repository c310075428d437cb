"""The compatibility gate: the torch releases this adapter was verified on, and nothing else.

Every module of this package uses private torch names, which change between releases without
notice (2.14.1 changed two that torchfarm relied on, silently). On a torch not listed here the
client compiles locally and the worker refuses to start, each with one line; an operator who
accepts the risk sets TORCHFARM_ALLOW_UNVERIFIED_TORCH=1 (warned loudly). Torch-free: the
`torchfarm worker` command checks before it imports torch.
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
import warnings

from torchfarm.settings import env

# Releases whose whole private surface (every module of this package) was run: 2.13.0 (the
# whole suite, CPU), 2.11.0, 2.12.1, 2.14.1 and 2.15.0 (unit tier + an end-to-end miss and
# hit, CPU, in `make test-versions`, pinned in requirements/; 2.11.0 also on the GPU
# machine). pyproject.toml's torch specifier admits the same releases.
VERIFIED = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")
ALLOW_UNVERIFIED_ENV = env.name("ALLOW_UNVERIFIED_TORCH")


def installed_version() -> str:
    """The torch this process runs (or would import), with its local tag (+cpu, +cu130)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(torch.__version__)
    return importlib.metadata.version("torch")


def release(version: str) -> str:
    """`2.13.0+cpu` -> `2.13.0`: the local tag names the build, not the Python sources."""
    return version.split("+", 1)[0]


def release_tuple(version: str | None = None) -> tuple[int, ...]:
    """(2, 13, 0) for the installed torch (non-numeric parts, as in 2.16.0a0, end the tuple)."""
    parts = []
    for part in release(version or installed_version()).split("."):
        digits = part[: len(part) - len(part.lstrip("0123456789"))]
        if not digits:
            break
        parts.append(int(digits))
        if digits != part:
            break
    return tuple(parts)


def unverified(version: str | None = None) -> str | None:
    """The reason not to use the farm with this torch, or None when it is verified (or an
    operator allowed it, which warns once)."""
    version = version or installed_version()
    if release(version) in VERIFIED:
        return None
    reason = f"torch {version} is not verified (verified: {', '.join(VERIFIED)})"
    if env.get("ALLOW_UNVERIFIED_TORCH"):
        _warn_allowed(reason)
        return None
    return reason


@functools.cache
def _warn_allowed(reason: str) -> None:
    warnings.warn(
        f"torchfarm: {reason}; running it anyway because {ALLOW_UNVERIFIED_ENV}=1: "
        "artifacts may be wrong or never hit",
        RuntimeWarning,
        stacklevel=3,
    )


def require_verified_for_worker() -> None:
    """Exit with one line unless this torch is verified: a worker on an unverified torch
    would store what it compiled for every client of its pool."""
    reason = unverified()
    if reason is not None:
        raise SystemExit(
            f"torchfarm: {reason}; this worker does not start "
            f"(set {ALLOW_UNVERIFIED_ENV}=1 to run it anyway)"
        )
