"""The zoo runner's verdicts (tests/zoo/runner.py) on made-up rows: what fails a model's
entry point, what is only printed."""

from tests.zoo import runner


def _variant(graphs=2, recompiles=1, exception="", wrong=(), stopped="", steady_ms=5.0):
    return {
        "exception": exception,
        "stopped": stopped,
        "wrong": list(wrong),
        "graphs": graphs,
        "recompiles": recompiles,
        "recompile_reasons": ["0/0: grad_mode"],
        "steady_ms": steady_ms,
        "max_err": 1e-7,
        "sources": ["hit"],
        "not_farm": [],
        "identity_guard": {"calls": 0, "us_per_call": None},
        "package_log": [],
    }


def _result(**skip) -> dict:
    run = {
        "torch": "2.13.0",
        "eager_ms": 9.0,
        "variants": {
            "inductor": _variant(),
            "native": _variant(steady_ms=6.0),
            "skip": _variant(**skip),
        },
    }
    return {"first": run, "second": run}


def test_clean_rows_have_no_problems():
    result = _result()
    assert runner.problems(result, "native") == []
    assert runner.problems(result, "skip") == []
    rows = runner.rows({"m": result})
    assert [r["ratio"] for r in rows] == [1.2, 1.2, 1.0, 1.0]  # printed, never asserted


def test_the_alternating_ratio_is_cpu_time_and_only_where_inductor_traced_its_own():
    result = _result()
    timed = {"farm_ms": 9.0, "inductor_ms": 9.0, "farm_cpu_ms": 4.4, "inductor_cpu_ms": 4.0}
    result["first"]["variants"]["native"]["alternating"] = dict(timed, valid=True)
    result["first"]["variants"]["skip"]["alternating"] = dict(timed, valid=False)
    native, skip = runner.rows({"m": result})[::2]
    assert (native["abba_ratio"], skip["abba_ratio"]) == (1.1, None)
    assert "alternating steps, CPU): median 1.10" in runner.table([native, skip])


def test_the_bracketed_ratio_takes_inductor_before_and_after_the_farm():
    result = _result()
    variants = result["first"]["variants"]
    for name, cpu in (("inductor", 4.0), ("native", 5.0), ("skip", 4.5)):
        variants[name]["steady_cpu_ms"] = cpu
    assert runner.rows({"m": result})[0]["aba_ratio"] is None  # no second inductor run
    variants["inductor_again"] = dict(_variant(), steady_cpu_ms=6.0)
    native, skip = runner.rows({"m": result})[::2]
    assert (native["aba_ratio"], skip["aba_ratio"]) == (1.0, 0.9)


def test_more_graphs_or_recompiles_than_inductor_fail():
    assert any("3 graphs" in p for p in runner.problems(_result(graphs=3), "skip"))
    assert any("9 recompiles" in p for p in runner.problems(_result(recompiles=9), "skip"))
    assert runner.problems(_result(graphs=0, recompiles=0), "skip") == []  # a restore


def test_an_exception_a_wrong_step_or_a_cut_loop_fail():
    assert runner.problems(_result(exception="TypeError: x"), "skip")
    assert runner.problems(_result(wrong=["train step 3: error 1e-2"]), "skip")
    assert runner.problems(_result(stopped="3 graphs after train step 2"), "skip")
    assert runner.problems(_result(exception="TypeError: x"), "native") == []


def test_inductor_off_eager_is_printed_not_failed():
    result = _result()
    result["first"]["variants"]["inductor"] = _variant(wrong=["train step 9: error 2e-2"])
    assert runner.problems(result, "native") == []
    assert runner.rows({"m": result})[0]["inductor_off_eager"] == 1


def test_unavailable_and_crashed_models_are_rows_not_passes():
    gone = {"unavailable": "timm cannot import", "torch": "2.13.0"}
    rows = runner.rows({"m": {"first": gone, "second": gone}})
    assert rows == [{"model": "m", "torch": "2.13.0", "unavailable": "timm cannot import"}]
    assert "unavailable" in runner.table(rows)
    crashed = {"first": {"crashed": "exit status 1"}, "second": {"crashed": "exit status 1"}}
    assert runner.problems(crashed, "native")
