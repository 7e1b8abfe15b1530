"""Same input, same plan: solvers stop on work limits, and the clock is only a safety net.

A plan must be a function of the problem, the budget and the options, never of
the machine's load (issue 14, item 3): two ranks, or ``explain`` and
``torch.compile``, must agree. The clock here is faked to run very fast, as on
a heavily loaded machine: every solver must still return the same decision,
and only a time limit that is really exceeded may stop it, with
``SolveTimeout``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from fxremat.solvers import SolveOptions, SolveTimeout, ilp, mincut, policies, registry, rules, solve
from fxremat.solvers.ilp import solve_ilp

from test_solvers import same, transformer  # noqa: E402  (tests/ is on sys.path under pytest)

# Every module of fxremat.solvers that reads the clock.
CLOCK_READERS = (rules, mincut, ilp, registry, policies)


class RacingClock:
    """A ``time`` module whose ``perf_counter`` advances ``step`` seconds per call.

    With a step of a second, a search that stopped after 10 s of wall time
    would stop after 10 clock reads: the machine looks loaded beyond measure.
    """

    def __init__(self, step: float) -> None:
        self.now, self.step, self.calls = 0.0, step, 0

    def perf_counter(self) -> float:
        self.calls += 1
        self.now += self.step
        return self.now


@pytest.fixture(scope="module")
def small_stack():
    """A 2-layer transformer (46 forward values) and budgets where every search runs.

    At 0.1 of the range between the least and the fastest peak the ILP needs
    several MILP rounds and beats min-cut by about 40%; at 1 byte nothing fits
    and min-cut's least-peak search runs.
    """
    p = transformer(layers=2, pointwise=2)
    hi = solve(p, None, "save_all").peak_bytes
    lo = solve(p, 1, "mincut").peak_bytes
    return p, {"tight": lo + (hi - lo) // 10, "nothing fits": 1}


@pytest.mark.parametrize("name", ["auto", "ilp", "mincut"])
@pytest.mark.parametrize("which", ["tight", "nothing fits"])
def test_a_loaded_machine_gets_the_same_plan_or_an_error(small_stack, monkeypatch, name, which):
    """However slow the machine looks, the answer is the idle machine's plan or ``SolveTimeout``.

    Before work limits, a search stopped by the clock returned whatever it had
    found by then: on this problem every solver returned another plan at 10 s
    a read, and ``auto`` at the tight budget already at 1 ms a read.
    """
    p, budgets = small_stack
    budget = budgets[which]
    options = SolveOptions(time_limit=30.0)
    idle = solve(p, budget, name, options)
    outcomes = {}
    for step in (1e-3, 0.1, 10.0):
        clock = RacingClock(step)
        with monkeypatch.context() as patch:
            for module in CLOCK_READERS:
                patch.setattr(module, "time", clock)
            try:
                loaded = solve(p, budget, name, options)
            except SolveTimeout:
                outcomes[step] = "timeout"
                continue
        assert clock.calls > 0, "the solver never read the clock: the test checks nothing"
        assert same(idle, loaded), (step, idle.note, loaded.note)
        outcomes[step] = "same plan"
    # 30 s of racing clock: thousands of reads at 1 ms a read, three at 10 s a read.
    assert outcomes[1e-3] == "same plan" and outcomes[10.0] == "timeout", outcomes


def test_no_time_limit_gives_the_same_plan(small_stack):
    p, budgets = small_stack
    for name in ("auto", "ilp", "mincut"):
        assert same(
            solve(p, budgets["tight"], name), solve(p, budgets["tight"], name, SolveOptions(time_limit=math.inf))
        )


@pytest.mark.parametrize("name", ["auto", "ilp", "mincut"])
def test_a_tiny_time_limit_raises_solve_timeout(small_stack, name):
    p, budgets = small_stack
    with pytest.raises(SolveTimeout, match=r"safety-net time limit of 1e-09 s.*time_limit") as info:
        solve(p, budgets["tight"], name, SolveOptions(time_limit=1e-9))
    assert info.value.solver == name and info.value.limit == 1e-9
    assert "never on time" in str(info.value)


@pytest.mark.parametrize("name", ["save_all", "per_layer", "sqrt_n", "save_inputs"])
def test_reference_policies_ignore_the_time_limit(small_stack, name):
    # One simulation each: nothing to stop, so nothing to raise.
    p, budgets = small_stack
    assert same(solve(p, budgets["tight"], name, SolveOptions(time_limit=1e-9)), solve(p, budgets["tight"], name))


def test_highs_stopped_by_the_time_limit_raises(small_stack, monkeypatch):
    p, budgets = small_stack
    stopped = SimpleNamespace(status=1, x=None, mip_node_count=3, mip_gap=None, message="Time limit reached.")
    monkeypatch.setattr(ilp._Program, "solve", lambda self, *args: stopped)
    with pytest.raises(SolveTimeout, match="HiGHS stopped in MILP round 1"):
        solve_ilp(p, budgets["tight"], SolveOptions())


@pytest.mark.parametrize(
    "options, note",
    [
        (SolveOptions(milp_rounds=1), "MILP round limit 1 hit"),
        (SolveOptions(milp_nodes=1), "MILP node limit 1 hit in round 1"),
    ],
)
def test_work_limits_are_noted_and_leave_the_gap_unknown(small_stack, options, note):
    p, budgets = small_stack
    budget = budgets["tight"]
    warm = solve(p, budget, "save_inputs")  # does not fit: the first MILP round's plan decides
    full = solve_ilp(p, budget, SolveOptions(), warm=warm)
    assert full.feasible and full.gap == 0.0 and full.note == ""
    limited = solve_ilp(p, budget, options, warm=warm)
    assert note in limited.note
    assert limited.gap is None
    assert same(limited, solve_ilp(p, budget, options, warm=warm))


@pytest.mark.parametrize(
    "field, value",
    [
        ("time_limit", 0),
        ("time_limit", -1.0),
        ("time_limit", float("nan")),
        ("time_limit", True),
        ("milp_nodes", 0),
        ("milp_rounds", 2.5),
    ],
)
def test_solve_options_are_checked(field, value):
    with pytest.raises(ValueError, match=f"SolveOptions.{field}="):
        SolveOptions(**{field: value})


def test_no_time_limit_is_allowed():
    assert SolveOptions(time_limit=math.inf).time_limit == math.inf


def test_solve_timeout_pickles():
    # Compile workers send errors back to the parent process.
    import pickle

    error = pickle.loads(pickle.dumps(SolveTimeout("ilp", 2.5, "before MILP round 3")))
    assert (error.solver, error.limit, error.doing) == ("ilp", 2.5, "before MILP round 3")
    assert "time limit of 2.5 s (before MILP round 3)" in str(error)
