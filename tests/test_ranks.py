"""One plan on every rank (fxremat/ranks.py), in one process: a real in-memory store plays the
process group's, and the rank is set by hand. tests/test_distributed.py runs two real ranks."""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

import fxremat
from fxremat import ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.fixture
def as_rank(monkeypatch):
    """Switch this process between rank 0 and rank 1 of a two-rank job sharing one store."""
    store = dist.HashStore()
    monkeypatch.setattr(ranks, "default_store", lambda: store)
    monkeypatch.setattr(ranks, "_warned", False)

    def switch(rank: int) -> None:
        monkeypatch.setattr(ranks, "distributed_rank", lambda: rank)

    return switch


def test_outside_a_distributed_job_nothing_is_compared():
    assert ranks.distributed_rank() is None
    assert ranks.agree("digest", ("a",), "graph 0") is None


def test_equal_plans_go_on_and_a_different_one_follows_rank_0(as_rank):
    as_rank(0)
    assert ranks.agree("g", ("a", "b"), "graph 0") is None  # rank 0 publishes, never waits
    assert ranks.agree("h", ("c",), "graph 1") is None
    as_rank(1)
    assert ranks.agree("g", ("a", "b"), "graph 0") is None
    assert ranks.agree("g", ("a", "b"), "graph 2") is None  # planned again (a recompile): the same entry
    with pytest.warns(UserWarning, match="planned a different kept set than rank 0"):
        assert ranks.agree("h", ("a",), "graph 1") == ("c",)


def test_a_plan_rank_0_never_made_is_waited_for_then_kept(as_rank, monkeypatch):
    monkeypatch.setenv(ranks.ENV_SYNC_TIMEOUT, "0.2")
    as_rank(1)
    with pytest.warns(UserWarning, match="found no plan from rank 0 for this graph within 0.2 s"):
        assert ranks.agree("only-here", ("a",), "graph 0") is None


def test_later_differences_are_logged_not_warned(as_rank, caplog):
    as_rank(0)
    ranks.agree("g", ("a",), "graph 0")
    ranks.agree("h", ("a",), "graph 1")
    as_rank(1)
    with pytest.warns(UserWarning):
        ranks.agree("g", ("b",), "graph 0")
    with caplog.at_level(logging.WARNING, logger="fxremat"):
        assert ranks.agree("h", ("b",), "graph 1") == ("a",)
    assert "planned a different kept set than rank 0" in caplog.text


def test_the_timeout_variable_is_validated(monkeypatch):
    monkeypatch.setenv(ranks.ENV_SYNC_TIMEOUT, "soon")
    with pytest.raises(ValueError, match="positive number of seconds"):
        ranks.sync_timeout()
    monkeypatch.setenv(ranks.ENV_SYNC_TIMEOUT, "2.5")
    assert ranks.sync_timeout() == 2.5


def test_a_compiled_rank_adopts_rank_0s_plan(as_rank):
    """Through the compile path: rank 0 runs its fastest plan; rank 1, made to keep only the
    graph's inputs, runs rank 0's plan instead (same fingerprint) and still trains correctly."""
    import copy
    from dataclasses import replace
    from unittest import mock

    import torch

    from checks import compare
    from fxremat import planner

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64), torch.nn.Tanh())
    x = torch.randn(128, 64)
    original = planner.choose

    def inputs_only(analysis, options, name, reference=None, check=None):
        return original(analysis, replace(options, solver="save_inputs"), name, reference, check)

    def run(rank: int, choose):
        as_rank(rank)
        torch._dynamo.reset()
        fxremat.clear_plans()
        model = copy.deepcopy(base)
        compiled = torch.compile(model, backend=fxremat.backend(inner="eager", time_slack=0))
        with mock.patch.object(planner, "choose", choose):
            loss = compiled(x).square().mean()
        loss.backward()
        return model, loss, fxremat.plans()[-1]

    _, _, zero = run(0, original)
    with pytest.warns(UserWarning, match="planned a different kept set than rank 0"):
        model, loss, one = run(1, inputs_only)
    assert one.fingerprint() == zero.fingerprint()
    assert "rank 0's plan" in one.note
    ref = copy.deepcopy(base)
    ref_loss = ref(x).square().mean()
    ref_loss.backward()
    compare(ref, ref_loss, model, loss)


def test_collectives_are_never_recomputed():
    """Even the least-memory plan keeps a collective's result: recomputing it would issue the
    collective again, on some ranks only if their plans differed."""
    import warnings

    import torch
    import torch.distributed._functional_collectives as funcol

    class Reduced(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

        def forward(self, x):
            h = funcol.all_reduce(torch.tanh(self.a(x)), "sum", dist.group.WORLD)
            return self.b(h.sin()).square().mean()

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = fxremat.explain(Reduced(), torch.randn(128, 64), inner="eager", budget=1, on_infeasible="min")
    finally:
        dist.destroy_process_group()
    assert plan.recomputed, "the least plan recomputes something"
    assert not [r for r in plan.recomputed if "c10d" in r.op], [r.op for r in plan.recomputed]
    assert any("c10d" in r.op for r in plan.kept), [r.op for r in plan.kept]


def test_fsdp2_room_and_layer_count_from_its_groups():
    """The room left for FSDP2's buffers, and how often a layer's graph runs, from the model's groups."""
    from fxremat import steps
    from fxremat._torch_compat import FsdpGroup

    layer = (((64, 64), "torch.float32"),)
    groups = [
        FsdpGroup(1000, False, (((10, 64), "torch.float32"),), False),  # the root: kept through the step
        FsdpGroup(400, True, layer, True),  # the layer whose graph this is
        FsdpGroup(400, True, layer, False),
        FsdpGroup(400, True, layer, False),
        FsdpGroup(300, True, (((8, 8), "torch.float32"),), False),  # another kind of layer
    ]
    assert steps._fsdp_room(groups) == 1000 + max(3 * 400, 2 * 1000)
    assert steps._fsdp_layers(groups) == 3
    assert steps._fsdp_layers([g._replace(in_graph=g.resharded is False) for g in groups]) == 1  # the root's graph
    assert steps._fsdp_room([]) == 0 and steps._fsdp_layers([]) == 1
