"""Closure, programs and liveness of fxremat.solvers.schedule on hand-built problems.

Every expected peak below is worked out by hand in the test's comment: live
bytes are recorded right after a node allocates, before anything is freed.
"""

from __future__ import annotations

import pytest

from fxremat.solvers import schedule
from fxremat.solvers.types import BACKWARD, FORWARD, RematProblem

F, B = FORWARD, BACKWARD


def problem(nodes, **tags) -> RematProblem:
    """Build a problem from (name, phase, inputs, nbytes, storage or None) rows."""
    return RematProblem(
        names=tuple(n[0] for n in nodes),
        phase=tuple(n[1] for n in nodes),
        inputs=tuple(tuple(n[2]) for n in nodes),
        nbytes=tuple(n[3] for n in nodes),
        storage=tuple(i if n[4] is None else n[4] for i, n in enumerate(nodes)),
        seconds=tuple(1.0 for _ in nodes),
        flops=tuple(1 for _ in nodes),
        **tags,
    )


def chain3() -> RematProblem:
    # a (100 B) -> b (1 B) -> c (4 B, the user output). The backward: a tangent
    # t (8 B), gc = grad(t, b) (16 B), gb = grad(gc) (32 B, returned).
    return problem(
        [
            ("a", F, (), 100, None),
            ("b", F, (0,), 1, None),
            ("c", F, (1,), 4, None),
            ("t", B, (), 8, None),
            ("gc", B, (3, 1), 16, None),
            ("gb", B, (4,), 32, None),
        ],
        fw_outputs=(2,),
        tangents=(3,),
        bw_outputs=(5,),
    )


def peak(p: RematProblem, kept) -> int:
    return schedule.evaluate(p, kept)[2]


# --------------------------------------------------------------------------
# close
# --------------------------------------------------------------------------


def test_close_recomputes_what_is_not_kept_back_to_kept_values():
    p = chain3()
    assert schedule.close(p, ()) == ((), (0, 1))
    assert schedule.close(p, (0,)) == ((0,), (1,))
    assert schedule.close(p, (1,)) == ((1,), ())
    # Kept values the backward does not need are dropped.
    assert schedule.close(p, (0, 1, 2)) == ((1,), ())


def test_close_keeps_never_recompute_and_must_save_values():
    p = problem(chain3_rows(), fw_outputs=(2,), tangents=(3,), bw_outputs=(5,), never_recompute=(0,))
    assert schedule.close(p, ()) == ((0,), (1,))
    p = problem(chain3_rows(), fw_outputs=(2,), tangents=(3,), bw_outputs=(5,), must_save=(1,))
    assert schedule.close(p, ()) == ((1,), ())


def chain3_rows():
    p = chain3()
    return [(p.names[i], p.phase[i], p.inputs[i], p.nbytes[i], p.storage[i]) for i in range(p.size)]


# --------------------------------------------------------------------------
# programs
# --------------------------------------------------------------------------


def test_programs_run_tangents_first_and_recompute_just_before_first_use():
    p = chain3()
    kept, recomputed = schedule.close(p, ())
    forward, backward = schedule.programs(p, kept, recomputed)
    assert forward == (0, 1, 2)
    assert backward == (3, 0, 1, 4, 5)
    kept, recomputed = schedule.close(p, (1,))
    assert schedule.programs(p, kept, recomputed) == ((0, 1, 2), (3, 4, 5))


def _programs_reference(p: RematProblem, kept, recomputed):
    """programs() as first written (a set copy per backward node), to check the fast walk against."""
    fw_nodes = {v for v in range(p.size) if p.phase[v] == F}
    bw_nodes = {v for v in range(p.size) if p.phase[v] == B}
    forward = sorted(schedule.ancestors(p, list(p.fw_outputs) + list(kept), fw_nodes))
    tangents = list(p.tangents)
    needed = schedule.ancestors(p, p.bw_outputs, bw_nodes | set(recomputed)) - set(tangents)
    readers = [v for v in sorted(needed) if any(u in set(tangents) for u in p.inputs[v])]
    done, backward = set(tangents), list(tangents)
    if not readers:
        return tuple(forward), tuple(backward) + tuple(sorted(needed))
    for v in sorted(needed):
        if v < readers[0] or v in done:
            continue
        for u in sorted(schedule.ancestors(p, [v], needed - done)):
            done.add(u)
            backward.append(u)
    return tuple(forward), tuple(backward)


def test_programs_match_the_reference_order_on_a_diamond():
    # x -> (l, r) -> j; the backward reads l and r; recompute l and r from x.
    p = problem(
        [
            ("x", F, (), 8, None),
            ("l", F, (0,), 8, None),
            ("r", F, (0,), 8, None),
            ("j", F, (1, 2), 8, None),
            ("t", B, (), 8, None),
            ("gl", B, (4, 2), 8, None),
            ("gr", B, (4, 1), 8, None),
            ("gx", B, (5, 6), 8, None),
        ],
        fw_outputs=(3,),
        tangents=(4,),
        bw_outputs=(7,),
    )
    for kept in [(), (0,), (1,), (2,), (1, 2)]:
        k, r = schedule.close(p, kept)
        assert schedule.programs(p, k, r) == _programs_reference(p, k, r)
    k, r = schedule.close(p, (0,))
    assert schedule.programs(p, k, r)[1] == (4, 2, 5, 1, 6, 7)


