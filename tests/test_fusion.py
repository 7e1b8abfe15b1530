"""Inductor's fusion in the memory model: liveness rules by hand, the fusion pass against Inductor itself.

The liveness tests work out every expected number in their comments. The
Inductor tests compile zoo models and read the buffers Inductor's scheduler
really creates (its post-fusion hook): a value fxremat counts as fused must
never be one of them, and the prediction must bound the measured peak.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

import fxremat
from fxremat import planner
from fxremat._torch_compat import inductor_config, inductor_graph_lowering
from fxremat.hardware import get_hardware
from fxremat.passes.cost import annotate
from fxremat.passes.fusion import fused_nodes
from fxremat.solvers import schedule
from fxremat.solvers.types import BACKWARD, FORWARD, RematProblem

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_schedule import problem as schedule_problem  # noqa: E402
from zoo import ZOO  # noqa: E402

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


# Llama with one layer: the same kinds of values counted as fused as with two, in both programs (forward 16
# kinds, backward 19: rotary cos/sin, RMSNorm's pow and mul, the mask's iota/ge/lt/bitwise_and, the loss's
# exp and where...), 31 and 77 values instead of 45 and 126, in 60% of the time.
_SIZES = {"llama": {"num_hidden_layers": 1}}


def _compile_and_observe(name: str, budget, monkeypatch):
    """Compile a zoo model with fxremat under Inductor; return (fused names per program,
    Inductor's realized buffer origins per program, the plan, the measured peak)."""
    realized: list[set[str]] = []

    def post_fusion(nodes):
        names: dict[str, str] = {}
        for node in nodes:
            for out in node.get_outputs():
                origin = getattr(out.node, "origin_node", None)
                if origin is not None:
                    names[out.get_name()] = origin.name
        realized.append(names)
        return nodes

    # Buffers the scheduler fused away as kernel-local are never allocated: drop them.
    removed: list[set[str]] = []
    compile_to_module = inductor_graph_lowering.compile_to_module

    def compiled_module(self, *args, **kwargs):
        module = compile_to_module(self, *args, **kwargs)
        removed.append(set(self.removed_buffers))
        return module

    monkeypatch.setattr(inductor_graph_lowering, "compile_to_module", compiled_module)

    torch._dynamo.reset()
    fxremat.clear_plans()
    base, inputs = ZOO[name](**_SIZES.get(name, {}))
    model = copy.deepcopy(base)
    # Gradients returned at the end (hand_over_grads off): only the planned forward and backward are
    # compiled, the last two programs the hooks see.
    compiled = torch.compile(
        model, backend=fxremat.backend(budget=budget, on_infeasible="min", inner="inductor", hand_over_grads=False)
    )
    with (
        inductor_config.patch(_post_fusion_custom_pass=post_fusion, fx_graph_cache=False),
        warnings.catch_warnings(),
        planner.watch() as planned,
    ):
        warnings.simplefilter("ignore")
        compiled(*inputs).backward()
        measured = fxremat.measure(lambda: compiled(*inputs).backward(), reps=1, warmup=1)
    lowered = planned[-1][1].lowered
    ours = [
        {n.name for n in fused_nodes(gm.graph, annotate(gm, get_hardware("cpu")))}
        for gm in (lowered.forward, lowered.backward)
    ]
    allocated = [
        {origin for buf, origin in names.items() if buf not in gone} for names, gone in zip(realized[-2:], removed[-2:])
    ]
    return ours[-2:], allocated, fxremat.plans()[-1], measured.peak_bytes


# (name, budget) -> what _compile_and_observe saw: the two tests below both look at the transformer
# at the least budget, and the same compile serves both (about 40 s each on two cores).
_OBSERVED: dict[tuple[str, int], tuple] = {}


def _observed(name: str, budget: int, monkeypatch):
    """``_compile_and_observe``, once per model and budget in this process."""
    if (name, budget) not in _OBSERVED:
        _OBSERVED[name, budget] = _compile_and_observe(name, budget, monkeypatch)
    return _OBSERVED[name, budget]


# The transformer's two tests share one compile (``_observed``): one xdist worker runs both (``--dist loadgroup``).
_TRANSFORMER = pytest.param("transformer", marks=pytest.mark.xdist_group("fusion-transformer"))


@pytest.mark.parametrize("name", ["llama", _TRANSFORMER])
def test_values_counted_as_fused_are_never_buffers_in_inductor(name, monkeypatch):
    # The least-memory plan recomputes the most, so the backward holds the most fused chains.
    ours, realized, _, _ = _observed(name, 1, monkeypatch)
    assert len(ours) == 2 and len(realized) == 2
    for program, fused, buffers in zip(("forward", "backward"), ours, realized):
        assert fused, f"{name} {program}: nothing counted as fused; the pass is not running"
        wrongly = sorted(fused & buffers)
        assert not wrongly, f"{name} {program}: counted as fused but Inductor allocates them: {wrongly}"


@pytest.mark.parametrize("name", ["mlp", _TRANSFORMER])
def test_inductor_prediction_bounds_the_measured_peak(name, monkeypatch):
    # The prediction is the replay of Inductor's own program (passes/inductor_memory.py): an
    # upper bound within the 5%. When written: exact to the byte on both models; with
    # the fusion-aware simulation and its 4% allowance it was +4.0% (mlp) and up to +11.7%.
    _, _, plan, measured = _observed(name, 1, monkeypatch)
    assert measured <= plan.predicted_peak <= 1.05 * measured, (plan.predicted_peak, measured)
