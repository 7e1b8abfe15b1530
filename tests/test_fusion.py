"""Inductor's fusion in the memory model: liveness rules by hand, the fusion pass against Inductor itself.

The liveness tests work out every expected number in their comments. The
Inductor tests compile zoo models and read the buffers Inductor's scheduler
really creates (its post-fusion hook): a value fxremat counts as fused must
never be one of them, and the prediction must bound the measured peak.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fxremat.solvers import schedule
from fxremat.solvers.types import BACKWARD, FORWARD, RematProblem

sys.path.insert(0, str(Path(__file__).resolve().parent))
import inductor_watch  # noqa: E402
from test_schedule import problem as schedule_problem  # noqa: E402

F, B = FORWARD, BACKWARD


def problem(nodes, **tags) -> RematProblem:
    """(name, phase, inputs, nbytes) rows; every node owns its storage (test_schedule's builder)."""
    return schedule_problem([(*row, None) for row in nodes], **tags)


def chain() -> RematProblem:
    # Forward: a (10 B) -> b = pointwise(a) (10 B, fused) -> c = reduce(b) (1 B, output).
    # Backward: t (1 B), g = grad(t, a) (10 B, returned).
    return problem(
        [("a", F, (), 10), ("b", F, (0,), 10), ("c", F, (1,), 1), ("t", B, (), 1), ("g", B, (3, 0), 10)],
        fw_outputs=(2,),
        tangents=(3,),
        bw_outputs=(4,),
        fused=(1,),
    )


def test_a_fused_value_allocates_nothing_and_keeps_its_input_alive():
    p = chain()
    # Keep a. Forward: a=10, b fused (10), c=11. Backward: t=12, g=22. Without
    # fusion b would add 10 while c runs (21 at c).
    timeline = schedule.liveness(p, *schedule.programs(p, (0,), ()), (0,))
    assert [live for _, _, live in timeline.steps] == [10, 10, 11, 12, 22]
    unfused = RematProblem(**{**p.__dict__, "fused": ()})
    assert [live for _, _, live in schedule.liveness(unfused, *schedule.programs(unfused, (0,), ()), (0,)).steps] == [
        10,
        20,
        21,
        12,
        22,
    ]


def test_a_kept_fused_value_is_materialized():
    # Backward reads b: keeping b makes the forward write it (10 B) for the backward.
    p = problem(
        [("a", F, (), 10), ("b", F, (0,), 10), ("c", F, (1,), 1), ("t", B, (), 1), ("g", B, (3, 1), 10)],
        fw_outputs=(2,),
        tangents=(3,),
        bw_outputs=(4,),
        fused=(1,),
    )
    # Keep b: forward a=10, b=20 (then a is freed) -> 10, c=11. Backward t=12, g=22.
    assert [live for _, _, live in schedule.liveness(p, *schedule.programs(p, (1,), ()), (1,)).steps] == [
        10,
        20,
        11,
        12,
        22,
    ]
    # Keep a, recompute b: b is computed inside g's kernel, so it costs nothing.
    # Forward: a=10, b=10, c=11. Backward: t=12, b=12, g=22.
    kept, recomputed = schedule.close(p, (0,))
    assert (kept, recomputed) == ((0,), (1,))
    assert [live for _, _, live in schedule.liveness(p, *schedule.programs(p, kept, recomputed), kept).steps] == [
        10,
        10,
        11,
        12,
        12,
        22,
    ]


def test_released_outputs_die_when_the_backward_starts():
    # a (10 B) -> o (20 B, output, unused by the backward). Backward: t (20 B), g = grad(t, a) (10 B).
    nodes = [("a", F, (), 10), ("o", F, (0,), 20), ("t", B, (), 20), ("g", B, (2, 0), 10)]
    held = problem(nodes, fw_outputs=(1,), tangents=(2,), bw_outputs=(3,))
    released = problem(nodes, fw_outputs=(1,), tangents=(2,), bw_outputs=(3,), outputs_released=True)
    programs = schedule.programs(held, (0,), ())
    # Held: forward 10, 30; backward t=50, g=60. Released: o goes at the backward's start: t=30, g=40.
    assert [live for _, _, live in schedule.liveness(held, *programs, (0,)).steps] == [10, 30, 50, 60]
    assert [live for _, _, live in schedule.liveness(released, *programs, (0,)).steps] == [10, 30, 30, 40]


# --------------------------------------------------------------------------
# Against Inductor
# --------------------------------------------------------------------------


# One compile per model and budget serves these checks and test_inplace's (inductor_watch.py: Llama with
# one layer); the transformer's and Llama's tests run on one worker each (``--dist loadgroup``).


@pytest.mark.parametrize("name", [inductor_watch.param("llama"), inductor_watch.param("transformer")])
def test_values_counted_as_fused_are_never_buffers_in_inductor(name):
    # The least-memory plan recomputes the most, so the backward holds the most fused chains.
    seen = inductor_watch.observe(name, 1)
    ours, realized = seen.fused, seen.allocated
    assert len(ours) == 2 and len(realized) == 2
    for program, fused, buffers in zip(("forward", "backward"), ours, realized):
        assert fused, f"{name} {program}: nothing counted as fused; the pass is not running"
        wrongly = sorted(fused & buffers)
        assert not wrongly, f"{name} {program}: counted as fused but Inductor allocates them: {wrongly}"


@pytest.mark.parametrize("name", [inductor_watch.param("mlp"), inductor_watch.param("transformer")])
def test_inductor_prediction_bounds_the_measured_peak(name):
    # The prediction is the replay of Inductor's own program (passes/inductor_memory.py): an
    # upper bound within the 5%. When written: exact to the byte on both models; with
    # the fusion-aware simulation and its 4% allowance it was +4.0% (mlp) and up to +11.7%.
    seen = inductor_watch.observe(name, 1)
    plan, measured = seen.plan, seen.measured
    assert measured <= plan.predicted_peak <= 1.05 * measured, (plan.predicted_peak, measured)
