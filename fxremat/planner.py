"""The planner: AOTAutograd's joint graph in, the planned forward and backward out.

``partition`` = analyse -> choose -> report:

- analyse: PyTorch's tag passes, costs, op workspace, Inductor's fusion and
  in-place model, the plain ``RematProblem``;
- choose: solve, lower the decision to the programs that will run, check them,
  judge their simulated peak against the budget and tighten the solver's
  target until it fits; the least-memory plan when nothing does;
- report: the ``Plan``, recorded for ``fxremat.plans()``.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass

import torch.fx as fx

from ._torch_compat import classify_nodes, default_partition, prepare_joint
from .budget import BudgetError, format_bytes
from .options import Options
from .passes.apply import apply_decision
from .passes.calibrate import calibrate_costs
from .hardware import get_hardware
from .passes.cost import NodeCost, annotate
from .passes.fusion import fused_nodes
from .passes.inplace import inplace_pairs
from .passes.invariants import check_saved_aliases
from .passes.problem import ProblemGraph, build_problem, saved_nodes, specialize_sizes
from .passes.scratch import measure_scratch
from .passes.simulate import Simulation, simulate
from .recorder import new_graph_name, record
from .report import build_plan
from .solvers.registry import solve
from .solvers.types import Decision, SolveOptions

__all__ = [
    "partition",
    "watch",
    "Analysis",
    "Lowered",
    "Choice",
    "TIGHTEN_ROUNDS",
    "INDUCTOR_ALLOWANCE",
    "USER_OUTPUTS",
]

# The abstract schedule and the real programs agree up to details the problem does not
# model (getitem placement, views of graph inputs); a few rounds of tightening the
# solver's target by the observed excess close that gap.
TIGHTEN_ROUNDS = 4
# Under inner="inductor" the simulation counts Inductor's buffers through the fusion
# model (passes/fusion.py), but Inductor also makes a few buffers the fx programs do not
# show (layout copies for extern kernels' inputs). The largest excess of a measured peak
# over the fusion-aware simulation seen on the zoo was 3.0% (transformer, least plan:
# simulated 925,956 B, measured 953,864 B); predictions add this share on top.
INDUCTOR_ALLOWANCE = 0.04
# Key in the forward GraphModule's meta: how many of its outputs the user sees (the
# rest are saved for the backward). explain's dry compiler reads it.
USER_OUTPUTS = "fxremat_num_user_outputs"


@dataclass(frozen=True)
class Analysis:
    """What planning knows about a joint graph before choosing."""

    joint: fx.GraphModule
    graph: ProblemGraph
    costs: dict[fx.Node, NodeCost]
    scratch: dict[str, int]
    """Measured op workspace by node name (nodes keep their names in the programs)."""
    fusion: bool
    """Model Inductor's fusion and in-place reuse (inner="inductor")."""
    num_fwd_outputs: int
    static_lifetime_input_nodes: object
    recomputes_rng: bool
    seconds: dict[str, float]


@dataclass(frozen=True)
class Lowered:
    """A decision lowered to the programs that will run, and their predicted memory."""

    decision: Decision
    forward: fx.GraphModule
    backward: fx.GraphModule
    simulation: Simulation
    peak: int
    """Predicted peak: the simulated one, plus ``INDUCTOR_ALLOWANCE`` under Inductor."""


@dataclass(frozen=True)
class Choice:
    """The plan that will run."""

    lowered: Lowered
    fastest: Decision
    fits: bool
    note: str
    solve_seconds: float


_WATCHERS: list[list] = []


@contextlib.contextmanager
def watch():
    """Collect ``(analysis, choice, plan)`` for every graph planned inside the block.

    For tests and tools that compare a plan with what the compiler then does
    (``benchmarks/inductor_check.py``).

    Example:
        >>> with watch() as planned:
        ...     compiled(x).sum().backward()
        >>> analysis, choice, plan = planned[-1]
    """
    seen: list = []
    _WATCHERS.append(seen)
    try:
        yield seen
    finally:
        # By identity: two watchers' lists may be equal (both empty).
        del _WATCHERS[next(i for i, w in enumerate(_WATCHERS) if w is seen)]


