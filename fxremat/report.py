"""Build the ``Plan`` a user reads from what the planner analysed and chose."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx

from .budget import format_bytes
from .hardware import get_hardware
from .options import Options
from .passes.chunk_loss import ChunkNote, current_notes
from .passes.cost import NodeCost
from .passes.problem import ProblemGraph, is_tangent
from .plan import NodeRecord, Plan, ValueRecord
from .solvers.schedule import bw_reads, close, liveness, programs
from .solvers.types import FORWARD, Decision, RematProblem

if TYPE_CHECKING:
    from .planner import Analysis, Choice

__all__ = ["build_plan"]


def build_plan(
    name: str,
    analysis: Analysis,
    choice: Choice,
    options: Options,
    total_seconds: float,
    released_peak: int = 0,
    accumulating: tuple[int, int] | None = None,
) -> Plan:
    """The Plan for graph ``name``: what is kept and recomputed, the predicted timeline, the anatomy."""
    pg, costs = analysis.graph, analysis.costs
    lowered = choice.lowered
    decision, sim = lowered.decision, lowered.simulation
    recomputed = _records(pg, costs, decision.recomputed)
    return Plan(
        graph=name,
        budget=options.budget,
        predicted_peak=lowered.peak,
        released_peak=released_peak or lowered.peak,
        accumulating_peak=accumulating[0] if accumulating else lowered.peak,
        released_accumulating_peak=accumulating[1] if accumulating else released_peak or lowered.peak,
        saved_bytes=sim.saved_bytes,
        recompute_flops=sum(r.flops for r in recomputed),
        recompute_seconds=decision.recompute_seconds,
        solver=decision.solver,
        solve_seconds=choice.solve_seconds,
        kept=_records(pg, costs, decision.kept),
        recomputed=recomputed,
        fastest_peak=choice.fastest_peak,
        grad_bytes=sim.grad_bytes,
        tangent_bytes=sim.tangent_bytes,
        output_bytes=sim.output_bytes,
        feasible=choice.fits,
        reserved_bytes=options.reserve,
        gap=decision.gap,
        note="; ".join(
            filter(None, [choice.note, _repeats_note(options.repeats, sim.saved_bytes), _grads_note(options)])
        ),
        pass_seconds={
            **analysis.seconds,
            "solve": choice.solve_seconds,
            "lower": choice.lower_seconds,
            "total": total_seconds,
        },
        num_nodes=pg.problem.size,
        timeline=tuple(
            (sim.names[v], "forward" if phase == FORWARD else "backward", live) for v, phase, live in sim.timeline.steps
        ),
        forward_code=lowered.forward.code,
        backward_code=lowered.backward.code,
        nodes=_node_records(pg, costs, decision),
        references=_references(pg.problem),
        input_bytes=sum(
            costs[n].nbytes for n in analysis.joint.graph.find_nodes(op="placeholder") if not is_tangent(n)
        ),
        largest=_largest(pg, costs),
        again=lowered.again,
        chunked=tuple(_chunk_line(note, analysis, lowered.peak, options) for note in current_notes()),
        problem=pg.problem,
    )


def _chunk_line(note: ChunkNote, analysis: Analysis, peak: int, options: Options) -> str:
    """``lm_head + cross_entropy: 16 chunks of 64 tokens, peak -1.9 GiB, +4% time (est.)``."""
    step = sum(c.seconds for c in analysis.costs.values())
    extra = note.extra_flops / get_hardware(options.hardware).peak_flops
    share = f", +{100 * extra / step:.1f}% time (est.)" if step > 0 and note.extra_flops else ""
    saved = "" if note.unchunked_peak is None else f", peak {format_bytes(peak - note.unchunked_peak)} vs unchunked"
    return (
        f"{note.site}: {note.chunks} chunks of {-(-note.tokens // note.chunks)} tokens x {note.vocab} classes"
        f" (whole fp32 logits {format_bytes(note.logits_bytes)}){saved}{share}"
    )


def _grads_note(options: Options) -> str:
    if options.grads_allocated is not True or not options.hand_over_grads:
        return ""
    return "planned for steps whose parameters' .grad exist (each gradient added in and freed as it is made)"


def _repeats_note(repeats: int, saved_bytes: int) -> str:
    if repeats <= 1:
        return ""
    return (
        f"runs {repeats} times in a step: the predicted peak counts the {repeats - 1} earlier calls' "
        f"saved activations ({format_bytes((repeats - 1) * saved_bytes)})"
    )


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
        c = costs[pg.nodes[i]]
        s = problem.storage[i]
        nbytes = 0
        if s not in charged and (s == i or s not in owners_listed):
            nbytes = problem.nbytes[s]
            charged.add(s)
        out.append(ValueRecord(pg.nodes[i].name, c.op, c.module, nbytes, c.flops, c.seconds))
    return tuple(out)


def _node_records(pg: ProblemGraph, costs: dict[fx.Node, NodeCost], decision: Decision) -> tuple[NodeRecord, ...]:
    kept, recomputed = set(decision.kept), set(decision.recomputed)
    problem = pg.problem
    out = []
    for i, node in enumerate(pg.nodes):
        role = (
            "kept"
            if i in kept
            else "recomputed"
            if i in recomputed
            else "forward"
            if problem.is_forward(i)
            else "backward"
        )
        c = costs[node]
        out.append(
            NodeRecord(
                node.name, c.op, c.module, role, problem.nbytes[i], tuple(problem.names[u] for u in problem.inputs[i])
            )
        )
    return tuple(out)


def _largest(pg: ProblemGraph, costs: dict[fx.Node, NodeCost]) -> tuple[str, str, int]:
    problem = pg.problem
    if not problem.size:
        return ("", "", 0)
    tangents = set(problem.tangents)
    i = max((v for v in range(problem.size) if v not in tangents), key=lambda v: (problem.nbytes[v], -v), default=0)
    return (pg.nodes[i].name, costs[pg.nodes[i]].module, problem.nbytes[i])


def _references(problem: RematProblem) -> dict[str, tuple[tuple[str, int], ...]]:
    """Predicted timelines of the extremes: keep everything, keep only graph inputs."""
    refs = {}
    for name, kept in (("save_all", bw_reads(problem)), ("save_inputs", ())):
        kept_c, recomputed = close(problem, kept)
        forward, backward = programs(problem, kept_c, recomputed)
        steps = liveness(problem, forward, backward, kept_c).steps
        refs[name] = tuple(("forward" if phase == FORWARD else "backward", live) for _, phase, live in steps)
    return refs
