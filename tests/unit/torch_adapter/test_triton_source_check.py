"""The check a pool's Triton build makes before it runs a kernel module a child reported:
Inductor's kernels pass, and every way found to run other Python through a module or a jit
body is refused (docs/design/triton-pool-cache.md, section 5)."""

import pytest

pytest.importorskip("triton")

from tests.unit.torch_adapter.recorded_triton_kernels import KERNELS, NAME  # noqa: E402
from torchfarm.errors import BuildRefused  # noqa: E402
from torchfarm.torch_adapter.worker import triton_source_check  # noqa: E402

SOURCE = KERNELS[NAME]


def test_every_kernel_inductor_wrote_passes():
    assert len(KERNELS) == 10 and any("triton_tem_" in name for name in KERNELS)
    for name, source in KERNELS.items():
        triton_source_check.check(source, name)


def test_loops_over_tritons_ranges_pass():
    """Inductor's looped reductions iterate over `tl.range` (a class, not a builtin)."""
    for loop in ("range(0, 8, 2)", "tl.range(0, xnumel, XBLOCK)", "tl.static_range(4)"):
        body = f"    for r0_offset in {loop}:\n        r0_index = r0_offset + 1\n"
        triton_source_check.check(SOURCE.rstrip("\n") + "\n" + body, NAME)
    for loop in ("tl.range(0, 8, **{})", "tl.zeros(8)", "tl.range(0, getattr(tl, 'x'))"):
        with pytest.raises(BuildRefused):
            body = f"    for r0_offset in {loop}:\n        pass\n"
            triton_source_check.check(SOURCE.rstrip("\n") + "\n" + body, NAME)


@pytest.mark.parametrize(
    "line",
    [
        "getattr(triton.knobs.os, 'system')('echo ran > /tmp/torchfarm-pwned')",
        "triton_helpers.os.system('id')",
        "x = getattr(tl, 'core')",
        "x = tmp0.__class__",
        "x = 'a'.join(['b'])",
        "t = tl",
        "tl = 3",
        "f = (lambda: 0)",
        "x = f'{xnumel}'",
        "triton_helpers.set_driver_to_gpu()",
        "x = triton_helpers.torch.ones(1)",
        "x = tl.core.tensor",
        "print('x')",
        "hasattr(tl, 'x')",
        "x = [i for i in range(3)]",
        "with open('/etc/passwd') as f: pass",
        "import os",
        "x = xnumel if os else 0",
    ],
)
def test_a_body_that_reaches_past_triton_is_refused(line):
    with pytest.raises(BuildRefused):
        triton_source_check.check(SOURCE.rstrip("\n") + "\n    " + line + "\n", NAME)


@pytest.mark.parametrize(
    ("honest", "hostile"),
    [
        ("import triton\n", "import os\nimport triton\n"),
        ("filename=__file__,", "filename=__file__, x=__import__('os').system('id'),"),
        ("'kernel_name'", "'k': __import__('os'), 'kernel_name'"),
        ("XBLOCK : tl.constexpr", "XBLOCK : print('x')"),
        ("XBLOCK : tl.constexpr)", "XBLOCK : tl.constexpr = print(1))"),
        ("@triton.jit", "@triton.jit\n@print"),
        ("triton_helpers.set_driver_to_gpu()", "triton_helpers.set_driver_to_gpu()\nprint(1)"),
        ("\nimport triton\n", "# -*- coding: utf-7 -*-\nimport triton\n"),
        ("import triton\n", "import triton\n# \u00e9\n"),
    ],
)
def test_a_module_that_runs_anything_but_inductors_template_is_refused(honest, hostile):
    assert honest in SOURCE
    with pytest.raises(BuildRefused):
        triton_source_check.check(SOURCE.replace(honest, hostile, 1), NAME)


def test_a_module_without_the_kernel_named_is_refused():
    with pytest.raises(BuildRefused, match="no kernel"):
        triton_source_check.check("import triton\n", NAME)
    with pytest.raises(BuildRefused, match="decorators"):  # the kernel, taken for a helper
        triton_source_check.check(SOURCE, "triton_per_other_kernel")
    with pytest.raises(BuildRefused, match="not Python"):
        triton_source_check.check("def (", NAME)


def test_a_function_triton_would_parse_differently_from_the_checked_one_is_refused(
    tmp_path, monkeypatch
):
    """After the module ran: Triton compiles what `fn.parse()` gives, which must be the
    function that was checked (a coding cookie could otherwise make the two differ)."""
    from torch._inductor.codecache import PyCodeCache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    checked = "import triton\n\n@triton.jit\ndef helper(x):\n    return x + 1\n"
    module = PyCodeCache.load(checked)
    triton_source_check.same_as_validated(module, checked)
    with pytest.raises(BuildRefused, match="helper"):
        triton_source_check.same_as_validated(module, checked.replace("x + 1", "x + 2"))
