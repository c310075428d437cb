"""The progress line: one line for all graphs in flight, ended once the last is done."""

import io
import sys

from torchfarm.client import progress
from torchfarm.client.progress import ProgressLine
from torchfarm.proto import torchfarm_pb2 as pb


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_one_line_summarises_several_graphs_and_ends_with_the_last(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)
    graphs = [ProgressLine(f"graph {i}", enabled=True) for i in (1, 2, 3)]
    graphs[0](pb.Progress(stage=pb.Progress.COMPILING))
    graphs[1](pb.Progress(stage=pb.Progress.COMPILING))
    assert "3 graphs: 2 compiling, 1 waiting" in terminal.getvalue().split("\r")[-1]
    graphs[0].close()
    graphs[1].close()
    graphs[2](pb.Progress(stage=pb.Progress.DOWNLOADING))
    assert "graph 3: downloading" in terminal.getvalue().split("\r")[-1]
    assert not terminal.getvalue().endswith("\n")
    graphs[2].close()
    assert terminal.getvalue().endswith("\n") and terminal.getvalue().count("\n") == 1