def partition(
    joint: fx.GraphModule,
    joint_inputs,
    *,
    options: Options,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
    **_ignored,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Partition AOTAutograd's joint graph under ``options.budget`` (the ``partition_fn`` of AOTAutograd).

    Args:
        joint: the joint forward+backward graph.
        joint_inputs: example inputs of the joint graph (meta carries the shapes).
        options: validated fxremat options.
        num_fwd_outputs: how many joint outputs belong to the forward.
        static_lifetime_input_indices: inputs with static lifetime (parameters).

    Returns:
        (forward, backward) GraphModules; the Plan is recorded (``fxremat.plans()``).

    Raises:
        BudgetError: no plan fits and ``options.on_infeasible == "error"``.
    """
    started = time.perf_counter()
    joint, recomputes_rng = prepare_joint(joint)
    info = classify_nodes(joint, static_lifetime_input_indices or [], num_fwd_outputs)
    if len(info.required_bw_nodes) == 0:
        # Nothing needs a backward (e.g. no input requires grad): nothing to plan.
        return default_partition(joint, joint_inputs, num_fwd_outputs, static_lifetime_input_indices or [], info)
    name = new_graph_name()
    analysis = analyse(joint, info, options, num_fwd_outputs, recomputes_rng)
    choice = choose(analysis, options, name)
    plan = build_plan(name, analysis, choice, options, total_seconds=time.perf_counter() - started)
    for seen in _WATCHERS:
        seen.append((analysis, choice, plan))
    record(plan, options)
    forward, backward = choice.lowered.forward, choice.lowered.backward
    forward.meta[USER_OUTPUTS] = num_fwd_outputs
    return forward, backward


def analyse(joint: fx.GraphModule, info, options: Options, num_fwd_outputs: int, recomputes_rng: bool) -> Analysis:
    """Costs, workspace, the fusion and in-place models, and the plain problem of ``joint``."""
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    if options.budget is not None:
        # A plan is checked at concrete sizes; each new size recompiles and is planned anew.
        specialize_sizes(joint)
    costs = annotate(joint, get_hardware(options.hardware))
    if options.calibrate:
        costs = calibrate_costs(joint, costs)
    seconds["cost"], t = time.perf_counter() - t, time.perf_counter()
    scratch = measure_scratch(list(joint.graph.nodes)) if options.measure_scratch else {}
    seconds["scratch"], t = time.perf_counter() - t, time.perf_counter()
    fusion = options.inner == "inductor"
    forward = set(info.required_fw_nodes)
    fused = fused_nodes(joint.graph, costs, forward) if fusion else set()
    pairs = inplace_pairs(joint.graph, costs, fused, forward) if fusion else []
    graph = build_problem(
        joint, forward, costs, num_fwd_outputs, scratch, fused, options.release_outputs is True, pairs
    )
    seconds["problem"] = time.perf_counter() - t
    return Analysis(
        joint,
        graph,
        costs,
        {n.name: b for n, b in scratch.items() if b},
        fusion,
        num_fwd_outputs,
        info.static_lifetime_input_nodes,
        recomputes_rng,
        seconds,
    )


def lower(analysis: Analysis, decision: Decision, options: Options) -> Lowered:
    """The programs that will run for ``decision``, checked, and their simulated memory."""
    fw, bw = apply_decision(
        analysis.joint,
        saved_nodes(analysis.graph, decision),
        num_fwd_outputs=analysis.num_fwd_outputs,
        static_lifetime_input_nodes=analysis.static_lifetime_input_nodes,
        recomputes_rng=analysis.recomputes_rng,
    )
    check_saved_aliases(fw, bw, analysis.num_fwd_outputs)
    sim = simulate(
        fw,
        bw,
        analysis.num_fwd_outputs,
        analysis.scratch,
        fusion=analysis.fusion,
        outputs_released=options.release_outputs is True,
    )
    peak = math.ceil(sim.peak * (1 + INDUCTOR_ALLOWANCE)) if analysis.fusion else sim.peak
    return Lowered(decision, fw, bw, sim, peak)


def choose(analysis: Analysis, options: Options, name: str) -> Choice:
    """Solve, lower and judge until the programs fit; else the least-memory plan (or BudgetError)."""
    started = time.perf_counter()
    problem = analysis.graph.problem
    solve_options = SolveOptions(time_limit=options.time_limit)
    fastest = solve(problem, None, "save_all", solve_options)
    budget = options.budget
    target = None if budget is None else int(budget / (1 + INDUCTOR_ALLOWANCE)) if analysis.fusion else budget
    lowered: Lowered | None = None
    for _ in range(TIGHTEN_ROUNDS):
        decision = solve(problem, target, options.solver, solve_options)
        if not decision.feasible:
            break
        lowered = lower(analysis, decision, options)
        if budget is None or lowered.peak <= budget:
            return Choice(lowered, fastest, True, decision.note, time.perf_counter() - started)
        # The real programs peak higher than the abstract schedule said: aim lower.
        assert target is not None
        target -= lowered.peak - budget + 1
        if target <= 0:
            break
    assert budget is not None  # without a budget the first plan always fits
    # The least-memory search is bounded by work, not time: a BudgetError names the same least peak under any load.
    lowered = lower(analysis, solve(problem, 1, options.solver, solve_options), options)
    note = lowered.decision.note
    fits = lowered.peak <= budget  # the least-memory plan may still fit a budget at its edge
    if not fits:
        if options.on_infeasible == "error":
            raise BudgetError(budget, lowered.peak, where=name)
        why = (
            f"budget {format_bytes(budget)} is below the least reachable peak {format_bytes(lowered.peak)}; "
            "using the least-memory plan (on_infeasible='min')"
        )
        warnings.warn(f"fxremat {name}: {why}", stacklevel=2)
        note = f"{why}; {note}" if note else why
    return Choice(lowered, fastest, fits, note, time.perf_counter() - started)
