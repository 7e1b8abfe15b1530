"""Two of the fastest models of the gradient-equality zoo (benchmarks/zoo.py, `make zoo`).

Each runs exactly as in the zoo: a fresh subprocess, the model compiled whole with
``torch.compile(model, backend="fxremat")`` (Inductor inside, as users run it) with no budget and at
the least reachable peak, the loss and every parameter gradient compared with eager. The plain
``torch.compile`` row is left out to keep this file short: any gradient beyond tolerance fails here.
"""

from __future__ import annotations

import pytest

from checks import load_benchmark

bench_zoo = load_benchmark("zoo")

# A causal LM and a CNN (BatchNorm: buffers updated in place): about 50-60 s each with a cold kernel
# cache on two cores, 30-35 s warm.
FAST = ["opt", "resnet"]
ROWS = ("eager", "fxremat", "fxremat_min")


@pytest.mark.parametrize("name", FAST)
def test_zoo_model_gradients_match_eager(name):
    # The user's Inductor kernel cache (keyed by kernel source; it only saves C++ compile time);
    # the FX-graph and AOTAutograd caches are off, so the fxremat backend really plans each graph.
    rows = bench_zoo.run_subprocess(name, timeout=300, env=bench_zoo.zoo_env(None), rows=ROWS)
    status = bench_zoo.classify(rows)
    by = {r["row"]: r for r in rows}
    assert status["eager"]["status"] == "ref", status["eager"]["text"]
    for row in bench_zoo.FXREMAT_ROWS:
        assert status[row]["status"] == "pass", f"{name}/{row}: {status[row]['text']}"
        assert by[row]["graphs"] >= 1
        assert by[row]["compared"] > 0


def test_compare_skips_zero_gradients_and_flags_differences():
    import math

    import torch

    ref = {"w": torch.ones(4), "zero": torch.zeros(3), "none": None, "b": torch.full((2,), 2.0)}
    same = {"w": torch.ones(4), "zero": torch.full((3,), 1e-3), "none": None, "b": torch.full((2,), 2.0)}
    r = bench_zoo.compare(1.0, ref, 1.0, same)
    assert r["bad"] == {} and r["compared"] == 2 and r["skipped"] == 2

    off = {"w": torch.ones(4) * 1.01, "zero": torch.zeros(3), "none": None, "b": None}
    r = bench_zoo.compare(1.0, ref, 1.1, off)
    assert set(r["bad"]) == {"w", "b", "loss"}
    assert math.isinf(r["bad"]["b"]) and r["bad"]["w"] == pytest.approx(0.01, rel=1e-4)


def test_classify_does_not_blame_fxremat_for_what_plain_compile_also_gets_wrong():
    rows = [
        {"model": "m", "row": "eager", "loss": 1.0, "params": 10},
        {"model": "m", "row": "inductor", "bad": {"a": 0.1}, "max_err": 0.1},
        {"model": "m", "row": "fxremat", "bad": {"a": 0.1}, "max_err": 0.1},
        {"model": "m", "row": "fxremat_min", "bad": {"a": 0.1, "b": 0.2}, "max_err": 0.2},
    ]
    status = bench_zoo.classify(rows)
    assert status["inductor"]["status"] == "FAIL"
    assert status["fxremat"]["status"] == "differs"
    assert status["fxremat_min"]["status"] == "FAIL" and "(b, 2.0e-01)" in status["fxremat_min"]["text"]
    # plain compile fails too: not an fxremat regression
    assert bench_zoo.regressions(rows) == []
    rows[1] = {"model": "m", "row": "inductor", "bad": {}, "max_err": 1e-7}
    assert len(bench_zoo.regressions(rows)) == 2
