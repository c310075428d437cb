"""A compile child yields the CPU to its backward helper.

A helped training compile is two paths side by side (torch_adapter/compile/concurrent_backward.py):
the child's forward and the helper's backward, and the helper's is the longer one. On 2× H200
the child reached its backward's key and then waited 0.6-3.0 s for the helper's on every
transformer of the zoo, 14.8 s on convnext (bench/gpu/results/2026-11-30-h200x2-novel-zoo-
timings). Where both compile Triton kernels at once, their two pools (Inductor's compile
workers, one per process, each as large as the host has cores) share the cores evenly, and the
child's kernels, which it has time to wait for, delay the helper's. Once its forward is
lowered, the child therefore puts itself and everything it started, but the helper, at a
higher nice level: under contention the helper's work comes first; on idle cores nice changes
nothing. Nice is per thread on Linux and inherited by what a thread starts, so each thread of
each process of the child's tree is set, and later kernel compiler processes inherit it.
The child's one compile ends soon after, with its process: nothing is set back.
"""

from __future__ import annotations

import os

YIELD_NICE = 10  # CFS weight 110 against 1024 at nice 0: the helper gets ~90% of a contended core


def yield_to(spared: int, nice: int = YIELD_NICE) -> int:
    """This process's threads and those of its descendants at nice `nice` at least, but process
    `spared` and its descendants; returns how many threads were set (those gone meanwhile, or
    not this user's, are skipped)."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parents():
        children.setdefault(parent, []).append(pid)
    todo, done = [os.getpid()], 0
    while todo:
        pid = todo.pop()
        if pid == spared:
            continue
        todo.extend(children.get(pid, ()))
        try:
            threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in threads:
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
                    done += 1
            except OSError:
                pass
    return done


def _parents() -> list[tuple[int, int]]:
    """(pid, parent pid) of every process in /proc."""
    found: list[tuple[int, int]] = []
    try:
        names = os.listdir("/proc")
    except OSError:  # no /proc (a sandbox without it): nothing is set
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # after the command's closing parenthesis: state, then the parent's pid
        found.append((int(name), int(stat.rsplit(b")", 1)[1].split()[1])))
    return found
