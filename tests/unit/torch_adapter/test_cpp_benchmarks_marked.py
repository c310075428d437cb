"""A C++ template candidate's library build is told apart from the output code's: marked in
the thread that builds it for benchmarking, only while it does, and torch's methods return."""

import threading
import types

from torch._inductor import codecache
from torch._inductor.autotune_process import CppBenchmarkRequest

from torchfarm.torch_adapter.compile import cpp_libraries


def test_a_candidates_build_is_marked_in_its_own_thread_only(monkeypatch):
    seen = []

    def load(cls, source_code, *args, **kwargs):
        seen.append((source_code, marked()))
        if source_code == "candidate":  # another thread builds meanwhile: not a candidate
            other = threading.Thread(target=lambda: seen.append(("meanwhile", marked())))
            other.start()
            other.join()

    monkeypatch.setattr(codecache.CppCodeCache, "load", classmethod(load))
    saved = dict(CppBenchmarkRequest.__dict__)
    with cpp_libraries.benchmarks_marked() as marked:
        codecache.CppCodeCache.load("output code")
        CppBenchmarkRequest.precompile(types.SimpleNamespace(source_code="candidate"))
        codecache.CppCodeCache.load("output code again")
    assert seen == [
        ("output code", False),
        ("candidate", True),
        ("meanwhile", False),
        ("output code again", False),
    ]
    for name in ("precompile", "make_run_fn"):
        assert CppBenchmarkRequest.__dict__[name] is saved[name]
