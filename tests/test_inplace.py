"""Inductor's in-place reuse in the memory model: liveness by hand, candidates on traced graphs,
and the candidates the simulation takes against the reuses Inductor really makes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxremat.hardware import get_hardware
from fxremat.passes.cost import annotate
from fxremat.passes.fusion import fused_nodes
from fxremat.passes.inplace import inplace_pairs
from fxremat.solvers import schedule
from fxremat.solvers.types import BACKWARD, FORWARD, RematProblem

sys.path.insert(0, str(Path(__file__).resolve().parent))
import inductor_watch  # noqa: E402
from test_schedule import problem as schedule_problem  # noqa: E402

F, B = FORWARD, BACKWARD


def problem(nodes, **tags) -> RematProblem:
    return schedule_problem([(*row, None) for row in nodes], **tags)


def lives(p: RematProblem, kept) -> list[int]:
    kept, recomputed = schedule.close(p, kept)
    return [live for _, _, live in schedule.liveness(p, *schedule.programs(p, kept, recomputed), kept).steps]


# --------------------------------------------------------------------------
# Liveness
# --------------------------------------------------------------------------


def test_a_writer_takes_the_buffer_that_dies_under_it():
    # Forward: a (10 B) -> b = f(a) (10 B, may write into a) -> c = sum(b) (1 B, output).
    # Backward: t (1 B), g = grad(t) (10 B, returned); nothing saved.
    rows = [("a", F, (), 10), ("b", F, (0,), 10), ("c", F, (1,), 1), ("t", B, (), 1), ("g", B, (3,), 10)]
    tags = dict(fw_outputs=(2,), tangents=(3,), bw_outputs=(4,))
    # Without the pair: a=10, b=20 (a is freed after b), c=11; backward: c stays (1),
    # t=2, g=12.
    assert lives(problem(rows, **tags), ()) == [10, 20, 11, 2, 12]
    # With it, b lives in a's buffer: a=10, b=10, c=11; the backward as before.
    reuse = problem(rows, inplace=((1, 0),), **tags)
    assert lives(reuse, ()) == [10, 10, 11, 2, 12]
    kept, recomputed = schedule.close(reuse, ())
    assert schedule.liveness(reuse, *schedule.programs(reuse, kept, recomputed), kept).reused == ((1, 0),)


def test_a_kept_buffer_is_not_overwritten_in_the_forward_but_is_in_the_backward():
    # Forward: a (10 B) -> b = f(a) (10 B, may write into a) -> c (1 B, output).
    # Backward: t (1 B), h = f(t, a) (10 B, may write into a: a dies there), g (10 B, returned).
    rows = [
        ("a", F, (), 10),
        ("b", F, (0,), 10),
        ("c", F, (1,), 1),
        ("t", B, (), 1),
        ("h", B, (3, 0), 10),
        ("g", B, (4,), 10),
    ]
    p = problem(rows, fw_outputs=(2,), tangents=(3,), bw_outputs=(5,), inplace=((1, 0), (4, 0)))
    # Keep a: the forward cannot reuse it (a=10, b=20, c=21, then b goes). The
    # backward starts with a and c (11) and gets a donated: t=12, h=12 (in a's
    # buffer; t goes), g=21.
    assert lives(p, (0,)) == [10, 20, 21, 12, 12, 21]


def test_a_user_output_is_never_reused_even_when_it_dies():
    # a (10 B) is the user output and is kept; h may write into it in the backward.
    rows = [("a", F, (), 10), ("t", B, (), 1), ("h", B, (1, 0), 10)]
    p = problem(rows, fw_outputs=(0,), tangents=(1,), bw_outputs=(2,), inplace=((2, 0),), outputs_released=True)
    # a=10; backward t=11, h=21: AOTAutograd does not donate a saved user output.
    assert lives(p, (0,)) == [10, 11, 21]


# --------------------------------------------------------------------------
# Candidates on traced graphs
# --------------------------------------------------------------------------


def candidates(fn, *args) -> set[tuple[str, str]]:
    gm = make_fx(fn)(*args)
    costs = annotate(gm, get_hardware("cpu"))
    fused = fused_nodes(gm.graph, costs)
    return {(w.name, b.name) for w, b in inplace_pairs(gm.graph, costs, fused)}


def test_a_pointwise_kernel_may_write_into_the_matmul_it_reads():
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    # relu(mm) is realized (it is returned) and reads mm at its own index.
    assert candidates(lambda x, w: torch.relu(x @ w), x, w) == {("relu", "mm")}


def test_no_candidate_through_a_transpose_or_a_broadcast():
    x, w, b = torch.randn(16, 16), torch.randn(16, 16), torch.randn(16, 1)
    # The kernel reads mm transposed: another index.
    assert candidates(lambda x, w: torch.relu((x @ w).t()).contiguous(), x, w) == set()
    # mm is (16, 1), read broadcast into the (16, 16) output; x is a graph input (never reused).
    assert candidates(lambda x, b: torch.relu(x @ b + x), x, b) == set()
    # Without the broadcast, Inductor turns mm + x into one addmm: relu reads its output.
    assert candidates(lambda x, w: torch.relu(x @ w + x), x, w) == {("relu", "add")}


def test_no_candidate_while_another_reader_may_run_later():
    x, w = torch.randn(8, 16), torch.randn(16, 16)

    def two_readers(x, w):
        m = x @ w
        r = torch.relu(m)  # may not take m: the mm below reads m and is no ancestor of r
        return r, m @ w

    assert candidates(two_readers, x, w) == set()


# --------------------------------------------------------------------------
# Against Inductor
# --------------------------------------------------------------------------


# One compile per model and budget serves these checks and test_fusion's (inductor_watch.py):
# Llama with one layer (inductor_watch.SIZES), as there.
@pytest.mark.parametrize(
    "name,budget", [inductor_watch.param("llama", 1), inductor_watch.param("transformer", 1), ("gpt2", None)]
)
def test_every_reuse_the_simulation_takes_is_one_inductor_makes(name, budget):
    seen = inductor_watch.observe(name, budget)
    ours, theirs, plan, measured = seen.reused, seen.inplace, seen.plan, seen.measured
    assert ours, f"{name}: the simulation took no in-place reuse; the pass is not running"
    assert ours <= theirs, f"{name}: assumed in-place but Inductor allocates: {sorted(ours - theirs)}"
    assert measured <= plan.predicted_peak, (measured, plan.predicted_peak)
