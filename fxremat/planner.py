"""The planner: AOTAutograd's joint graph in, the planned forward and backward out.

``partition`` = analyse -> choose -> report:

- analyse: PyTorch's tag passes, costs, op workspace, Inductor's fusion and
  in-place model, the plain ``RematProblem``;
- choose: solve, lower the decision to the programs that will run, check them,
  judge their peak against the budget (under Inductor: the peak of the program
  Inductor generates for them, ``passes/inductor_memory.py``), and tighten or
  loosen the solver's target until it fits close under the budget; the
  least-memory plan when nothing fits;
- report: the ``Plan``, recorded for ``fxremat.plans()``.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import logging
import math
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import cast

import torch
import torch.fx as fx

from ._torch_compat import classify_nodes, default_partition, lays_out_convolutions, prepare_joint
from .budget import BudgetError, format_bytes
from .options import Options
from .plan import Plan
from .passes.apply import apply_decision
from .passes.calibrate import calibrate_costs
from .hardware import get_hardware
from .passes.cost import NodeCost, annotate, compute_seconds
from .passes.fusion import fused_nodes
from .passes.hand_over import HAND_OVER_SPEC, gradients_to_hand_over, hand_over_gradients
from .passes.forked import workers as forked_workers
from .passes.inductor_memory import (
    donated_inputs,
    lowerings_answered,
    program_events,
    predict_step,
    returned_bytes,
    start_lowering,
    stop_lowering,
)
from .passes.index_put_sums import fold_sums_into_index_put
from .passes.inplace import inplace_pairs
from .passes.invariants import check_saved_aliases
from .passes.problem import ProblemGraph, build_problem, is_tangent, saved_nodes
from .passes.sizes import bound_sizes
from .passes.reference import Reference, as_decision, pointwise_only
from .passes.scratch import ScratchAt, measure_scratch
from .passes.simulate import Simulation, simulate
from .passes.twice import recompute_twice
from . import plan_cache, ranks
from .compile_scope import Vetoed, remembered, veto, vetoes_active
from .recorder import new_graph_name, record
from .report import build_plan
from .solvers.registry import solve, solve_within
from .solvers.schedule import decision as decision_of
from .solvers.twice import nested_least
from .solvers.types import Decision, RematProblem, SolveOptions

__all__ = [
    "partition",
    "watch",
    "Analysis",
    "Lowered",
    "Choice",
    "TIGHTEN_ROUNDS",
    "CLOSE_ENOUGH",
    "FILL_ROUNDS",
    "NEGLIGIBLE_RECOMPUTE",
    "INDUCTOR_ALLOWANCE",
    "NO_BUDGET_MIN_GAIN",
    "NO_BUDGET_MIN_GAIN_BYTES",
    "USER_OUTPUTS",
]

# The solver searches on its fast abstract model; each candidate is judged on the
# programs that will run. The two differ (getitem placement, views of graph inputs; under
# Inductor its fusion, reuse and reordering), so the solver's target is moved by the
# observed difference: down when the programs peak over the budget, up when they leave
# more than 1 - CLOSE_ENOUGH of it unused. At most TIGHTEN_ROUNDS candidates are lowered.
TIGHTEN_ROUNDS = 6
CLOSE_ENOUGH = 0.97
# When the solver's plans jump over the budget (the fitting one far below it, the next one over:
# min-cut's plans change at discrete trade-offs, every identical layer at once), plans in between
# keep the fitting plan's values and part of the faster plan's: at most FILL_ROUNDS more are lowered.
FILL_ROUNDS = 4
# Loosening stops once a fitting plan's estimated recompute time is below this share of the
# step's estimated compute: what is left to gain is within timing noise.
NEGLIGIBLE_RECOMPUTE = 0.01
# Only when Inductor cannot report its program for a plan (planning falls back to the
# fusion-aware simulation, with a warning): the largest excess of a measured peak over
# that simulation seen on the zoo was 3.0%, and predictions add this share on top.
INDUCTOR_ALLOWANCE = 0.04
# With no budget, a candidate plan is lowered and judged only when the solver's model puts
# it at least this share, and this many bytes, below the fastest plan's peak.
NO_BUDGET_MIN_GAIN = 0.02
# What adding one gradient into ``.grad`` in the backward costs a step, net: checking its parameter at
# each call (``grads.existing_grads``: 38 us for the zoo's tiny ViT's 27) less the add autograd's
# AccumulateGrad then no longer makes (0.4-1.6 us a tensor of 256-4096 elements, measured in eager).
# Measured against the same compile returning its gradients, alternating in one process: the zoo's
# ViT (27 gradients) +0.4%, Swin (27) -0.2% and +1.5%, ResNet (10) +0.5% and +1.1% of a 1.9-2.4 ms
# step: -0.2 to 2.6 us a gradient, within the noise of the runs. The custom op this replaced cost 9 us.
HAND_OVER_SECONDS = 1e-6
# Nested checkpoints are taken when they lower the least plan's peak by at least this share: each
# value recomputed twice costs its recompute time again, and code in the backward. HF GPT-2 compiled
# whole (4 layers, hidden 256, Inductor): 156 values recomputed twice measured 38.1 MiB against 39.0
# (-2%) for a 1.47x step and 1.5x compile time; a 32-layer chain of linears, 14.1 against 20.1 MiB
# (-30%) at 1.01x.
TWICE_MIN_GAIN = 0.10
NO_BUDGET_MIN_GAIN_BYTES = 1 << 20
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
    scratch_at: ScratchAt | None = None
    """Under Inductor: op workspace at the input strides Inductor gives its extern kernels."""
    param_outputs: tuple[int, ...] = ()
    """Backward outputs that are parameters' gradients (static-lifetime inputs), handed over to
    ``.grad`` as they are made when ``Options.hand_over_grads`` (``passes/hand_over.py``)."""


@dataclass(frozen=True)
class Lowered:
    """A decision lowered to the programs that will run, and their predicted memory."""

    decision: Decision
    forward: fx.GraphModule
    backward: fx.GraphModule
    simulation: Simulation
    peak: int
    """Predicted peak: under Inductor, of the program Inductor generates; else the simulated one; plus
    ``repeats - 1`` times the saved bytes (the earlier calls of the graph in the step)."""
    source: str = "simulation"
    """Where ``peak`` comes from: "inductor" (its program), "simulation", or "simulation+allowance"."""
    other_peak: int = 0
    """Under Inductor: the peak with the other assumption about the outputs (``InductorStep.other_peak``)."""
    forward_peak: int | None = None
    """Under Inductor: the forward program's own peak, when this run lowered it (not from the plan cache)."""
    again: tuple[str, ...] = ()
    """Values the backward recomputes a second time after its peak (``Decision.twice``), by name."""
    scratch: dict[str, int] | None = None
    """Workspace by node name of these programs when it is not the analysis's (their copies' names)."""
    kernels: int = 0
    """Under Inductor: the kernels its programs call (``InductorStep.kernels``); 0 when not known."""


@dataclass(frozen=True)
class Choice:
    """The plan that will run."""

    lowered: Lowered
    fastest: Decision
    fits: bool
    note: str
    solve_seconds: float
    fastest_peak: int = 0
    """Predicted peak of the fastest plan's programs (judged like every candidate), or of a judged plan
    that recomputes no more than it; ``UNKNOWN`` until ``choose`` completes the choice."""
    lower_seconds: float = 0.0
    """Of ``solve_seconds``: lowering candidates to their programs and judging them (dry Inductor lowerings)."""
    accumulating: tuple[int, int] | None = None
    """``accumulating_peaks`` of the plan: the step's peak when the parameters' ``.grad`` exist."""
    lowering: tuple[str, ...] = ()
    """Dry lowerings already started for ``accumulating`` (``inductor_memory.start_lowering``), ended
    once it is judged."""


