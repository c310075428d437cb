"""A compile child yields the CPU to its backward helper (workers/yield_cpu.py): a process tree
in which one child is the helper (its own child too) and another a kernel compiler with a
thread of its own; after `yield_to`, every thread of the tree but the helper's subtree is at
the yield's nice level."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

_TREE = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from torchfarm.workers import yield_cpu

    # a kernel compiler: a process with a second thread, both sleeping
    compiler = subprocess.Popen([sys.executable, "-c",
        "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start();"
        " time.sleep(60)"], stdout=subprocess.DEVNULL)
    # the helper, and a process it started
    helper = subprocess.Popen([sys.executable, "-c",
        "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"],
        stdout=subprocess.DEVNULL)
    time.sleep(1.5)  # both started, their threads and children too
    done = yield_cpu.yield_to(helper.pid, nice=7)

    def nices(pid):
        return [os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")]

    def kids(pid):
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]

    print(json.dumps({
        "done": done,
        "self": nices(os.getpid()),
        "compiler": nices(compiler.pid),
        "helper": nices(helper.pid),
        "helpers_child": [n for k in kids(helper.pid) for n in nices(k)],
    }))
    for pid in kids(helper.pid) + [compiler.pid, helper.pid]:
        os.kill(pid, 9)
    """
)


def test_every_thread_of_the_tree_but_the_helpers_yields():
    out = subprocess.run(
        [sys.executable, "-c", _TREE], capture_output=True, text=True, timeout=60, check=True
    )
    seen = json.loads(out.stdout)
    assert seen["self"] == [7]
    assert seen["compiler"] == [7, 7]  # its second thread too
    assert seen["helper"] == [os.getpriority(os.PRIO_PROCESS, 0)]
    assert seen["helpers_child"] == [os.getpriority(os.PRIO_PROCESS, 0)]
    assert seen["done"] == 3
