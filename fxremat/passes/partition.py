"""The partitioner: joint graph in, planned forward and backward out.

Runs the passes in one direction: stock tag passes -> cost -> problem ->
solver -> apply -> simulate, and tightens the solver's target while the
simulated peak of the real programs exceeds the budget.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from pathlib import Path

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guard_int

from .._torch_compat import current_compile_id, functorch_config, fx_graph_cse, partitioners
from ..budget import BudgetError, format_bytes
from ..options import Options
from ..plan import NodeRecord, Plan, ValueRecord, next_graph_name, plans, record
from ..solvers.registry import solve
from ..solvers.schedule import bw_reads, close, liveness, programs
from ..solvers.types import BACKWARD, FORWARD, Decision, SolveOptions
from .apply import apply_decision
from .calibrate import calibrate_costs
from .cost import NodeCost, annotate, get_hardware
from .fusion import fused_nodes
from .inplace import inplace_pairs
from .invariants import check_saved_aliases
from .problem import ProblemGraph, build_problem, is_tangent
from .scratch import measure_scratch
from .simulate import simulate

__all__ = ["partition", "TIGHTEN_ROUNDS", "INDUCTOR_ALLOWANCE"]

log = logging.getLogger("fxremat")

# The abstract schedule and the real programs agree up to details the problem
# does not model (getitem placement, views of graph inputs); a few rounds of
# tightening the solver's target by the observed excess close that gap.
TIGHTEN_ROUNDS = 4
# Under inner="inductor" the simulation counts Inductor's buffers through the fusion
# model (passes/fusion.py), but Inductor also makes a few buffers the fx programs do not
# show (layout copies for extern kernels' inputs). The largest excess of a measured peak
# over the fusion-aware simulation seen on the zoo was 3.0% (transformer, least plan:
# simulated 925,956 B, measured 953,864 B); predictions add this share on top.
INDUCTOR_ALLOWANCE = 0.04
# Floor on the time the least-memory search gets before a BudgetError (min-cut's
# least-peak search takes 0.7-4.4 s on 1-4k-node graphs; see docs/SOLVER_SCALING.md).
LEAST_SEARCH_SECONDS = 10.0


def _with_allowance(peak: int, fusion: bool) -> int:
    """The predicted peak: the simulated one, plus ``INDUCTOR_ALLOWANCE`` under Inductor."""
    return math.ceil(peak * (1 + INDUCTOR_ALLOWANCE)) if fusion else peak


def _prepare(joint: fx.GraphModule) -> tuple[fx.GraphModule, bool]:
    """The stock partitioner's preparation: DCE, CSE, tag clean-up, forced saves."""
    joint.graph.eliminate_dead_code()
    joint.recompile()
    if functorch_config.cse:
        joint.graph = fx_graph_cse(joint.graph)
        joint.recompile()
    recomputes_rng = False
    if partitioners.has_recomputable_ops(joint):
        recomputes_rng = partitioners.has_recomputable_rng_ops(joint)
        joint = partitioners.cleanup_recompute_tags(joint, is_default_partition=False)
    if not functorch_config.unsafe_allow_optimization_of_collectives:
        partitioners.force_save_collectives(joint)
    partitioners.force_save_effectful_ops(joint)
    partitioners.force_save_bw_mutation_src(joint)
    return joint, recomputes_rng


def _records(pg: ProblemGraph, costs: dict[fx.Node, NodeCost], ids) -> tuple[ValueRecord, ...]:
    """One record per value; each storage's bytes go to one value that holds it.

    A view of a tensor the plan does not itself keep still keeps that storage
    alive, so the view carries the bytes (the first such view, in graph order).
    """
    problem = pg.problem
    ids = sorted(ids)
    owners_listed = {i for i in ids if problem.storage[i] == i}
    charged: set[int] = set()
    out = []
    for i in ids:
        node = pg.nodes[i]
        c = costs[node]
        s = problem.storage[i]
        nbytes = 0
        if s not in charged and (s == i or s not in owners_listed):
            nbytes = problem.nbytes[s]
            charged.add(s)
        out.append(ValueRecord(node.name, c.op, c.module, nbytes, c.flops, c.seconds))
    return tuple(out)


