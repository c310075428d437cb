"""torch_adapter/load/aoti_load.py: inside, the device information torch's package loader
compares is this machine's, less the CPU ISA, and Inductor's probe is never asked."""

from unittest import mock

from torch._inductor import codecache, cpu_vec_isa

from torchfarm.torch_adapter.load.aoti_load import without_isa_probe


def test_the_loader_gets_the_devices_information_without_the_probe():
    real = codecache.get_device_information
    with mock.patch.object(cpu_vec_isa, "pick_vec_isa", side_effect=AssertionError("probed")):
        with without_isa_probe():
            # looked up as _load_aoti does, when it runs
            from torch._inductor.codecache import get_device_information

            answered = get_device_information("cpu")
    assert "AOTI_CPU_ISA" not in answered
    assert {"AOTI_PLATFORM", "AOTI_MACHINE", "AOTI_COMPUTE_CAPABILITY"} <= answered.keys()
    assert codecache.get_device_information is real