def test_a_gradient_that_needs_no_tangent_still_runs():
    # Forward a (4 B) -> o (1 B, output). Backward: t (tangent, 1 B), z (8 B,
    # reads nothing, returned: a gradient of zeros), g = grad(t, a) (4 B, returned).
    p = problem(
        [
            ("a", F, (), 4, None),
            ("o", F, (0,), 1, None),
            ("t", B, (), 1, None),
            ("z", B, (), 8, None),
            ("g", B, (2, 0), 4, None),
        ],
        fw_outputs=(1,),
        tangents=(2,),
        bw_outputs=(3, 4),
    )
    # z comes before the first tangent reader and nothing after it reads z: it
    # runs last, as PyTorch's ordering inserts it with the output node.
    assert schedule.programs(p, (0,), ()) == ((0, 1), (2, 4, 3))
    # Forward 4, 5. Backward: t=6, g=10 (t, a freed) -> 5, z=13.
    assert peak(p, (0,)) == 13


# --------------------------------------------------------------------------
# liveness
# --------------------------------------------------------------------------


def test_chain_of_three_peaks():
    p = chain3()
    # Keep b: forward a=100, b=101 (a freed: not kept) -> 1, c=5. Backward
    # from 5: t=13, gc=29 (t, b freed) -> 20, gb=52 (gc freed) -> 36. Peak 101.
    assert peak(p, (1,)) == 101
    # Keep nothing: the forward is the same (peak 101, ends at 4 with c only).
    # Backward: t=12, a=112, b=113 (a freed) -> 13, gc=29 -> 20, gb=52. Peak 113.
    assert peak(p, ()) == 113
    # Keep a: forward a=100 (kept), b=101, c=105 (b freed) -> 104. Backward:
    # t=112, b=113 (a freed) -> 13, gc=29, gb=52. Peak 113.
    assert peak(p, (0,)) == 113
    timeline = schedule.liveness(p, *schedule.programs(p, (1,), ()), (1,))
    assert [live for _, _, live in timeline.steps] == [100, 101, 5, 13, 29, 52]
    assert timeline.kept_bytes == 1
    assert timeline.peak_step == 1


def test_a_kept_view_holds_its_base_without_counting_twice():
    # a (10 B), v = view(a) (0 B, in a's storage), o = f(v) (4 B, output).
    # Backward: t (4 B), g = grad(t, v) (10 B, returned).
    p = problem(
        [
            ("a", F, (), 10, None),
            ("v", F, (0,), 0, 0),
            ("o", F, (1,), 4, None),
            ("t", B, (), 4, None),
            ("g", B, (3, 1), 10, None),
        ],
        fw_outputs=(2,),
        tangents=(3,),
        bw_outputs=(4,),
    )
    # Keep v: forward a=10, v=10, o=14. Backward t=18, g=28 (t and a's
    # storage freed) -> 14. A view counted as its own storage would give 38.
    kept, recomputed = schedule.close(p, (1,))
    assert (kept, recomputed) == ((1,), ())
    timeline = schedule.liveness(p, *schedule.programs(p, kept, recomputed), kept)
    assert timeline.peak == 28
    assert timeline.kept_bytes == 10
    assert [live for _, _, live in timeline.steps] == [10, 10, 14, 18, 28]


def test_outputs_stay_alive_through_the_backward():
    # a (10 B) -> o (20 B, output, unused by the backward). Backward: t (20 B),
    # g = grad(t, a) (10 B, returned). Keep a.
    p = problem(
        [
            ("a", F, (), 10, None),
            ("o", F, (0,), 20, None),
            ("t", B, (), 20, None),
            ("g", B, (2, 0), 10, None),
        ],
        fw_outputs=(1,),
        tangents=(2,),
        bw_outputs=(3,),
    )
    timeline = schedule.liveness(p, *schedule.programs(p, (0,), ()), (0,))
    # Forward 10, 30. Backward: t=50 (o still held), g=60 (then t and a freed).
    assert [live for _, _, live in timeline.steps] == [10, 30, 50, 60]
    assert timeline.peak == 60


@pytest.mark.parametrize("kept", [(), (0,), (1,)])
def test_decision_agrees_with_evaluate(kept):
    p = chain3()
    d = schedule.decision(p, kept, 105, "test")
    k, r, pk, sec = schedule.evaluate(p, kept)
    assert (d.kept, d.recomputed, d.peak_bytes, d.recompute_seconds) == (k, r, pk, sec)
    assert d.feasible == (pk <= 105)