def _node_records(pg: ProblemGraph, costs: dict[fx.Node, NodeCost], decision: Decision) -> tuple[NodeRecord, ...]:
    kept, recomputed = set(decision.kept), set(decision.recomputed)
    problem = pg.problem
    out = []
    for i, node in enumerate(pg.nodes):
        role = "kept" if i in kept else "recomputed" if i in recomputed else "forward" if problem.phase[i] == FORWARD else "backward"
        c = costs[node]
        out.append(NodeRecord(node.name, c.op, c.module, role, problem.nbytes[i], tuple(problem.names[u] for u in problem.inputs[i])))
    return tuple(out)


def _largest(pg: ProblemGraph, costs: dict[fx.Node, NodeCost]) -> tuple[str, str, int]:
    problem = pg.problem
    if not problem.size:
        return ("", "", 0)
    tangents = set(problem.tangents)
    i = max((v for v in range(problem.size) if v not in tangents), key=lambda v: (problem.nbytes[v], -v), default=0)
    return (pg.nodes[i].name, costs[pg.nodes[i]].module, problem.nbytes[i])


def _references(problem) -> dict[str, tuple[tuple[str, int], ...]]:
    """Predicted timelines of the extremes: keep everything, keep only graph inputs."""
    refs = {}
    for name, kept in (("save_all", bw_reads(problem)), ("save_inputs", ())):
        kept_c, recomputed = close(problem, kept)
        forward, backward = programs(problem, kept_c, recomputed)
        steps = liveness(problem, forward, backward, kept_c).steps
        refs[name] = tuple(("forward" if phase == FORWARD else "backward", live) for _, phase, live in steps)
    return refs


def _saved_nodes(pg: ProblemGraph, decision: Decision) -> list[fx.Node]:
    """Kept forward nodes, plus the graph inputs the backward reads (they cost nothing:
    they exist before the step, but the backward can only see what the forward hands it)."""
    problem = pg.problem
    readers = [pg.nodes[i] for i in range(problem.size) if problem.phase[i] == BACKWARD]
    readers += [pg.nodes[i] for i in decision.recomputed]
    inputs = {a for n in readers for a in n.all_input_nodes if a.op == "placeholder" and not is_tangent(a)}
    graph_inputs = [n for n in pg.nodes[0].graph.nodes if n in inputs]
    return graph_inputs + [pg.nodes[i] for i in decision.kept]


def _specialize_sizes(joint: fx.GraphModule) -> None:
    """Guard every symbolic size of the inputs to its current value.

    A plan is checked against the budget at concrete sizes; a longer sequence
    would peak higher. With a budget, each new size therefore recompiles and
    is planned anew (Dynamo's recompile limit then bounds how many sizes compile).
    """
    for node in joint.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for size in val.shape:
                if isinstance(size, torch.SymInt):
                    guard_int(size)


_WARNED_SHARED: set[str] = set()
# Dynamo frame each recorded plan was compiled for, by plan name: a recompile of the same
# frame (new sizes, new guards) replaces its graph, while a graph break starts a new frame.
_FRAME_OF: dict[str, int | None] = {}


def _current_frame() -> int | None:
    compile_id = current_compile_id()
    return None if compile_id is None else compile_id.frame_id


