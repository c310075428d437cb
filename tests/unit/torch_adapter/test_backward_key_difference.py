"""Where a compile child's lookup of its backward helper's entry missed, the worker's log says
why in a line (torch_adapter/compile/concurrent_backward.py): which details of the two FX
graph cache keys differ, and how the first one does; or that there was no key to compare."""

from torchfarm.torch_adapter.compile.concurrent_backward import Key, difference

GM = "[{}] gm: GraphModule()\n\n\n\ndef forward(self, primals_1, {}):\n    return (primals_1,)"
LINES = [
    GM.format("g1", "permute"),
    "[c1] fx_kwargs[cudagraphs]: BoxedBool(value=False)",
    "[s1] example_inputs[3]: TensorMetadata(dtype=torch.bfloat16, shape=torch.Size([8, 64, 32, "
    "32]), stride=(65536, 1, 2048, 64), device=cuda:0)",
    "[d1] default_dtype: torch.float32",
]


def test_the_details_that_differ_are_named_the_first_shown_where_it_differs():
    child = list(LINES)
    child[1] = "[c2] fx_kwargs[cudagraphs]: BoxedBool(value=True)"
    child[2] = (
        child[2].replace("[s1]", "[s2]").replace("(65536, 1, 2048, 64)", "(65536, 1024, 32, 1)")
    )
    said = difference(Key("k1", LINES), Key("k2", child))
    assert said == (
        "2 of the key's details differ: fx_kwargs[cudagraphs], example_inputs[3]; "
        "fx_kwargs[cudagraphs]: helper 'BoxedBool(value=False)', child 'BoxedBool(value=True)'"
    )


def test_of_a_graph_the_first_line_that_differs_is_shown():
    child = [GM.format("g2", "permute_1"), *LINES[1:]]
    said = difference(Key("k1", LINES), Key("k2", child))
    assert said == (
        "1 of the key's details differ: gm; gm: helper 'def forward(self, primals_1, permute):',"
        " child 'def forward(self, primals_1, permute_1):'"
    )


def test_a_detail_one_side_lacks_and_many_differences_stay_one_short_line():
    helper = [f"[h{i}] inductor_config[option_{i}]: {'x' * 5000}" for i in range(40)]
    child = [f"[c{i}] inductor_config[option_{i}]: {'y' * 5000}" for i in range(40)]
    said = difference(Key("k1", helper), Key("k2", child + ["[n] default_dtype: torch.float32"]))
    assert said.startswith(
        "41 of the key's details differ: inductor_config[option_0], inductor_config[option_1]"
    )
    assert "and 35 more" in said
    assert len(said) < 450


def test_no_key_to_compare_or_equal_keys_say_so():
    key = Key("k1", LINES)
    assert difference(None, key).startswith("the helper left no key")
    assert difference(key, None) == "the child's backward bypassed the FX graph cache"
    assert difference(key, Key("k1", LINES)).startswith("the keys are equal")
