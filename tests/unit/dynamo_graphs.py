"""The graphs Dynamo hands a backend, for the unit tests of what torchfarm does with them."""

import torch


def captured(fn, *args, dynamic: bool | None = False) -> list[torch.fx.GraphModule]:
    """Every graph Dynamo hands the backend while `fn(*args)` runs once, Dynamo reset first
    (`dynamic` as torch.compile takes it: None to honour `mark_dynamic`)."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
    return graphs