def _warn_if_shared_budget(plan: Plan, options: Options, frame: int | None) -> None:
    """Warn once per option set when graphs of different frames are planned under one budget.

    Graph breaks split a step into several graphs (Dynamo frames); each is planned under
    the whole budget, because a graph cannot see what the others keep alive. Recompiles
    of one frame (a new sequence length, a changed thread count) do not warn.
    """
    if options.budget is None or options.key() in _WARNED_SHARED:
        return
    earlier = [p for p in plans() if p.budget == options.budget and _FRAME_OF.get(p.graph) != frame]
    if earlier:
        _WARNED_SHARED.add(options.key())
        warnings.warn(
            f"fxremat planned {plan.graph} under budget {format_bytes(options.budget)} after "
            f"{len(earlier)} other graph(s) with the same budget. If they run in one training step "
            "(graph breaks), each is planned under the whole budget and the step can peak above it; "
            "remove the breaks (torch._dynamo.explain) for one budget over the whole step.",
            stacklevel=2,
        )


def partition(
    joint: fx.GraphModule,
    joint_inputs,
    *,
    options: Options,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
    **_ignored,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Partition AOTAutograd's joint graph under ``options.budget``.

    Args:
        joint: the joint forward+backward graph.
        joint_inputs: example inputs of the joint graph (unused: meta carries shapes).
        options: validated fxremat options.
        num_fwd_outputs: how many joint outputs belong to the forward.
        static_lifetime_input_indices: inputs with static lifetime (parameters).

    Returns:
        (forward, backward) GraphModules, and records a Plan (``fxremat.plans()``).

    Raises:
        BudgetError: no plan fits and ``options.on_infeasible == "error"``.
    """
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    joint, recomputes_rng = _prepare(joint)
    info = partitioners.classify_nodes(joint, static_lifetime_input_indices or [], num_fwd_outputs)
    if len(info.required_bw_nodes) == 0:
        # Nothing needs a backward (e.g. no input requires grad): nothing to plan.
        return partitioners.default_partition(
            joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices or [],
            static_lifetime_input_nodes=info.static_lifetime_input_nodes,
        )
    if options.budget is not None:
        _specialize_sizes(joint)
    hardware = get_hardware(options.hardware)
    costs = annotate(joint, hardware)
    if options.calibrate:
        costs = calibrate_costs(joint, costs)
    timings["cost"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    scratch = measure_scratch(list(joint.graph.nodes)) if options.measure_scratch else {}
    scratch_by_name = {n.name: b for n, b in scratch.items() if b}
    timings["scratch"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    fusion = options.inner == "inductor"
    forward = set(info.required_fw_nodes)
    fused = fused_nodes(joint.graph, costs, forward) if fusion else set()
    pairs = inplace_pairs(joint.graph, costs, fused, forward) if fusion else []
    pg = build_problem(joint, forward, costs, num_fwd_outputs, scratch, fused, options.release_outputs, pairs)
    timings["problem"] = time.perf_counter() - t1
    problem = pg.problem
    solve_options = SolveOptions(time_limit=options.time_limit)
    graph_name = next_graph_name()

    def lower(chosen: Decision):
        """The programs that will run for ``chosen``, checked, and their simulated memory."""
        fw, bw = apply_decision(
            joint, _saved_nodes(pg, chosen), num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_nodes=info.static_lifetime_input_nodes, recomputes_rng=recomputes_rng,
        )
        check_saved_aliases(fw, bw, num_fwd_outputs)
        sim = simulate(fw, bw, num_fwd_outputs, hardware, scratch_by_name, fusion=fusion, outputs_released=options.release_outputs)
        return fw, bw, sim

    t2 = time.perf_counter()
    fastest = solve(problem, None, "save_all", solve_options)
    target = options.budget
    if target is not None and fusion:
        target = int(target / (1 + INDUCTOR_ALLOWANCE))
    decision: Decision | None = None
    fw = bw = sim = None
    note = ""
    for _ in range(TIGHTEN_ROUNDS):
        decision = solve(problem, target, options.solver, solve_options)
        if not decision.feasible:
            break
        fw, bw, sim = lower(decision)
        peak = _with_allowance(sim.peak, fusion)
        if options.budget is None or peak <= options.budget:
            break
        # The real programs peak higher than the abstract schedule said: aim lower.
        assert target is not None
        target = target - (peak - options.budget) - 1
        if target <= 0:
            break
    solve_seconds = time.perf_counter() - t2
    assert decision is not None
    fits = decision.feasible and sim is not None and (options.budget is None or _with_allowance(sim.peak, fusion) <= options.budget)
    if not fits:
        assert options.budget is not None  # without a budget the first plan always fits
        # The least-memory search gets at least LEAST_SEARCH_SECONDS: a BudgetError must name a
        # least peak that is really the least fxremat can reach, not a time-starved guess.
        least = solve(problem, 1, options.solver, SolveOptions(time_limit=max(options.time_limit, LEAST_SEARCH_SECONDS)))
        fw, bw, sim = lower(least)
        decision = least
        least_peak = _with_allowance(sim.peak, fusion)
        fits = least_peak <= options.budget  # the least-memory plan may still fit a budget at its edge
        if not fits:
            if options.on_infeasible == "error":
                raise BudgetError(options.budget, least_peak, where=graph_name)
            note = (
                f"budget {format_bytes(options.budget)} is below the least reachable peak "
                f"{format_bytes(least_peak)}; using the least-memory plan (on_infeasible='min')"
            )
            warnings.warn(f"fxremat {graph_name}: {note}", stacklevel=2)
    if decision.note:
        note = f"{note}; {decision.note}" if note else decision.note
    assert sim is not None and fw is not None and bw is not None
    timings["solve"] = solve_seconds
    timings["total"] = time.perf_counter() - t0
    recomputed = _records(pg, costs, decision.recomputed)
    plan = Plan(
        graph=graph_name,
        budget=options.budget,
        predicted_peak=_with_allowance(sim.peak, fusion),
        saved_bytes=sim.saved_bytes,
        recompute_flops=sum(r.flops for r in recomputed),
        recompute_seconds=decision.recompute_seconds,
        solver=decision.solver,
        solve_seconds=solve_seconds,
        kept=_records(pg, costs, decision.kept),
        recomputed=recomputed,
        fastest_peak=fastest.peak_bytes,
        grad_bytes=sim.grad_bytes,
        tangent_bytes=sim.tangent_bytes,
        output_bytes=sim.output_bytes,
        feasible=fits,
        gap=decision.gap,
        note=note,
        pass_seconds=timings,
        num_nodes=problem.size,
        timeline=tuple(
            (sim.names[v], "forward" if phase == FORWARD else "backward", live) for v, phase, live in sim.timeline.steps
        ),
        forward_code=fw.code,
        backward_code=bw.code,
        nodes=_node_records(pg, costs, decision),
        references=_references(problem),
        input_bytes=sum(costs[n].nbytes for n in joint.graph.find_nodes(op="placeholder") if not is_tangent(n)),
        largest=_largest(pg, costs),
        problem=problem,
    )
    frame = _current_frame()
    _warn_if_shared_budget(plan, options, frame)
    _FRAME_OF[plan.graph] = frame
    record(plan)
    log.info(
        "%s: %d nodes, budget %s, predicted peak %s, kept %s, recomputed %d values (%.2f ms est.), solver %s in %.0f ms",
        graph_name, problem.size, "none" if options.budget is None else format_bytes(options.budget),
        format_bytes(plan.predicted_peak), format_bytes(plan.saved_bytes), len(recomputed),
        plan.recompute_seconds * 1e3, plan.solver, solve_seconds * 1e3,
    )
    if options.dump_dir:
        try:
            plan.save(Path(options.dump_dir) / graph_name.replace(" ", "_"))
        except OSError as exc:  # the plan is good and will run; only its files are missing
            warnings.warn(f"fxremat could not save {graph_name}'s plan under dump_dir={options.dump_dir!r}: {exc}", stacklevel=2)
    return fw, bw
