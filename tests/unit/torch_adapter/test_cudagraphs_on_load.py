"""The cudagraphs flag reaches the load's post-compile call, and nothing else changes."""

import importlib

from torch._functorch._aot_autograd.aot_autograd_result import GenericAOTAutogradResult
from torch._inductor.utils import BoxedBool

from torchfarm.torch_adapter.load.cudagraphs_on_load import cudagraphs_on_load

LOADER = importlib.import_module("torch._inductor.standalone_compile")


def test_the_post_compile_call_gets_cudagraphs_on_and_boxed_bools_stay_as_built(monkeypatch):
    seen = []
    monkeypatch.setattr(
        GenericAOTAutogradResult,
        "wrap_post_compile",
        lambda self, args, aot_config, fx_config: seen.append(fx_config),
    )
    fx_config = {"cudagraphs": BoxedBool(False), "boxed_forward_device_index": None}
    with cudagraphs_on_load(True):
        assert LOADER.BoxedBool is BoxedBool and BoxedBool(False).value is False
        GenericAOTAutogradResult.wrap_post_compile(object(), [], None, fx_config)
    GenericAOTAutogradResult.wrap_post_compile(object(), [], None, fx_config)
    assert [c["cudagraphs"].value for c in seen] == [True, False]
    assert seen[0]["boxed_forward_device_index"] is None
    assert fx_config["cudagraphs"].value is False  # the caller's dict is not changed


def test_off_changes_nothing():
    original = GenericAOTAutogradResult.wrap_post_compile
    with cudagraphs_on_load(False):
        assert GenericAOTAutogradResult.wrap_post_compile is original
    assert GenericAOTAutogradResult.wrap_post_compile is original
