"""A worker's defaults that depend on its host: compiles at once from its cores and GPUs, and
each compile's memory and work dir from its memory (docs/reliability.md, "Memory
arithmetic")."""

from __future__ import annotations

import os
from pathlib import Path


def visible_gpus() -> tuple[str, ...]:
    """The GPUs this worker may use, as CUDA_VISIBLE_DEVICES names them; without it, CUDA's
    ordinals of the /dev/nvidiaN nodes (a container may see /dev/nvidia3 alone, as ordinal 0)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return tuple(g.strip() for g in listed.split(",") if g.strip())
    try:
        nodes = os.listdir("/dev")
    except OSError:
        return ()
    count = sum(1 for n in nodes if n.startswith("nvidia") and n[6:].isdigit())
    return tuple(str(i) for i in range(count))


def default_concurrency(device: str) -> int:
    """Compiles at once by default: on CPU a quarter of the cores (each compile runs
    Inductor's parallel compile and the C++ compiler on several), at least 2 and at most 8;
    on CUDA two per visible GPU (one autotunes while another lowers), or the CPU figure where
    it is more: a step's graphs arrive as several compiles at once (client/pool.py), each of
    them mostly host work."""
    cpu = max(2, min(8, (os.cpu_count() or 1) // 4))
    if device == "cuda":
        return max(2 * len(visible_gpus()), cpu)
    return cpu


def default_kernel_builds() -> int:
    """The pool's kernel builds at once by default: a quarter of the cores, at least one (each
    build runs one C++ compiler; they are background work, workers/kernel_builder.py)."""
    return max(1, (os.cpu_count() or 1) // 4)


def compile_kernel_builds() -> int:
    """The builders kept warm for the C++ builds compiles ask the pool for
    (workers/kernel_builder.py, CompileBuilds): as many as one compile builds at once
    (Inductor's compile threads: the cores), at least 2, at most 8 (each an idle process of
    ~340 MiB, torch and Inductor imported)."""
    return max(2, min(8, os.cpu_count() or 1))


COMPILE_SHM_MB = 256  # /dev/shm in a compile child's sandbox (a tmpfs: host memory)
WARM_CHILD_MB = 1024  # an idle warm child (torch and Inductor imported: ~340 MiB resident)


def host_memory_mb() -> int:
    """This machine's memory, or its cgroup's limit where lower (a container's)."""
    limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value.isdigit():
            limit = min(limit, int(value) >> 20)
    return limit


def compile_share_mb(concurrency: int, warm_children: int) -> int:
    """One running compile's share of the host's memory (MiB): what is left after an eighth
    (at least 1 GiB) for the worker, Redis and the system, and WARM_CHILD_MB for each warm
    child that waits while `concurrency` compiles run, split among those compiles. A compile's
    share holds its address space, its RAM-backed work dir and its /dev/shm (docs/reliability.md,
    "Memory arithmetic")."""
    host = host_memory_mb()
    free = host - max(1024, host // 8) - warm_children * WARM_CHILD_MB
    return max(0, free // concurrency)


def default_disk_mb(share_mb: int) -> int:
    """A compile's RAM-backed work dir by default: a quarter of its share, 256 MiB to 4 GiB."""
    return max(256, min(4096, share_mb // 4))


def memory_cap_mb(share_mb: int, disk_mb: int, processes: int = 1) -> int:
    """A compile's share less its work dir and /dev/shm, split among the compile's
    `processes` (the child, and its backward helper where on), at most 32 GiB."""
    return min(32 << 10, (share_mb - disk_mb - COMPILE_SHM_MB) // processes)


def compile_memory_mb(share_mb: int, disk_mb: int, processes: int = 1) -> int:
    """A compile child's default address-space cap (memory_cap_mb); a host too small for
    its concurrency gets a clear error."""
    cap = memory_cap_mb(share_mb, disk_mb, processes)
    if cap < MIN_COMPILE_MEMORY_MB:
        raise ValueError(
            f"this host's memory ({host_memory_mb()} MiB) leaves a compile {share_mb} MiB: "
            f"lower TORCHFARM_WORKER_CONCURRENCY or TORCHFARM_WARM_CHILDREN, or set "
            f"TORCHFARM_COMPILE_MEMORY_MB and TORCHFARM_COMPILE_DISK_MB yourself"
        )
    return cap


MIN_COMPILE_MEMORY_MB = 2048  # below this a CPU compile child cannot even start Inductor
