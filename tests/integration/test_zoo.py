"""The third-party model zoo (issue 49; tests/zoo): every model, both entry points
(`torch.compile(model, backend="torchfarm")` and `torchfarm.compile(model)` with the skip on),
both fresh processes (the one that traces and saves Dynamo's package, the one that restores
it), a training loop and an inference loop beside `torch.compile(backend="inductor")`.

Asserted: no exception, every step equal to eager within tolerance, no more graphs or
recompiles than inductor's, every graph served by the farm. Step times are printed in the
table (tests/zoo/runner.py), never asserted. A model whose library cannot import on this
torch (timm, torchvision beside 2.13's CPU wheel) is skipped as unavailable; they run in
`make test-version-2.14` (ZOO_MODELS: the models a run is for; unset, models.TIER: the
whole zoo is `make zoo`).
"""

import json
import os

import pytest

from tests.integration.helpers import TOKENS
from tests.zoo import models, runner

_results: dict[str, dict] = {}  # a model's two processes serve both entry points' tests
REPORT = os.path.join(runner.ROOT, ".cache", "zoo")


def _params():
    wanted = os.environ.get("ZOO_MODELS")
    for name in wanted.split(",") if wanted else models.TIER:
        for entry in runner.ENTRIES:
            yield pytest.param(name, entry, id=f"{name}-{entry}")


@pytest.fixture(scope="module", autouse=True)
def report():
    """The table and the JSON of every row this run measured, in .cache/zoo/ and printed."""
    yield
    if not _results:
        return
    rows = runner.rows(_results)
    os.makedirs(REPORT, exist_ok=True)
    text = runner.table(rows)
    with open(os.path.join(REPORT, "table.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(REPORT, "rows.json"), "w") as f:
        json.dump({"rows": rows, "results": _results}, f, indent=1)
    print("\n" + text)


# A model's first test runs both its processes: minutes each on a loaded 2-core machine.
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("name,entry", list(_params()))
def test_zoo(farm, name, entry):
    if name not in _results:
        _results[name] = runner.run_model(farm, name, TOKENS["alice"])
    result = _results[name]
    if result["first"].get("unavailable"):
        pytest.skip(f"unavailable: {result['first']['unavailable']}")
    assert not runner.problems(result, entry), runner.problems(result, entry)