log = logging.getLogger("fxremat")

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
    sync_ranks: bool = False,
    **_ignored,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Partition AOTAutograd's joint graph under ``options.budget`` (the ``partition_fn`` of AOTAutograd).

    Args:
        joint: the joint forward+backward graph.
        joint_inputs: example inputs of the joint graph (meta carries the shapes).
        options: validated fxremat options.
        num_fwd_outputs: how many joint outputs belong to the forward.
        static_lifetime_input_indices: inputs with static lifetime (parameters).
        sync_ranks: in a distributed job, check the plan against rank 0's and follow
            it (``fxremat/ranks.py``); off for ``explain``'s dry runs.

    Returns:
        (forward, backward) GraphModules; the Plan is recorded (``fxremat.plans()``).

    Raises:
        BudgetError: no plan fits and ``options.on_infeasible == "error"``.
    """
    started = time.perf_counter()
    reference = None
    if (options.budget is None and options.time_slack > 0) or (
        options.budget is not None and options.solver in SEARCHING_SOLVERS
    ):
        # What plain torch.compile would save: a no-budget candidate, and one for the least-memory plan
        # (copied before prepare_joint edits the graph).
        reference = Reference(joint, joint_inputs, num_fwd_outputs, static_lifetime_input_indices or [])
        if options.budget is None:
            # With no budget it is always a candidate (unless the plan cache has the plan): on another
            # core while this process analyses the graph and searches.
            reference.start()
    joint, recomputes_rng = prepare_joint(joint)
    folded = fold_sums_into_index_put(joint)
    if folded:
        log.debug("fxremat: %d gradient sums accumulated into an embedding's index_put", folded)
    info = classify_nodes(joint, static_lifetime_input_indices or [], num_fwd_outputs)
    if len(info.required_bw_nodes) == 0:
        # Nothing needs a backward (e.g. no input requires grad): nothing to plan.
        return default_partition(joint, joint_inputs, num_fwd_outputs, static_lifetime_input_indices or [], info)
    name = new_graph_name()
    analysis = analyse(joint, info, options, num_fwd_outputs, recomputes_rng)
    analysis = _for_grads(replace(analysis, param_outputs=tuple(sorted(static_lifetime_input_indices or ()))), options)

    def planned(choice: Choice, released: int | None = None) -> Plan:
        return build_plan(
            name,
            analysis,
            choice,
            options,
            total_seconds=time.perf_counter() - started,
            released_peak=released_peak(analysis, choice.lowered, options) if released is None else released,
            accumulating=choice.accumulating,
        )

    def checked(draft: Choice) -> None:
        veto(planned(draft))

    # Inside compile_scope.vetoing: set aside before any code is generated for it, and before what
    # only its report needs is lowered. Outside, nothing can set it aside: no draft plan is built.
    choice = choose(analysis, options, name, reference, check=checked if vetoes_active() else None)
    if sync_ranks:
        choice = follow_rank0(analysis, choice, options, name)
    released = released_peak(analysis, choice.lowered, options)
    why = _hand_over_unpaid(analysis, choice, released, options)
    hands_over = why is None
    if why is not None:
        choice = replace(choice, accumulating=None, note="; ".join(filter(None, [choice.note, why])))
    plan = planned(choice, released)
    if sync_ranks:
        veto(plan)  # rank 0's plan, when this rank follows it
    for seen in _WATCHERS:
        seen.append((analysis, choice, plan))
    record(plan, options)
    forward, backward = choice.lowered.forward, choice.lowered.backward
    forward.meta[USER_OUTPUTS] = num_fwd_outputs
    spec = hand_over_spec(analysis, options)
    if spec is not None and hands_over:
        backward.meta[HAND_OVER_SPEC] = spec
    return forward, backward


def _hand_over_unpaid(analysis: Analysis, choice: Choice, released: int, options: Options) -> str | None:
    """Why the backward's version that hands the gradients over is not worth building, or None when it is.

    Under a budget it always is (the budget may need the memory). With no budget, only when
    it lowers the step's peak with ``.grad`` allocated by ``NO_BUDGET_MIN_GAIN`` at least
    (the caller's outputs alive or dropped), and when its cost (``HAND_OVER_SECONDS`` a
    gradient: the checks at each call, net of the adds autograd no longer makes) fits in the no-budget
    default's time slack, a cost the solver's estimate does not count.
    """
    if options.budget is not None or options.grads_allocated is True or choice.accumulating is None:
        return None
    handed = choice.accumulating
    returned = (choice.lowered.peak, released)  # the gradients returned, the outputs alive or dropped
    if not any(h < (1 - NO_BUDGET_MIN_GAIN) * r for h, r in zip(handed, returned)):
        return (
            f"gradients returned at the backward's end: added into .grad as made, they would lower the peak by "
            f"less than {NO_BUDGET_MIN_GAIN:.0%}"
        )
    step = _step_seconds(analysis, options, choice.lowered) + choice.lowered.decision.recompute_seconds
    calls = len(gradients_to_hand_over(choice.lowered.backward, list(analysis.param_outputs)))
    cost = calls * HAND_OVER_SECONDS
    if cost > options.time_slack * step:
        return (
            f"gradients returned at the backward's end: adding them into .grad as made costs "
            f"~{cost * 1e3:.2g} ms ({calls} gradients), more than the time slack "
            f"({options.time_slack:.0%} of the step's estimated {step * 1e3:.3g} ms"
            + (f": its compute and {choice.lowered.kernels} kernel launches)" if analysis.fusion else ")")
        )
    return None


def _step_seconds(analysis: Analysis, options: Options, lowered: Lowered) -> float:
    """The step's estimated time, the hand-over's time slack is a share of. Under Inductor its
    compute (FLOPs and bytes moved at the profile's rates) and a launch for each kernel its programs
    call (``Lowered.kernels``): the solver's per-op launch overheads price ops Inductor fuses into a
    few kernels, and on small steps they are most of the estimate (the zoo's tiny HF ResNet: 6.7 ms
    with them, 2.0 ms measured). Still below the step that runs, which also pays its Python: the
    zoo's tiny ViT has 0.22 ms of compute and 67 kernels (0.46 ms of launches), and measured 1.9 ms.
    Eager runs every op: all of it."""
    if not analysis.fusion:
        return sum(analysis.graph.problem.seconds)
    hardware = get_hardware(options.hardware)
    return compute_seconds(analysis.costs, hardware) + lowered.kernels * hardware.launch_seconds


def analyse(joint: fx.GraphModule, info, options: Options, num_fwd_outputs: int, recomputes_rng: bool) -> Analysis:
    """Costs, workspace, the fusion and in-place models, and the plain problem of ``joint``."""
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    if options.budget is not None:
        # A plan is checked at concrete sizes: a dynamic graph runs only up to them, or only at them
        # (passes/sizes.py). The backend guarded Dynamo's graph already (backend.fixing_sizes); this
        # covers the partitioner called on its own, and a joint graph whose backward does not grow.
        bound_sizes(joint)
    costs = annotate(joint, get_hardware(options.hardware))
    if options.calibrate:
        costs = calibrate_costs(joint, costs)
    seconds["cost"], t = time.perf_counter() - t, time.perf_counter()
    fusion = options.inner == "inductor"
    # Inductor runs convolutions channels-last under its layout optimisation (on where
    # fxremat's backend leaves it on: conv_layout.py), and their workspace depends on it.
    channels_last = fusion and lays_out_convolutions()
    scratch = measure_scratch(list(joint.graph.nodes), channels_last) if options.measure_scratch else {}
    seconds["scratch"], t = time.perf_counter() - t, time.perf_counter()
    forward = set(info.required_fw_nodes)
    fused = fused_nodes(joint.graph, costs, forward) if fusion else set()
    pairs = inplace_pairs(joint.graph, costs, fused, forward) if fusion else []
    graph = build_problem(
        joint, forward, costs, num_fwd_outputs, scratch, fused, options.release_outputs is True, pairs
    )
    if options.repeats > 1:
        graph = replace(graph, problem=replace(graph.problem, copies=options.repeats - 1))
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
        ScratchAt(list(joint.graph.nodes)) if fusion and options.measure_scratch else None,
    )


def lower(
    analysis: Analysis, decision: Decision, options: Options, known: tuple[int, int, int] | None = None
) -> Lowered:
    """The programs that will run for ``decision``, checked, and their simulated memory.

    ``known``: the (peak, other peak, kernels) Inductor's programs for this decision were judged at
    in an earlier run (``plan_cache``); the dry lowering is then skipped.
    """
    fw, bw, made = _programs(analysis, decision, options)
    if not decision.twice:
        return _judge_programs(analysis, decision, fw, bw, options, known, analysis.scratch)
    # A copy's workspace is its value's (the dry lowering and the replays look it up by name). A new
    # dict: the analysis's own is part of the plan cache's key.
    scratch = {
        **analysis.scratch,
        **{twin: analysis.scratch[name] for twin, name in made.items() if name in analysis.scratch},
    }
    lowered = _judge_programs(analysis, decision, fw, bw, options, known, scratch)
    return replace(lowered, again=tuple(sorted(set(made.values()))), scratch=scratch)


Programs = tuple[fx.GraphModule, fx.GraphModule, dict[str, str]]
# Programs ``_lower_ahead`` built to hand to the children, for ``lower`` to take instead of building them
# again (1.8 s of the benchmark GPT-2's no-budget explain was spent on 8 builds of 4 plans). Each is taken
# once, so no two judgements share graphs. One never taken goes with its analysis, or after the last few.
_BUILT: OrderedDict[tuple, Programs] = OrderedDict()
_BUILT_KEPT = 8


def _built_key(analysis: Analysis, decision: Decision, options: Options) -> tuple:
    # What ``_programs`` reads: the analysis (by identity), the kept set, the nesting and released outputs.
    return (id(analysis), decision.kept, decision.twice, options.release_outputs is True)


def _programs(analysis: Analysis, decision: Decision, options: Options, keep: bool = False) -> Programs:
    """The forward and backward ``decision`` runs, checked, and the nested copies' names (copy -> value):
    the ones ``_lower_ahead`` built when it did (taken once), else built now. ``keep``: built to be taken
    by a later call."""
    key = _built_key(analysis, decision, options)
    ahead = _BUILT.get(key) if keep else _BUILT.pop(key, None)
    if ahead is not None:
        return ahead
    programs = _build_programs(analysis, decision, options)
    if keep:
        _BUILT[key] = programs
        # Dropped when the analysis is collected, before its id can name another.
        weakref.finalize(analysis, _BUILT.pop, key, None)
        while len(_BUILT) > _BUILT_KEPT:
            _BUILT.popitem(last=False)
    return programs


def _build_programs(analysis: Analysis, decision: Decision, options: Options) -> Programs:
    fw, bw = apply_decision(
        analysis.joint,
        saved_nodes(analysis.graph, decision),
        num_fwd_outputs=analysis.num_fwd_outputs,
        static_lifetime_input_nodes=analysis.static_lifetime_input_nodes,
        recomputes_rng=analysis.recomputes_rng,
    )
    check_saved_aliases(fw, bw, analysis.num_fwd_outputs)
    if not decision.twice:
        return fw, bw, {}
    bw, made = recompute_twice(
        fw,
        bw,
        analysis.num_fwd_outputs,
        analysis.scratch,
        fusion=analysis.fusion,
        outputs_released=options.release_outputs is True,
        max_splits=decision.twice,
    )
    return fw, bw, made


def _lower_ahead(analysis: Analysis, decisions: list[Decision], options: Options, here: bool = True) -> list[str]:
    """Start the dry lowerings of the programs ``decisions`` will be judged on, in forked children
    (``inductor_memory.start_lowering``), in the order ``lower`` asks for them; the fingerprints handed out.
    ``here=False``: all of them in children, this process searching meanwhile."""
    if not analysis.fusion or forked_workers() < 2:
        return []
    pairs = []
    for decision in decisions:
        fw, bw, _ = _programs(analysis, decision, options, keep=True)
        pairs.append((fw, _judged_backward(analysis, bw, options)))
    return _lower_beside(analysis, pairs, here)


def _lower_beside(
    analysis: Analysis, pairs: list[tuple[fx.GraphModule, fx.GraphModule]], here: bool = True
) -> list[str]:
    """Start the dry lowerings of (forward, judged backward) pairs in forked children, in the order
    ``predict_step`` asks for them; the fingerprints handed out (none when forking is off)."""
    if not analysis.fusion or forked_workers() < 2:
        return []
    n = analysis.num_fwd_outputs
    return start_lowering(
        [p for fw, bw in pairs for p in ((fw, False, None, None), (bw, True, donated_inputs(fw, bw, n), fw))], here
    )


def _judge_programs(
    analysis: Analysis,
    decision: Decision,
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    options: Options,
    known: tuple[int, int, int] | None,
    scratch: dict[str, int],
) -> Lowered:
    """``lower``'s judgement of the programs ``fw`` and ``bw``, whose nodes' workspace is ``scratch``."""
    judged = _judged_backward(analysis, bw, options)
    sim = simulate(
        fw,
        judged,
        analysis.num_fwd_outputs,
        scratch,
        fusion=analysis.fusion,
        outputs_released=options.release_outputs is True,
    )
    # Earlier calls of this graph in the step hold their saved activations through this one.
    held = (options.repeats - 1) * sim.saved_bytes
    if not analysis.fusion:
        return Lowered(decision, fw, bw, sim, sim.peak + held)
    if known is not None:
        return Lowered(decision, fw, bw, sim, known[0], "inductor", known[1], kernels=known[2])
    # The backward is lowered in a forked child while this process lowers the forward (passes/forked.py).
    forked = _lower_beside(analysis, [(fw, judged)])
    try:
        step = predict_step(
            fw,
            judged,
            analysis.num_fwd_outputs,
            scratch,
            outputs_released=options.release_outputs is True,
            scratch_at=analysis.scratch_at,
        )
    except Exception as e:  # noqa: BLE001 - any failure of the dry lowering must not stop training
        warnings.warn(
            f"fxremat: Inductor could not report its program for this plan ({type(e).__name__}: {e}); "
            f"predicting from the fusion-aware simulation plus {INDUCTOR_ALLOWANCE:.0%}",
            stacklevel=2,
        )
        peak = math.ceil(sim.peak * (1 + INDUCTOR_ALLOWANCE)) + held
        return Lowered(decision, fw, bw, sim, peak, "simulation+allowance")
    finally:
        stop_lowering(forked)
    return Lowered(
        decision,
        fw,
        bw,
        sim,
        step.peak + held,
        "inductor",
        step.other_peak + held,
        step.forward_peak,
        kernels=step.kernels,
    )


def _for_grads(analysis: Analysis, options: Options) -> Analysis:
    """Planned for steps whose parameters' ``.grad`` exist (``Options.grads_allocated``): the solvers'
    model frees each parameter's gradient after its last use (it is handed over), instead of keeping
    it to the step's end; the programs are judged on the backward that hands them over."""
    if options.grads_allocated is not True or hand_over_spec(analysis, options) is None:
        return analysis
    outs = list(next(iter(analysis.joint.graph.find_nodes(op="output"))).args[0])
    ids = {n: i for i, n in enumerate(analysis.graph.nodes)}
    handed = {ids.get(outs[analysis.num_fwd_outputs + k]) for k in analysis.param_outputs}
    problem = analysis.graph.problem
    kept = tuple(v for v in problem.bw_outputs if v not in handed)
    # Still computed (the hand-over op consumes them), only not alive to the step's end: dropped from
    # the programs' outputs alone, the solvers' model skipped the weight gradients and the activations
    # they read (HF Llama, vocabulary 2k: a plan modelled at 10.4 MiB ran at 81.1).
    gone = tuple(v for v in sorted(set(problem.bw_outputs) - set(kept)) if not problem.is_forward(v))
    problem = replace(problem, bw_outputs=kept, handed=gone)
    return replace(analysis, graph=replace(analysis.graph, problem=problem))


def _handed_backward(analysis: Analysis, backward: fx.GraphModule, options: Options) -> fx.GraphModule | None:
    """A copy of ``backward`` that adds each parameter's gradient into ``.grad`` as it is made, or None
    when it hands none over."""
    spec = hand_over_spec(analysis, options)
    if spec is None:
        return None
    # A new graph over the same attributes: deep-copying the module would copy its tensor constants,
    # which fails for fake ones (HF GPT-2's attention mask: "set the storage of a tensor on device meta").
    handed = fx.GraphModule(backward, copy.deepcopy(backward.graph))
    handed.meta.update(backward.meta)
    return handed if hand_over_gradients(handed, list(spec[0])) else None


def _judged_backward(analysis: Analysis, backward: fx.GraphModule, options: Options) -> fx.GraphModule:
    """The backward a plan is judged on: planned for steps whose parameters' ``.grad`` exist
    (``Options.grads_allocated``), the version that adds each gradient in as it is made."""
    if options.grads_allocated is not True:
        return backward
    return _handed_backward(analysis, backward, options) or backward


def follow_rank0(analysis: Analysis, choice: Choice, options: Options, name: str) -> Choice:
    """In a distributed job: rank 0's plan of this graph when this rank's differs (``ranks.agree``)."""
    if ranks.distributed_rank() is None:
        return choice  # not a job of several ranks: nothing to hash
    nodes = analysis.graph.nodes
    kept = tuple(nodes[i].name for i in choice.lowered.decision.kept)
    theirs = ranks.agree(ranks.graph_digest(analysis.joint, options), kept, name)
    if theirs is None:
        return choice
    lowered = lower(analysis, as_decision(analysis.graph, theirs, "rank 0", "", options.budget), options)
    fits = options.budget is None or lowered.peak <= options.budget - options.reserve
    note = f"rank 0's plan: this rank had planned another ({choice.lowered.decision.solver}, {len(kept)} kept)"
    accumulating = accumulating_peaks(analysis, lowered, options)
    return replace(
        choice, lowered=lowered, fits=fits, note="; ".join(filter(None, [note, choice.note])), accumulating=accumulating
    )


def _scratch(analysis: Analysis, lowered: Lowered) -> dict[str, int]:
    """Workspace by node name of ``lowered``'s programs."""
    return analysis.scratch if lowered.scratch is None else lowered.scratch


def released_peak(analysis: Analysis, lowered: Lowered, options: Options) -> int:
    """The predicted peak of ``lowered``'s programs when the caller drops the outputs before the backward."""
    if options.release_outputs is True:
        return lowered.peak
    if lowered.source == "inductor":
        return lowered.other_peak
    sim = simulate(
        lowered.forward,
        _judged_backward(analysis, lowered.backward, options),
        analysis.num_fwd_outputs,
        _scratch(analysis, lowered),
        fusion=analysis.fusion,
        outputs_released=True,
    )
    held = (options.repeats - 1) * sim.saved_bytes
    return held + (
        math.ceil(sim.peak * (1 + INDUCTOR_ALLOWANCE)) if lowered.source == "simulation+allowance" else sim.peak
    )


def hand_over_spec(analysis: Analysis, options: Options) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """What the backward's compiler needs to build the program that hands gradients over
    (``fxremat/grads.py``): the parameters' output positions and the
    autograd edge of each input (-1 for a size: autograd gives only tensor inputs an edge, so a
    graph with dynamic sizes has fewer edges than inputs)."""
    if not options.hand_over_grads or not analysis.param_outputs:
        return None
    inputs = [n for n in analysis.joint.graph.find_nodes(op="placeholder") if not is_tangent(n)]
    edges, edge = [], 0
    for n in inputs:
        if isinstance(n.meta.get("val"), torch.Tensor):
            edges.append(edge)
            edge += 1
        else:
            edges.append(-1)
    return analysis.param_outputs, tuple(edges)


def accumulating_peaks(analysis: Analysis, lowered: Lowered, options: Options) -> tuple[int, int] | None:
    """The predicted peak of a step whose parameters' ``.grad`` exist before the backward, with the
    outputs as the plan assumed them and released: the backward then hands each parameter's
    gradient over as it is made (added in, and freed). None when no gradient is handed over."""
    if lowered.source == "simulation+allowance" or hand_over_spec(analysis, options) is None:
        return None
    if options.grads_allocated is True:  # the plan was judged so: its own peaks
        return lowered.peak, released_peak(analysis, lowered, options)
    backward = _handed_backward(analysis, lowered.backward, options)
    if backward is None:
        return None
    assumed = options.release_outputs is True
    held_calls = options.repeats - 1
    if lowered.source == "inductor":
        step = predict_step(
            lowered.forward,
            backward,
            analysis.num_fwd_outputs,
            _scratch(analysis, lowered),
            outputs_released=assumed,
            forward_peak=lowered.forward_peak,
            scratch_at=analysis.scratch_at,
        )
        extra = held_calls * lowered.simulation.saved_bytes
        return step.peak + extra, (step.peak if assumed else step.other_peak) + extra
    peaks = []
    for released in (assumed, True):
        sim = simulate(
            lowered.forward, backward, analysis.num_fwd_outputs, _scratch(analysis, lowered), outputs_released=released
        )
        peaks.append(sim.peak + held_calls * sim.saved_bytes)
    return peaks[0], peaks[1]


def _out_of_reach(options: Options, least_peak: int) -> str:
    """Why a budget gets the least-memory plan (on_infeasible='min')."""
    assert options.budget is not None
    budget = max(1, options.budget - options.reserve)
    outside = (
        f" ({format_bytes(budget)} after {format_bytes(options.reserve)} reserved outside the graph)"
        if options.reserve
        else ""
    )
    return (
        f"budget {format_bytes(options.budget)}{outside} is below the least reachable peak "
        f"{format_bytes(least_peak)}; using the least-memory plan (on_infeasible='min')"
    )


def _faster(a: Lowered, b: Lowered) -> bool:
    """``a`` recomputes less than ``b`` (then: peaks lower)."""
    return (a.decision.recompute_seconds, a.peak) < (b.decision.recompute_seconds, b.peak)


def _finish(best: Lowered, whole: Decision, judge, budget: int) -> Lowered:
    """``best`` (found by ``auto``'s first stage), or ``whole`` (``auto`` run whole at its target) when faster and fitting."""
    if whole.kept == best.decision.kept:
        return replace(best, decision=whole)  # the same plan, named and noted by ``auto``
    if whole.feasible:
        other = judge(whole)
        if other.peak <= budget and _faster(other, best):
            return other
    note = "; ".join(filter(None, [best.decision.note, "the ILP's plan was not faster within the budget"]))
    return _named(replace(best, decision=replace(best.decision, note=note)), "auto")


# Solvers that search for a plan (the others apply one policy whatever the budget).
SEARCHING_SOLVERS = ("auto", "mincut", "ilp")


def _filled(
    problem: RematProblem,
    best: Lowered,
    over: Lowered | None,
    fastest: Decision,
    judge,
    budget: int,
    negligible: float = 0.0,
) -> Lowered:
    """``best``, or a faster plan between it and ``over`` (else ``fastest``) whose programs still fit.

    ``best`` fits and leaves more than ``1 - CLOSE_ENOUGH`` of the budget unused; the faster plan peaks
    over it. Their kept sets differ by many values at once (min-cut switches every identical layer at
    the same trade-off). Plans in between keep all of ``best``'s values and the first ``k`` of the
    faster plan's others, most recompute time saved per byte first; keeping more is always a valid
    plan. ``k`` is aimed by the secant of the programs' peak against the bytes added, judged on the
    programs, at most ``FILL_ROUNDS`` lowerings: the same graph gives the same plan. Not when ``best``
    recomputes ``negligible`` seconds or less: there is nothing left worth a lowering.
    """
    if best.peak >= CLOSE_ENOUGH * budget or best.decision.twice or best.decision.recompute_seconds <= negligible:
        return best
    toward = over.decision if over is not None else fastest
    base = set(best.decision.kept)

    def size(v: int) -> int:
        return problem.nbytes[problem.storage[v]]

    extra = sorted(set(toward.kept) - base, key=lambda v: (-problem.seconds[v] / max(size(v), 1), v))
    added = [0]
    for v in extra:
        added.append(added[-1] + size(v))
    # (k, programs' peak) of the nearest plans known to fit and to peak over the budget
    lo, lo_peak = 0, best.peak
    hi, hi_peak = (len(extra), over.peak) if over is not None else (len(extra) + 1, None)
    found = best
    aim = (1 + CLOSE_ENOUGH) / 2 * budget
    for _ in range(FILL_ROUNDS):
        if hi - lo <= 1 or found.peak >= CLOSE_ENOUGH * budget:
            break
        # bytes to add for the programs to peak at ``aim``: by the secant through the known plans, else one to one
        slope = (hi_peak - lo_peak) / max(added[hi] - added[lo], 1) if hi_peak is not None else 1.0
        want = added[lo] + (aim - lo_peak) / max(slope, 1e-9)
        k = min(max(bisect.bisect_right(added, want) - 1, lo + 1), hi - 1)
        decision = decision_of(problem, base | set(extra[:k]), budget, best.decision.solver)
        if decision.recompute_seconds >= found.decision.recompute_seconds:
            lo = k  # nothing to gain yet: look further
            continue
        lowered = judge(decision)
        log.debug(
            "fxremat: %d of %d more values kept -> programs peak %d (budget %d)", k, len(extra), lowered.peak, budget
        )
        if lowered.peak <= budget:
            lo, lo_peak, found = k, lowered.peak, lowered
        else:
            hi, hi_peak = k, lowered.peak
    if found is best:
        return best
    note = (
        f"{len(found.decision.kept) - len(best.decision.kept)} more values kept than the solver's plan "
        f"({format_bytes(best.peak)} -> {format_bytes(found.peak)}), between it and a faster plan that peaks over"
    )
    return replace(found, decision=replace(found.decision, note="; ".join(filter(None, [best.decision.note, note]))))


def _pytorchs(analysis: Analysis, reference: Reference | None) -> Decision | None:
    """PyTorch's own partition (plain ``torch.compile``'s) as a decision; None without one."""
    names = reference.saved() if reference is not None else None
    return as_decision(analysis.graph, names) if names is not None else None


def _least(analysis: Analysis, search: str, options: Options, judge, reference: Reference | None = None) -> Lowered:
    """The least-memory plan, judged on its programs: the least-peak search's, or per-layer
    checkpointing's or PyTorch's own partition (``reference``) when its programs peak lower.

    The search ranks plans by the solver's model of memory, which the programs can
    disagree with: on HF GPT-2 (vocabulary 2k) it chose a plan whose programs peak at
    49.0 MiB, where per-layer checkpointing's peak at 44.2 MiB; on HF Llama in bf16
    (vocabulary 32k, the loss whole) 128.0 MiB, where PyTorch's partition, the plan
    with no budget, peaks at 107.0 MiB, so budgets between the two were refused.
    """
    problem = analysis.graph.problem
    solve_options = SolveOptions(time_limit=options.time_limit)
    least = solve(problem, 1, search, solve_options)
    if options.solver not in SEARCHING_SOLVERS:
        return judge(least)
    per_layer = solve(problem, None, "per_layer", solve_options)
    theirs = _pytorchs(analysis, reference)
    candidates = [(least, ""), (per_layer, "per-layer checkpointing's plan")]
    if theirs is not None:
        candidates.append((theirs, "PyTorch's own partition (plain torch.compile's)"))
    judged, _, _ = _judged_unless_beaten(analysis, candidates, options, judge, hand_over=False)
    found, why = min(judged, key=lambda c: c[0].peak)  # of equal peaks, the search's, then per-layer's
    if why:
        searched = next((lowered.peak for lowered, w in judged if not w), None)
        than = (
            f"the least-peak search's at {format_bytes(searched)}"
            if searched is not None
            else "below what the least-peak search's forward alone returns"
        )
        note = f"{why}: its programs peak at {format_bytes(found.peak)}, {than}"
        found = replace(found, decision=replace(found.decision, note=note))
    # Nested checkpoints: fewer values kept, the segments between them recomputed a second time.
    kept, peak, splits = nested_least(problem, found.decision.kept)
    if not splits or peak > (1 - TWICE_MIN_GAIN) * found.decision.peak_bytes:
        return found
    nested = judge(replace(decision_of(problem, kept, None, found.decision.solver), twice=splits))
    if not nested.again or nested.peak > (1 - TWICE_MIN_GAIN) * found.peak:
        return found
    note = (
        f"nested checkpoints: {len(nested.again)} values recomputed a second time after the backward's peak "
        f"({format_bytes(found.peak)} -> {format_bytes(nested.peak)})"
    )
    return replace(nested, decision=replace(nested.decision, note="; ".join(filter(None, [found.decision.note, note]))))


def _named(lowered: Lowered, solver: str) -> Lowered:
    """``lowered`` labelled as found by the first stage of ``solver`` (``auto:mincut``)."""
    return replace(lowered, decision=replace(lowered.decision, solver=f"{solver}:{lowered.decision.solver}"))


def _judged_unless_beaten(
    analysis: Analysis,
    worthy: list[tuple[Decision, str]],
    options: Options,
    judge: _Judge,
    hand_over: bool = True,
) -> tuple[list[tuple[Lowered, str]], Decision | None, list[str]]:
    """The candidates ``worthy`` judged (with their reasons, in their order), except those whose
    programs cannot peak below a candidate judged before them: never the least peak. Then the
    candidate judged first, most likely chosen, and (``hand_over``) the fingerprints of its
    backward that hands the gradients over, started in a child (``_lower_handed``):
    ``stop_lowering`` them unless chosen.

    A plan's programs peak no lower than what its forward returns, alive together when it returns
    (``returned_bytes``: the saved values and the outputs). Under Inductor the candidates are judged
    least modelled peak first (then least bound), each only if its bound is at or under the least peak
    judged so far, so a dry lowering is spent only where it can win (the Llama-3-8B shape with no
    budget: PyTorch's partition returns 19.6 GiB, the least peak within the time slack peaks at
    17.0 GiB: 16 s of lowering). Without fusion every candidate is judged: a judgement is a simulation.
    Their programs are lowered a few candidates at a time (two programs each), in forked children
    beside this process.
    """
    if not analysis.fusion or not worthy:
        return [(judge(d), why) for d, why in worthy], None, []
    with judge.timing():  # building a candidate's programs is part of lowering it, as in ``lower``
        bounds = [_returned_bound(analysis, d, options) for d, _ in worthy]
    # The solver's model of each plan's peak ranks them best: judged first, the least peak judged
    # rises early and skips the most (a bound ranks them worse: on the benchmark BERT PyTorch's
    # partition returns the least, 100.1 MiB, and peaks the most, 143.2 MiB against 120.1).
    order = sorted(range(len(worthy)), key=lambda i: (worthy[i][0].peak_bytes, bounds[i]))
    likely = worthy[order[0]][0]
    with judge.timing():  # it lowers the likely candidate's forward here
        handed = _lower_handed(analysis, likely, options) if hand_over else []
    at_once = max(1, forked_workers() // 2)
    judged: dict[int, Lowered] = {}

    def beaten(i: int) -> bool:
        least = min((lowered.peak for lowered in judged.values()), default=None)
        if least is None or bounds[i] <= least:
            return False
        log.debug(
            "fxremat: %s not lowered: its forward returns %s, above the %s a candidate's programs peak at",
            worthy[i][1] or "the first candidate",
            format_bytes(bounds[i]),
            format_bytes(least),
        )
        return True

    try:
        for start in range(0, len(order), at_once):
            batch = [i for i in order[start : start + at_once] if not beaten(i)]
            with judge.timing():
                ahead = _lower_ahead(analysis, [worthy[i][0] for i in batch], options)
            try:
                for i in batch:
                    if not beaten(i):
                        judged[i] = judge(worthy[i][0])
            finally:
                stop_lowering(ahead)
    except BaseException:
        stop_lowering(handed)
        raise
    return [(judged[i], worthy[i][1]) for i in sorted(judged)], likely, handed


def _lower_handed(analysis: Analysis, decision: Decision, options: Options) -> list[str]:
    """Start the dry lowering of the backward that hands ``decision``'s gradients over as they are
    made, which ``accumulating_peaks`` judges once ``decision`` is chosen, in a forked child beyond
    the workers' count (one core is often idle meanwhile: the Llama-3-8B shape's quickest plan
    lowers in a child while this process lowers the candidate's own programs, then 20 s alone); the
    fingerprints handed out."""
    if not analysis.fusion or forked_workers() < 2 or options.grads_allocated is True:
        return []
    fw, bw, _ = _programs(analysis, decision, options, keep=True)
    handed = _handed_backward(analysis, bw, options)
    if handed is None:
        return []
    try:  # the forward's events first, here: the child then lowers the backward at its arrival strides
        program_events(fw, is_backward=False)
    except Exception:  # noqa: BLE001 - the judgement of this plan meets the failure and says so
        return []
    donated = donated_inputs(fw, handed, analysis.num_fwd_outputs)
    return start_lowering([(handed, True, donated, fw)], here=False, extra=1)


def _returned_bound(analysis: Analysis, decision: Decision, options: Options) -> int:
    """No program of ``decision`` peaks below this: what its forward returns, and the saved values
    earlier calls of the graph hold (``Options.repeats``). Its programs are kept for ``lower``."""
    fw, _, _ = _programs(analysis, decision, options, keep=True)
    returned, saved = returned_bytes(fw, analysis.num_fwd_outputs)
    return returned + (options.repeats - 1) * saved


def _no_budget(
    analysis: Analysis, options: Options, fastest: Decision, judge, started: float, reference: Reference | None
) -> Choice:
    """The least-peak plan within the time slack: never above the fastest plan's peak, nor PyTorch's own.

    Candidates, each judged on the programs that will run; the lowest peak runs
    (then the least recompute):

    - the fastest plan;
    - the least-peak plan within ``options.time_slack`` of the fastest plan's
      estimated step time (searched on the solver's model);
    - PyTorch's own partition (``reference``: what plain ``torch.compile`` saves;
      its time is plain ``torch.compile``'s);
    - the least-peak plan that recomputes only pointwise ops and views, up to
      PyTorch's partition's estimated recompute time: the kind of work Inductor
      runs inside the backward's kernels, which the roofline prices as
      standalone kernels. Letting any op use that time bought matmul
      recomputation on GPT-2 (+11% measured step time).
    """
    problem = analysis.graph.problem
    solve_options = SolveOptions(time_limit=options.time_limit)
    first = solve(problem, None, options.solver, solve_options)
    slack = options.time_slack * (sum(problem.seconds) + first.recompute_seconds)
    # Each lowering costs a dry Inductor compile: fxremat's own candidates that barely lower the
    # solver's estimate are not worth one (small graphs, whose plans differ by kilobytes, get none).
    # PyTorch's own partition is judged at any size: without it a small graph's plan peaked above
    # plain torch.compile's (HF GPT-2, Gemma 3 and Swin of the zoo: 1.10-1.15x).
    theirs_worth = (1 - NO_BUDGET_MIN_GAIN) * first.peak_bytes
    worth = min(theirs_worth, first.peak_bytes - NO_BUDGET_MIN_GAIN_BYTES)
    if slack <= 0 or (worth <= 0 and reference is None):
        quickest = judge(first)
        return Choice(quickest, fastest, True, quickest.decision.note, time.perf_counter() - started, UNKNOWN)
    # The quickest plan's programs are lowered in forked children while this process searches for the
    # others (one core each): 6.8 s of the benchmark GPT-2's no-budget compile, on both cores, before.
    with judge.timing():  # its programs are built here: lowering, not search
        behind = _lower_ahead(analysis, [first], options, here=False) if worth > 0 else []
    handed: list[str] = []
    try:
        within = f"within {options.time_slack:.0%} of the fastest plan's estimated step time"
        found: list[tuple[Decision, str, float]] = []  # (candidate, why, the peak it must be under to be judged)
        if worth > 0:
            least = solve_within(problem, slack, options.solver, solve_options, first)
            found.append((least, f"the least peak {within}", worth))
        theirs = _pytorchs(analysis, reference)
        if theirs is not None:
            below = f", below the least peak {within}" if worth > 0 else ""
            found.append((theirs, f"PyTorch's own partition (plain torch.compile's){below}", theirs_worth))
            if worth > 0 and theirs.recompute_seconds > slack:
                # As much pointwise recompute as PyTorch's partition does, placed by fxremat's memory model.
                cheap = pointwise_only(analysis.graph, analysis.costs)
                budgeted = theirs.recompute_seconds
                found.append(
                    (
                        solve_within(cheap, budgeted, options.solver, solve_options),
                        f"the least peak recomputing only pointwise ops and views, within PyTorch's own partition's "
                        f"estimated recompute ({budgeted * 1e3:.3g} ms)",
                        worth,
                    )
                )
        worthy = [(d, why) for d, why, under in found if d.peak_bytes < under]
        # The quickest plan's programs first when its child has answered (its worker is free again);
        # else this process judges the others meanwhile. Either order gives the same plan.
        quickest = judge(first) if not analysis.fusion or lowerings_answered(behind) else None
        candidates, likely, handed = _judged_unless_beaten(analysis, worthy, options, judge)
        if quickest is None:
            quickest = judge(first)
        candidates.insert(0, (quickest, ""))
    except BaseException:
        stop_lowering(handed)
        raise
    finally:
        stop_lowering(behind)
    lowered, why = min(candidates, key=lambda c: (c[0].peak, c[0].decision.recompute_seconds))
    if lowered.decision is not likely:
        stop_lowering(handed)
        handed = []
    note = lowered.decision.note
    if lowered is not quickest:
        why = (
            f"no budget: {why} ({format_bytes(quickest.peak)} -> {format_bytes(lowered.peak)}, "
            f"+{lowered.decision.recompute_seconds * 1e3:.3g} ms recompute)"
        )
        note = "; ".join(filter(None, [why, note]))
    return Choice(lowered, fastest, True, note, time.perf_counter() - started, UNKNOWN, lowering=tuple(handed))


class _Judge:
    """``lower`` of a plan, once per distinct plan (called as ``judge(decision)``), and the seconds spent
    lowering and judging (``Choice.lower_seconds``)."""

    def __init__(self, analysis: Analysis, options: Options) -> None:
        self.analysis, self.options = analysis, options
        self.judged: dict[tuple[tuple[int, ...], int], Lowered] = {}
        self.seconds = 0.0
        self._depth = 0

    def __call__(self, decision: Decision) -> Lowered:
        key = (decision.kept, decision.twice)
        if key not in self.judged:
            with self.timing():
                self.judged[key] = lower(self.analysis, decision, self.options)
        return self.judged[key]

    @contextlib.contextmanager
    def timing(self):
        """Count the block's time as lowering (once where blocks nest)."""
        self._depth += 1
        started = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self.seconds += time.perf_counter() - started


def choose(
    analysis: Analysis,
    options: Options,
    name: str,
    reference: Reference | None = None,
    check: Callable[[Choice], None] | None = None,
) -> Choice:
    """Solve, lower and judge until the programs fit close under the budget; else the least-memory plan.

    Every candidate is judged by ``lower`` (the programs that will run), never by
    the solver's own estimate, and the search is bounded by rounds, not time: the
    same graph and options give the same plan under any load.

    ``check``: called with the choice before what only its report needs is lowered (the
    fastest plan's peak where the search did not judge it, the step with ``.grad``
    allocated); it raises to drop the choice (``compile_scope.veto``).
    """
    started = time.perf_counter()
    problem = analysis.graph.problem
    solve_options = SolveOptions(time_limit=options.time_limit)
    fastest = solve(problem, None, "save_all", solve_options)
    # What the step holds outside this graph (options.reserve) is not the graph's to use.
    budget = None if options.budget is None else max(1, options.budget - options.reserve)
    judge = _Judge(analysis, options)

    def standing_fastest() -> int | None:
        """A judged plan's peak that stands for the fastest plan's: one that recomputes no more than the
        fastest plan is as fast (no budget: the solver's quickest plan, 4 s of the benchmark GPT-2's
        compile without its own dry lowering). None when none was judged."""
        fast = [
            lowered.peak
            for lowered in judge.judged.values()
            if not lowered.decision.twice and lowered.decision.recompute_seconds <= fastest.recompute_seconds
        ]
        return min(fast) if fast else None

    def fastest_peak() -> int:
        """The fastest plan's programs' peak, for the report."""
        standing = standing_fastest()
        return standing if standing is not None else judge(fastest).peak

    memo = remembered()
    # Under either on_infeasible: a refusal remembered is the least plan "min" runs, and the other way round.
    memo_key = None if memo is None else _cache_key(analysis, replace(options, on_infeasible="error"))

    def completed(choice: Choice) -> Choice:
        """``choice`` checked, then with what its report needs judged."""
        try:
            return _completed(choice)
        finally:
            stop_lowering(list(choice.lowering))

    def _completed(choice: Choice) -> Choice:
        choice = _settled(choice, options, name)
        if check is not None:
            check(choice)
        ahead: list[str] = []
        with judge.timing():
            if choice.fastest_peak == UNKNOWN and choice.accumulating == PENDING and standing_fastest() is None:
                # Both need dry lowerings: the fastest plan's programs in a child while this process judges
                # the step with .grad allocated (the benchmark CNN at half its peak: 2-5 s of report-only
                # lowering each time it was planned).
                ahead = _lower_ahead(analysis, [fastest], options, here=False)
            try:
                if choice.accumulating == PENDING:
                    choice = replace(choice, accumulating=accumulating_peaks(analysis, choice.lowered, options))
                if choice.fastest_peak == UNKNOWN:
                    choice = replace(choice, fastest_peak=fastest_peak())
            finally:
                stop_lowering(ahead)
        # ``lower_seconds`` is part of ``solve_seconds``.
        return replace(choice, solve_seconds=time.perf_counter() - started, lower_seconds=judge.seconds)

    if memo is not None and memo_key in memo:
        again = _from_entry(memo[memo_key], analysis, options, name, fastest, started, REMEMBERED)
        if again is not None:
            choice = completed(again)
            if plan_cache.enabled() and choice.lowered.source != "simulation+allowance":
                # The least plan of a refused budget (on_infeasible="min" after the refusal): a later run
                # reads it instead of searching it again.
                plan_cache.store(
                    _cache_key(analysis, options), {**_cache_entry(analysis, choice), "note": memo[memo_key]["note"]}
                )
            return choice
    key = _cache_key(analysis, options) if plan_cache.enabled() else None
    if key is not None:
        cached = _from_cache(key, analysis, options, name, fastest, started)
        if cached is not None:
            return completed(cached)
    choice = _choose(analysis, options, name, reference, started, fastest, budget, judge)
    if not choice.fits and options.on_infeasible == "error":
        if memo is not None and memo_key is not None and choice.lowered.source != "simulation+allowance":
            memo[memo_key] = {**_cache_entry(analysis, choice), "accumulating_unknown": True}
        if key is not None:
            plan_cache.store(key, {"refused": choice.lowered.peak + options.reserve, "why": ""})
        return _settled(choice, options, name)

    def remember(entry: dict) -> None:
        if choice.lowered.source != "simulation+allowance":
            if key is not None:
                plan_cache.store(key, entry)
            if memo is not None and memo_key is not None:
                memo[memo_key] = entry

    unjudged = {**_cache_entry(analysis, choice), "accumulating_unknown": True}
    try:
        choice = completed(replace(choice, accumulating=PENDING))
    except Vetoed:
        remember(unjudged)  # set aside: reused if it runs after all, its report judged then
        raise
    remember(_cache_entry(analysis, choice))
    return choice


def _settled(choice: Choice, options: Options, name: str) -> Choice:
    """``choice``, or, when it does not fit: a ``BudgetError`` (``on_infeasible="error"``) or the
    least-memory plan with a warning, its note saying why."""
    if choice.fits:
        return choice
    assert options.budget is not None
    if options.on_infeasible == "error":
        raise BudgetError(options.budget, choice.lowered.peak + options.reserve, where=name)
    why = _out_of_reach(options, choice.lowered.peak)
    warnings.warn(f"fxremat {name}: {why}", stacklevel=4)
    if why in choice.note:
        return choice
    return replace(choice, note=f"{why}; {choice.note}" if choice.note else why)


# ------------------------------------------------------------ remembered choices


# Sentinel for a peak a refused plan was not judged at (``Choice.fastest_peak``): judged when reused.
UNKNOWN = -1
# Sentinel for ``Choice.accumulating`` not judged yet: judged once the choice is checked (``choose``).
PENDING = (UNKNOWN, UNKNOWN)
REMEMBERED = "planned earlier in this compile"


# ------------------------------------------------------------ the plan cache (plan_cache.py)

FROM_CACHE = "planned in an earlier run (plan cache)"


def _cache_key(analysis: Analysis, options: Options) -> str:
    static = cast(Iterable, analysis.static_lifetime_input_nodes or ())
    return plan_cache.key(
        analysis.joint,
        options,
        num_fwd_outputs=analysis.num_fwd_outputs,
        static_inputs=[getattr(n, "name", str(n)) for n in static],
        scratch=analysis.scratch,
        hardware=get_hardware(options.hardware),
    )


def _cache_entry(analysis: Analysis, choice: Choice) -> dict:
    """What ``_from_cache`` needs to give the same Choice without searching or lowering candidates."""
    lowered, d = choice.lowered, choice.lowered.decision
    return {
        "kept": [analysis.graph.nodes[i].name for i in d.kept],
        "solver": d.solver,
        "twice": d.twice,
        "gap": d.gap,
        "decision_note": d.note,
        "feasible": d.feasible,
        "model_peak": d.peak_bytes,
        "fits": choice.fits,
        "note": choice.note,
        "fastest_peak": choice.fastest_peak,
        "peak": lowered.peak,
        "other_peak": lowered.other_peak,
        "kernels": lowered.kernels,
        "accumulating": list(choice.accumulating) if choice.accumulating else None,
        "source": lowered.source,
    }


def _from_cache(
    key: str, analysis: Analysis, options: Options, name: str, fastest: Decision, started: float
) -> Choice | None:
    """The Choice an earlier run made for this graph and options, or None (no usable entry)."""
    entry = plan_cache.load(key)
    if entry is None:
        return None
    if "refused" in entry:
        assert options.budget is not None
        log.info("fxremat %s: budget refused in an earlier run (plan cache %s)", name, key[:12])
        raise BudgetError(options.budget, int(entry["refused"]), where=name, why=str(entry.get("why", "")))
    choice = _from_entry(entry, analysis, options, name, fastest, started, FROM_CACHE)
    if choice is not None:
        log.info("fxremat %s: %s %s", name, FROM_CACHE, key[:12])
    return choice


def _from_entry(
    entry: dict, analysis: Analysis, options: Options, name: str, fastest: Decision, started: float, how: str
) -> Choice | None:
    """The Choice ``entry`` (``_cache_entry``) describes, noted ``how`` it was found, or None when the
    entry was made for another problem. What a refusal did not judge (the fastest plan, steps with
    ``.grad`` allocated) is ``UNKNOWN`` and ``PENDING``: ``choose`` judges it once the choice is checked."""
    index = {n.name: i for i, n in enumerate(analysis.graph.nodes)}
    try:
        kept = sorted(index[k] for k in entry["kept"])
        d = decision_of(
            analysis.graph.problem, kept, None, str(entry["solver"]), gap=entry["gap"], note=str(entry["decision_note"])
        )
        if d.peak_bytes != entry["model_peak"] or entry["source"] != ("inductor" if analysis.fusion else "simulation"):
            return None  # not the problem this entry was made for
        known = (int(entry["peak"]), int(entry["other_peak"]), int(entry["kernels"]))
        fits, note, fastest_peak = bool(entry["fits"]), str(entry["note"]), int(entry["fastest_peak"])
        accumulating = entry["accumulating"]
        accumulating = (int(accumulating[0]), int(accumulating[1])) if accumulating else None
        d = replace(d, feasible=bool(entry["feasible"]), twice=int(entry.get("twice", 0)))
    except (KeyError, TypeError, ValueError) as e:
        log.info("fxremat %s: ignoring a malformed plan entry (%s; %s)", name, how, e)
        return None
    lowered = lower(analysis, d, options, known)
    if accumulating is None and entry.get("accumulating_unknown"):
        accumulating = PENDING
    note = "; ".join(filter(None, [note, how]))
    return Choice(lowered, fastest, fits, note, time.perf_counter() - started, fastest_peak, accumulating=accumulating)


def _choose(
    analysis: Analysis,
    options: Options,
    name: str,
    reference: Reference | None,
    started: float,
    fastest: Decision,
    budget: int | None,
    judge,
) -> Choice:
    """``choose``'s search, judging candidates with ``judge`` (one lowering per kept set)."""
    problem = analysis.graph.problem
    solve_options = SolveOptions(time_limit=options.time_limit)
    if budget is None:
        return _no_budget(analysis, options, fastest, judge, started, reference)
    # ``auto`` searches with min-cut (its first stage) and runs whole once, at the target the
    # search settled on: its ILP stage cost 1-2 s a solve on a 2-layer transformer, in each round.
    search = "mincut" if options.solver == "auto" else options.solver
    target = budget
    best: Lowered | None = None
    best_target = budget
    least: Lowered | None = None
    tried: set[int] = set()
    fits_at, over_at = 0, None  # the highest target whose plan fit, the lowest whose plan did not
    over: Lowered | None = None  # the candidate that peaked least over the budget
    negligible = NEGLIGIBLE_RECOMPUTE * sum(problem.seconds)
    for _ in range(TIGHTEN_ROUNDS):
        tried.add(target)
        decision = solve(problem, target, search, solve_options)
        if decision.feasible:
            lowered = judge(decision)
        else:
            # Below the solver's least estimate; the least plan's programs may still leave room.
            if least is None:
                least = _least(analysis, search, options, judge, reference)
            lowered = least
        log.debug("fxremat %s: target %d -> programs peak %d (budget %d)", name, target, lowered.peak, budget)
        if lowered.peak <= budget:
            if best is None or _faster(lowered, best):
                best, best_target = lowered, target
            if lowered.peak >= CLOSE_ENOUGH * budget or lowered.decision.recompute_seconds <= negligible:
                break
            fits_at = max(fits_at, target, lowered.decision.peak_bytes)
            # The programs peak lower than the solver's estimate: aim higher.
            step_to = fits_at + budget - lowered.peak
        elif lowered is least:
            break
        else:
            over_at = target if over_at is None else min(over_at, target)
            if over is None or lowered.peak < over.peak:
                over = lowered
            # The programs peak higher than the solver's estimate: aim lower.
            step_to = target - (lowered.peak - budget) - 1
        # Between a target that fit and one that did not, halve the interval.
        target = (fits_at + over_at) // 2 if over_at is not None and fits_at else step_to
        if target <= 0 or target in tried:
            break
    if best is not None:
        if search != options.solver:
            best = _finish(best, solve(problem, best_target, options.solver, solve_options), judge, budget)
        best = _filled(problem, best, over, fastest, judge, budget, negligible)
        return Choice(best, fastest, True, best.decision.note, time.perf_counter() - started, UNKNOWN)
    # The least-memory search is bounded by work, not time: a BudgetError names the same least peak under any load.
    if least is None:
        least = _least(analysis, search, options, judge, reference)
    if search != options.solver:
        least = _named(least, options.solver)
    note = least.decision.note
    assert options.budget is not None
    if least.peak <= budget:
        # The search's candidates all peaked over, but the least plan fits (per-layer checkpointing's
        # programs can peak lower than the search's least, ``_least``): it is the plan.
        return Choice(least, fastest, True, note, time.perf_counter() - started, UNKNOWN)
    # Out of reach: ``choose`` raises or warns; a refusal does not lower the fastest plan for the report.
    return Choice(least, fastest, False, note, time.perf_counter() - started, UNKNOWN)
