"""The lighter imports of a loaded graph's output code and entry (light_wrapper,
extern_kernels, decompositions): the same objects as Inductor's own, on this torch release,
so a release that changes one fails here (the load's stand-ins for Inductor's graph and debug
modules: tests/integration/torch_adapter/test_graph_import.py, test_debug_flags.py)."""

import inspect
import types

import torch
from torch._inductor.codegen.wrapper import PythonWrapperCodegen

from torchfarm.torch_adapter.compile import light_wrapper
from torchfarm.torch_adapter.load import decompositions, extern_kernels


def test_every_extern_kernel_of_the_table_is_inductors_own():
    from torch._inductor.select_algorithm import extern_kernels as inductors

    table = {
        name: value
        for name, value in vars(extern_kernels).items()
        if isinstance(value, types.BuiltinFunctionType)
    }
    assert {"mm", "addmm", "bmm", "baddbmm", "convolution"} <= set(table)
    for name, kernel in table.items():
        assert getattr(inductors, name) is kernel, name


def test_any_other_extern_kernel_is_select_algorithms():
    from torch._inductor.select_algorithm import extern_kernels as inductors

    assert "bias_addmm" not in vars(extern_kernels)  # Inductor's own Python helper
    assert extern_kernels.bias_addmm is inductors.bias_addmm


def test_the_lighter_align_is_the_one_memory_planning_imports():
    from torch._inductor.codegen import memory_planning
    from torch._inductor.utils import _align

    assert memory_planning._align is _align


def test_each_rewritten_line_is_one_that_inductors_wrapper_writes():
    header = {line.strip() for line in inspect.getsource(PythonWrapperCodegen).splitlines()}
    for line in light_wrapper._LIGHTER:
        assert line in header, line


def test_the_rewrite_replaces_whole_lines_one_for_one():
    source = "\n".join(
        [
            "from torch._inductor.select_algorithm import extern_kernels",
            "    from torch._inductor.select_algorithm import extern_kernels",  # not a header
            "from torch._inductor.codegen.memory_planning import _align as align",
            "extern_kernels.mm(a, b, out=c)",
            "",
        ]
    )
    lighter = light_wrapper.lighter_source(source).split("\n")
    assert lighter == [
        "import torchfarm.torch_adapter.load.extern_kernels as extern_kernels",
        "    from torch._inductor.select_algorithm import extern_kernels",
        "from torch._inductor.utils import _align as align",
        "extern_kernels.mm(a, b, out=c)",
        "",
    ]
    namespace: dict = {}
    exec(lighter[0] + "\n" + lighter[2], namespace)  # the lighter lines import what they name
    assert namespace["extern_kernels"].mm is torch.mm


def test_the_loads_decomposition_picker_gives_inductors_table():
    from torch._inductor.decomposition import select_decomp_table

    assert decompositions.select_decomp_table() == select_decomp_table()


def test_only_inductors_decomposition_picker_is_replaced_in_a_copy_of_the_kwargs():
    from torch._inductor.decomposition import select_decomp_table

    def picker() -> dict:
        return {}

    kwargs = {"get_decomp_fn": select_decomp_table, "is_backward": True}
    assert light_wrapper.lighter_fx_kwargs(kwargs, picker) == {
        "get_decomp_fn": picker,
        "is_backward": True,
    }
    assert kwargs["get_decomp_fn"] is select_decomp_table  # the compiled graph's own, kept
    own = {"get_decomp_fn": dict, "is_backward": False}  # a picker of the caller's own
    assert light_wrapper.lighter_fx_kwargs(own, picker) is own
    assert light_wrapper.lighter_fx_kwargs({}, picker) == {}  # torch 2.11 keeps none
