"""Dry lowerings in forked children (``passes/forked.py``): same events, same plans, failures lowered here."""

import os
import time
import warnings

import pytest
import torch

import fxremat
from fxremat import planner
from fxremat.passes import forked, inductor_memory
from zoo import ZOO


@pytest.fixture
def forking(monkeypatch):
    """Forked lowering on (conftest turns it off for the rest of the suite), with two workers."""
    monkeypatch.setenv(forked.ENV_WORKERS, "2")
    if forked.workers() < 2:
        pytest.skip("forked lowering needs os.fork, two CPUs and CUDA not initialized")


def test_a_child_returns_its_value_and_is_reaped():
    child = forked.fork_call(lambda: [("alloc", "buf0", 4), ("free", "buf0")], "a test")
    assert child.result() == (True, [("alloc", "buf0", 4), ("free", "buf0")])
    with pytest.raises(ChildProcessError):
        os.waitpid(child.pid, os.WNOHANG)  # reaped


def test_a_child_that_raises_says_why():
    ok, why = forked.fork_call(lambda: 1 // 0, "a test").result()
    assert not ok and why.startswith("ZeroDivisionError"), why


def test_a_child_that_dies_without_answering_is_a_failure():
    ok, why = forked.fork_call(lambda: os._exit(3), "a test").result()
    assert not ok and "could not be read" in why, why


def test_a_child_that_hangs_is_ended(monkeypatch):
    monkeypatch.setattr(forked, "MIN_WAIT_SECONDS", 0.5)
    child = forked.fork_call(lambda: time.sleep(120), "a test")
    started = time.perf_counter()
    ok, why = child.result()
    assert not ok and "no answer" in why, why
    assert time.perf_counter() - started < 30
    with pytest.raises(ChildProcessError):
        os.waitpid(child.pid, os.WNOHANG)


def test_workers_setting(monkeypatch):
    monkeypatch.setenv(forked.ENV_WORKERS, "1")
    assert forked.workers() == 1
    for bad, match in (("two", "is not an int"), ("0", "at least 1")):
        monkeypatch.setenv(forked.ENV_WORKERS, bad)
        with pytest.raises(ValueError, match=match):
            forked.workers()
    monkeypatch.setenv(forked.ENV_WORKERS, "8")
    assert forked.workers() <= len(os.sched_getaffinity(0))
    # Not where a forked child cannot use what this process holds: CUDA, or macOS's frameworks.
    monkeypatch.setattr(forked.sys, "platform", "darwin")
    assert forked.workers() == 1
    monkeypatch.setattr(forked.sys, "platform", "linux")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert forked.workers() == 1


def _explain(**options) -> fxremat.Plan:
    torch._dynamo.reset()
    model, inputs = ZOO["transformer"]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = fxremat.explain(model, *inputs, **options)
    # Every candidate judged on Inductor's programs: none fell back to the simulation.
    assert not [w for w in caught if "could not report its program" in str(w.message)]
    return plan


def _same(a: fxremat.Plan, b: fxremat.Plan) -> None:
    assert [r.name for r in a.kept] == [r.name for r in b.kept]
    assert (a.predicted_peak, a.released_peak, a.fastest_peak, a.accumulating_peak) == (
        b.predicted_peak,
        b.released_peak,
        b.fastest_peak,
        b.accumulating_peak,
    )


def _forks_counted(monkeypatch) -> list[str]:
    started: list[str] = []
    real = inductor_memory.fork_call
    monkeypatch.setattr(inductor_memory, "fork_call", lambda call, what: started.append(what) or real(call, what))
    return started


@pytest.fixture(scope="module")
def lowered_here() -> fxremat.Plan:
    """The zoo transformer's no-budget plan (several candidates judged), every program lowered here."""
    assert forked.workers() == 1  # conftest: FXREMAT_LOWERING_WORKERS=1
    inductor_memory.forget_programs()
    return _explain()


def test_forked_lowerings_give_the_plan_of_lowerings_here(monkeypatch, forking, lowered_here):
    started = _forks_counted(monkeypatch)
    there = _explain()
    # Programs went to children (each plan's backward while this process lowered its forward; with no
    # budget the quickest plan's programs while this process searched for the other candidates).
    assert started, started
    _same(there, lowered_here)


def test_a_failed_child_is_lowered_here(monkeypatch, forking, caplog, lowered_here):
    """A child whose lowering fails changes nothing: the program is lowered in this process."""
    parent = os.getpid()
    real = inductor_memory.inductor_program_events

    def fails_in_children(gm, **kw):
        if os.getpid() != parent:
            raise RuntimeError("a child's lowering exploded")
        return real(gm, **kw)

    monkeypatch.setattr(inductor_memory, "inductor_program_events", fails_in_children)
    started = _forks_counted(monkeypatch)
    with caplog.at_level("INFO", logger="fxremat.passes.inductor_memory"):
        plan = _explain()
    assert started
    assert "a child's lowering exploded" in caplog.text and "lowering it here" in caplog.text
    _same(plan, lowered_here)


def _pointwise(shape):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(lambda a: (a.sin() * 2).cos(), tracing_mode="fake")(torch.randn(*shape))


def test_this_process_lowers_the_first_share_and_a_child_the_rest(monkeypatch, forking):
    """The programs handed out are cut into shares of about equal size: this process lowers the first,
    a child the others, in one call. Every event equals an in-process lowering's."""
    programs = [(_pointwise((2, 3, n)), False, None, None) for n in (8, 9, 10)]
    here = [inductor_memory.inductor_program_events(gm, is_backward=False) for gm, *_ in programs]
    inductor_memory.forget_programs()
    started = _forks_counted(monkeypatch)
    handed = inductor_memory.start_lowering(programs)
    assert len(handed) == 2 and started == ["2 programs (10 nodes)"], (handed, started)
    assert inductor_memory.start_lowering(programs) == []  # the one worker beside this process is busy
    events = [inductor_memory.program_events(gm, is_backward=False) for gm, *_ in programs]
    assert events == here
    assert len(started) == 1
    inductor_memory.stop_lowering(handed)  # nothing left to end
    assert inductor_memory.start_lowering(programs) == []  # all kept now


def test_a_child_that_has_answered_frees_its_worker(monkeypatch, forking):
    """A child whose answer is ready holds no core: its events are kept when more programs are handed out,
    and a new child lowers them (before, it counted as busy until its events were asked for, and every
    program was lowered in this process meanwhile)."""
    first = [(_pointwise((2, 3, n)), False, None, None) for n in (8,)]
    more = [(_pointwise((2, 3, n)), False, None, None) for n in (9, 10)]
    here = [inductor_memory.inductor_program_events(gm, is_backward=False) for gm, *_ in first + more]
    inductor_memory.forget_programs()
    started = _forks_counted(monkeypatch)
    handed = inductor_memory.start_lowering(first, here=False)
    assert len(handed) == 1
    deadline = time.perf_counter() + 60
    while not inductor_memory.lowerings_answered(handed) and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert inductor_memory.lowerings_answered(handed)
    assert len(inductor_memory.start_lowering(more, here=False)) == 2  # the worker is free again
    assert len(started) == 2
    assert not set(handed) & set(inductor_memory._PENDING)  # the first child's events were kept
    events = [inductor_memory.program_events(gm, is_backward=False) for gm, *_ in first + more]
    assert events == here


def test_a_process_with_other_work_hands_every_share_to_a_child(monkeypatch, forking):
    """``here=False`` (this process searches meanwhile): the one worker beside it takes all the programs."""
    programs = [(_pointwise((2, 3, n)), False, None, None) for n in (8, 9)]
    here = [inductor_memory.inductor_program_events(gm, is_backward=False) for gm, *_ in programs]
    inductor_memory.forget_programs()
    started = _forks_counted(monkeypatch)
    handed = inductor_memory.start_lowering(programs[:1], here=False)  # one program is worth a child too
    assert len(handed) == 1 and started == ["1 program (5 nodes)"], (handed, started)
    inductor_memory.stop_lowering(handed)
    handed = inductor_memory.start_lowering(programs, here=False)
    assert len(handed) == 2 and started[1:] == ["2 programs (10 nodes)"], (handed, started)
    events = [inductor_memory.program_events(gm, is_backward=False) for gm, *_ in programs]
    assert events == here and len(started) == 2


def _cnn_programs():
    """The zoo CNN's planned forward and backward (no budget), and the backward's donated inputs."""
    torch._dynamo.reset()
    model, inputs = ZOO["cnn"]()
    with planner.watch() as planned, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fxremat.explain(model, *inputs)
    analysis, choice, _ = planned[0]
    fw, bw = choice.lowered.forward, choice.lowered.backward
    return fw, bw, inductor_memory.donated_inputs(fw, bw, analysis.num_fwd_outputs)


def _lowered_here(monkeypatch) -> list:
    """The programs this process lowers from now on (a child forked later keeps its own list)."""
    here: list = []
    real = inductor_memory.inductor_program_events
    monkeypatch.setattr(inductor_memory, "inductor_program_events", lambda gm, **kw: here.append(gm) or real(gm, **kw))
    return here


@pytest.mark.parametrize("forward", ["in the child", "here"])
def test_a_backward_is_lowered_in_a_child_at_the_strides_its_forward_returns(monkeypatch, forking, forward):
    """The zoo CNN's forward returns its activations channels-last, and AOTAutograd compiles the backward
    for those strides: a child that knows the forward's events (lowered before it in its share, or here
    before the fork) lowers the backward at them, and this process takes it without lowering it again."""
    fw, bw, donated = _cnn_programs()
    inductor_memory.forget_programs()
    fw_events = inductor_memory.inductor_program_events(fw, is_backward=False)
    strides = inductor_memory.arrival_strides(fw_events, fw, bw)
    assert strides, "the CNN's forward returns channels-last activations"
    wanted = inductor_memory.inductor_program_events(bw, is_backward=True, donated=donated, strides=strides)
    programs = [(bw, True, donated, fw)]
    if forward == "here":
        inductor_memory.program_events(fw, is_backward=False)
    else:
        programs.insert(0, (fw, False, None, None))
    started = _forks_counted(monkeypatch)
    handed = inductor_memory.start_lowering(programs, here=False)
    assert len(handed) == len(programs) and len(started) == 1, (handed, started)
    here = _lowered_here(monkeypatch)
    assert inductor_memory.program_events(fw, is_backward=False) == fw_events
    assert inductor_memory.program_events(bw, is_backward=True, donated=donated, strides=strides) == wanted
    assert here == []


def test_a_backward_whose_forward_the_child_does_not_know_is_lowered_here_at_its_strides(monkeypatch, forking):
    """Handed out beside its forward (this process lowering that forward meanwhile), the child lowers the
    backward at the strides of the graph; this process, asking at the strides its forward returned, lowers
    it again rather than take events for other strides."""
    fw, bw, donated = _cnn_programs()
    inductor_memory.forget_programs()
    handed = inductor_memory.start_lowering([(fw, False, None, None), (bw, True, donated, fw)], here=True)
    assert len(handed) == 1
    here = _lowered_here(monkeypatch)
    fw_events = inductor_memory.program_events(fw, is_backward=False)
    strides = inductor_memory.arrival_strides(fw_events, fw, bw)
    inductor_memory.program_events(bw, is_backward=True, donated=donated, strides=strides)
    assert here == [fw, bw]
    assert not inductor_memory._PENDING  # the child's share was collected, not left running


def test_with_no_budget_the_likely_plans_backward_with_grads_is_lowered_beside_it(monkeypatch, forking, lowered_here):
    """The step with ``.grad`` allocated is judged on the chosen plan's backward that adds each gradient
    in: lowered in a child while this process judges the candidates, for the candidate most likely chosen
    (the one judged first); never lowered here when that candidate is chosen. The plan is the same."""
    handed: list = []
    real = planner._handed_backward
    monkeypatch.setattr(planner, "_handed_backward", lambda *a: handed.append(real(*a)) or handed[-1])
    here = _lowered_here(monkeypatch)
    there = _explain()
    _same(there, lowered_here)
    assert handed and handed[-1] is not None
    asked = handed[-1].graph.python_code("self").src  # the chosen plan's, asked by the report
    assert asked == handed[0].graph.python_code("self").src, "the likely candidate was chosen"
    assert all(gm.graph.python_code("self").src != asked for gm in here)


def test_shares_are_contiguous_and_balanced():
    assert inductor_memory._shares([367, 800, 367, 800], 2) == [[0, 1], [2, 3]]
    assert inductor_memory._shares([10, 1, 1, 1], 3) == [[0], [1], [2, 3]]
    assert inductor_memory._shares([1] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_under_a_budget_the_fastest_plan_for_the_report_is_lowered_beside_the_step_with_grads(
    monkeypatch, forking, lowered_here
):
    """The report's fastest-plan peak and the peak with ``.grad`` allocated both need dry lowerings once the
    plan is chosen: the fastest plan's programs go to a child while this process lowers the other. Same
    plan and peaks as lowering both here."""
    from fxremat import planner

    budget = int(lowered_here.predicted_peak * 0.8)
    inductor_memory.forget_programs()
    monkeypatch.setenv(forked.ENV_WORKERS, "1")
    here = _explain(budget=budget)
    monkeypatch.setenv(forked.ENV_WORKERS, "2")
    inductor_memory.forget_programs()
    pending: list[int] = []  # programs being lowered in children while the step with .grad is judged
    real = planner.accumulating_peaks

    def counted(*args, **kwargs):
        pending.append(len(inductor_memory._PENDING))
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "accumulating_peaks", counted)
    there = _explain(budget=budget)
    assert pending == [2], pending  # the fastest plan's forward and backward
    _same(there, here)
    assert here.fastest_peak > budget >= here.predicted_peak


def _reference_forks_counted(monkeypatch, call=None) -> list[str]:
    from fxremat.passes import reference

    started: list[str] = []
    real = reference.fork_call
    monkeypatch.setattr(
        reference, "fork_call", lambda c, what: started.append(what) or real(call if call is not None else c, what)
    )
    return started


def test_with_no_budget_pytorchs_partition_runs_in_a_child_with_the_same_plan(monkeypatch, forking):
    """With no budget PyTorch's own partition (always a candidate) runs in a forked child while this process
    searches; the plan is the one it makes with no child."""
    started = _reference_forks_counted(monkeypatch)
    there = _explain(inner="eager")
    assert started == ["PyTorch's partition"], started
    monkeypatch.setenv(forked.ENV_WORKERS, "1")
    here = _explain(inner="eager")
    assert started == ["PyTorch's partition"], started  # no child with one worker
    _same(there, here)
    assert there.solver == here.solver


def test_a_failed_partition_child_is_run_here(monkeypatch, forking, caplog):
    """A child that fails changes nothing: PyTorch's partition runs in this process instead."""
    monkeypatch.setenv(forked.ENV_WORKERS, "1")
    here = _explain(inner="eager")
    monkeypatch.setenv(forked.ENV_WORKERS, "2")
    started = _reference_forks_counted(monkeypatch, call=lambda: 1 // 0)
    with caplog.at_level("INFO", logger="fxremat"):
        there = _explain(inner="eager")
    assert started == ["PyTorch's partition"], started
    assert "PyTorch's partition in a forked child failed (ZeroDivisionError" in caplog.text, caplog.text
    _same(there, here)


def test_a_reference_dropped_unasked_ends_its_child(forking):
    import gc

    from fxremat.passes.reference import Reference

    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    ref = Reference(gm, [], 1, [])
    ref.start()
    assert ref._child is not None
    pid = ref._child.pid
    del ref
    gc.collect()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # ended and reaped


def test_a_fork_that_fails_leaves_pytorchs_partition_to_this_process(monkeypatch, forking, caplog):
    from fxremat.passes import reference

    monkeypatch.setenv(forked.ENV_WORKERS, "1")
    here = _explain(inner="eager")
    monkeypatch.setenv(forked.ENV_WORKERS, "2")

    def no_fork(call, what):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(reference, "fork_call", no_fork)
    with caplog.at_level("INFO", logger="fxremat"):
        there = _explain(inner="eager")
    assert "could not fork a child for PyTorch's partition" in caplog.text, caplog.text
    _same(there, here)


def test_a_fork_that_fails_leaves_the_lowering_to_this_process(monkeypatch, forking, caplog, lowered_here):
    def no_fork(call, what):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(inductor_memory, "fork_call", no_fork)
    inductor_memory.forget_programs()
    with caplog.at_level("INFO", logger="fxremat.passes.inductor_memory"):
        plan = _explain()
    assert "could not fork a child to lower" in caplog.text, caplog.text
    _same(plan, lowered_here)
