"""Liveness of the exact forward and backward programs that will run.

The two GraphModules from ``passes/apply.py`` are re-expressed as a
``RematProblem`` by the same builder as the joint graph (``problem.assemble``:
forward nodes, then tangents and backward nodes; the backward's saved-value
inputs resolve by name to the forward nodes that produced them) and replayed
by the same ``solvers.schedule.liveness`` the solvers use, in the programs'
own node order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..solvers.schedule import Timeline, liveness
from ..solvers.types import BACKWARD, FORWARD, RematProblem
from .cost import annotate
from .fusion import fused_nodes
from .inplace import inplace_pairs
from .problem import assemble, is_tangent

__all__ = ["Simulation", "Programs", "program_problem", "simulate", "seed_gradient_bytes"]


@dataclass(frozen=True)
class Simulation:
    """Predicted memory of a step.

    Attributes:
        peak: predicted peak bytes above the pre-step baseline.
        timeline: live bytes after each node of the forward then the backward.
        names: node name per id of ``timeline``'s steps.
        saved_bytes: bytes of the storages saved for the backward.
        tangent_bytes: bytes of the gradient inputs of the backward.
        grad_bytes: bytes of the gradients the backward returns.
        output_bytes: bytes of the forward's user-visible outputs.
    """

    peak: int
    timeline: Timeline
    names: tuple[str, ...]
    saved_bytes: int
    tangent_bytes: int
    grad_bytes: int
    output_bytes: int


def seed_gradient_bytes(bw: fx.GraphModule) -> int:
    """Bytes of a scalar loss's seed gradient, alive through the backward beside its tangent.

    Measured: a step whose loss is a scalar peaks one scalar above the replay of its
    programs, under both inner compilers (docs/ACCURACY.md, every row, before this
    was counted); ``loss.backward()`` allocates the seed and the engine holds it
    while the backward runs on the tangent AOTAutograd passes.
    """
    total = 0
    for ph in bw.graph.find_nodes(op="placeholder"):
        val = ph.meta.get("val")
        if is_tangent(ph) and isinstance(val, torch.Tensor) and val.dim() == 0:
            total += val.element_size()
    return total


@dataclass(frozen=True)
class Programs:
    """The forward and backward programs as one ``RematProblem``, ids in execution order.

    Attributes:
        problem: forward ids ``range(offset)``, then tangents and backward ids.
        kept: forward ids the forward hands the backward.
        offset: the number of forward ids.
        nodes: the fx node of each id (forward nodes, then the backward's).
    """

    problem: RematProblem
    kept: tuple[int, ...]
    offset: int
    nodes: tuple[fx.Node, ...]


def program_problem(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    num_fwd_outputs: int,
    scratch_by_name: dict[str, int] | None = None,
    *,
    fusion: bool = False,
    outputs_released: bool = False,
) -> Programs:
    """``fw`` then ``bw`` as one problem whose ids are in execution order (``simulate``'s arguments)."""
    fw_costs, bw_costs = annotate(fw, None), annotate(bw, None)  # bytes only
    fw_nodes = [n for n in fw.graph.nodes if n.op == "call_function"]
    bw_nodes = [n for n in bw.graph.nodes if n.op == "call_function" or is_tangent(n)]
    ids: dict[fx.Node, int] = {n: i for i, n in enumerate(fw_nodes)}
    by_name = {n.name: i for n, i in ids.items()}
    offset = len(fw_nodes)
    ids.update({n: offset + i for i, n in enumerate(bw_nodes)})
    # The backward's saved-value inputs are the forward nodes that produced them.
    for ph in bw.graph.find_nodes(op="placeholder"):
        if not is_tangent(ph) and ph.name in by_name:
            ids[ph] = by_name[ph.name]
    costs = {**fw_costs, **bw_costs}

    fused: set[fx.Node] = set()
    pairs: list[tuple[fx.Node, fx.Node]] = []
    if fusion:
        fw_fused, bw_fused = fused_nodes(fw.graph, fw_costs), fused_nodes(bw.graph, bw_costs)
        fused = fw_fused | bw_fused
        saved = {p for p in bw.graph.find_nodes(op="placeholder") if not is_tangent(p)}
        pairs = inplace_pairs(fw.graph, fw_costs, fw_fused) + inplace_pairs(bw.graph, bw_costs, bw_fused, saved=saved)

    def id_set(values) -> list[int]:
        return sorted({ids[o] for o in values if isinstance(o, fx.Node) and o in ids})

    fw_out = list(next(iter(fw.graph.find_nodes(op="output"))).args[0])
    bw_out = list(next(iter(bw.graph.find_nodes(op="output"))).args[0])
    kept = tuple(id_set(fw_out[num_fwd_outputs:]))
    problem = assemble(
        fw_nodes + bw_nodes,
        ids,
        costs,
        [FORWARD] * offset + [BACKWARD] * len(bw_nodes),
        id_set(fw_out[:num_fwd_outputs]),
        id_set(bw_out),
        [ids[n] for n in bw_nodes if is_tangent(n)],
        scratch_by_name=scratch_by_name or {},
        fused=fused,
        outputs_released=outputs_released,
        inplace=pairs,
    )
    return Programs(problem, kept, offset, tuple(fw_nodes + bw_nodes))


def simulate(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    num_fwd_outputs: int,
    scratch_by_name: dict[str, int] | None = None,
    *,
    fusion: bool = False,
    outputs_released: bool = False,
) -> Simulation:
    """Replay ``fw`` then ``bw`` and predict the step's live memory.

    Args:
        fw: the forward program; its outputs are the user outputs then the saved values.
        bw: the backward program; its placeholders are saved values (same names
            as the forward nodes) and tangents.
        num_fwd_outputs: how many forward outputs the user sees.
        scratch_by_name: scratch bytes per node name (nodes keep their joint-graph names).
        fusion: model Inductor's fusion (``passes/fusion.py``): pointwise values
            inlined into their consumers allocate nothing, and kernels that
            write into a dying input allocate nothing (``passes/inplace.py``).
        outputs_released: the caller drops the user outputs before the backward.

    Returns:
        The predicted peak and timeline.
    """
    programs = program_problem(
        fw, bw, num_fwd_outputs, scratch_by_name, fusion=fusion, outputs_released=outputs_released
    )
    problem, kept, offset = programs.problem, programs.kept, programs.offset
    timeline = liveness(problem, tuple(range(offset)), tuple(range(offset, problem.size)), kept)

    def total(id_list) -> int:
        return sum(problem.nbytes[s] for s in {problem.storage[i] for i in id_list})

    seed = seed_gradient_bytes(bw)
    backward_peak = max((live for _, phase, live in timeline.steps if phase == BACKWARD), default=0)
    return Simulation(
        peak=max(timeline.peak, backward_peak + seed),
        timeline=timeline,
        names=problem.names,
        saved_bytes=total(kept),
        tangent_bytes=total(problem.tangents),
        grad_bytes=total(problem.bw_outputs),
        output_bytes=total(problem.fw_outputs),
    )
