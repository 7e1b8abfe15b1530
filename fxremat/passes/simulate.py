"""Liveness of the exact forward and backward programs that will run.

The two GraphModules from ``passes/apply.py`` are re-expressed as a small
``RematProblem`` (forward nodes, then tangents and backward nodes; the
backward's saved-value inputs resolve by name to the forward nodes that
produced them) and replayed by the same ``solvers.schedule.liveness`` the
solvers use, in the programs' own node order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ..solvers.schedule import Timeline, liveness
from ..solvers.types import BACKWARD, FORWARD, RematProblem
from ..hardware import Hardware
from .cost import annotate
from .fusion import fused_nodes
from .inplace import inplace_pairs
from .problem import inplace_ids, is_tangent

__all__ = ["Simulation", "simulate"]


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


def simulate(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    num_fwd_outputs: int,
    hardware: Hardware,
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
        hardware: cost profile (only bytes matter here).
        scratch_by_name: scratch bytes per node name (nodes keep their joint-graph names).
        fusion: model Inductor's fusion (``passes/fusion.py``): pointwise values
            inlined into their consumers allocate nothing, and kernels that
            write into a dying input allocate nothing (``passes/inplace.py``).
        outputs_released: the caller drops the user outputs before the backward.

    Returns:
        The predicted peak and timeline.
    """
    fw_costs = annotate(fw, hardware)
    bw_costs = annotate(bw, hardware)
    fw_nodes = [n for n in fw.graph.nodes if n.op == "call_function"]
    bw_nodes = [n for n in bw.graph.nodes if n.op == "call_function" or is_tangent(n)]
    ids: dict[fx.Node, int] = {n: i for i, n in enumerate(fw_nodes)}
    by_name = {n.name: i for n, i in ids.items()}
    offset = len(fw_nodes)
    ids.update({n: offset + i for i, n in enumerate(bw_nodes)})
    for ph in bw.graph.find_nodes(op="placeholder"):
        if not is_tangent(ph) and ph.name in by_name:
            ids[ph] = by_name[ph.name]

    names: list[str] = []
    phase: list[int] = []
    inputs: list[tuple[int, ...]] = []
    nbytes: list[int] = []
    storage: list[int] = []
    for nodes, costs, ph_value in ((fw_nodes, fw_costs, FORWARD), (bw_nodes, bw_costs, BACKWARD)):
        for n in nodes:
            i = len(names)
            names.append(n.name)
            phase.append(ph_value)
            inputs.append(tuple(sorted({ids[a] for a in n.all_input_nodes if a in ids and ids[a] < i})))
            owner = costs[n].owner
            storage.append(ids[owner] if owner in ids and ids[owner] <= i else i)
            nbytes.append(costs[n].nbytes if owner is n else 0)
    # A backward view of a saved view lives in the saved view's owner.
    storage = [storage[s] for s in storage]

    fw_out = list(next(iter(fw.graph.find_nodes(op="output"))).args[0])
    bw_out = list(next(iter(bw.graph.find_nodes(op="output"))).args[0])
    user_outputs = tuple(sorted({ids[o] for o in fw_out[:num_fwd_outputs] if isinstance(o, fx.Node) and o in ids}))
    kept = tuple(sorted({ids[o] for o in fw_out[num_fwd_outputs:] if isinstance(o, fx.Node) and o in ids}))
    grads = tuple(sorted({ids[o] for o in bw_out if isinstance(o, fx.Node) and o in ids}))
    tangents = tuple(ids[n] for n in bw_nodes if is_tangent(n))
    n = len(names)
    fused: set[fx.Node] = set()
    pairs: list[tuple[fx.Node, fx.Node]] = []
    if fusion:
        fw_fused, bw_fused = fused_nodes(fw.graph, fw_costs), fused_nodes(bw.graph, bw_costs)
        fused = fw_fused | bw_fused
        saved = {p for p in bw.graph.find_nodes(op="placeholder") if not is_tangent(p)}
        pairs = inplace_pairs(fw.graph, fw_costs, fw_fused) + inplace_pairs(bw.graph, bw_costs, bw_fused, saved=saved)
    scratch_by_name = scratch_by_name or {}
    problem = RematProblem(
        names=tuple(names), phase=tuple(phase), inputs=tuple(inputs), nbytes=tuple(nbytes),
        storage=tuple(storage), seconds=(0.0,) * n, flops=(0,) * n,
        fw_outputs=user_outputs, bw_outputs=grads, tangents=tangents,
        scratch=tuple(scratch_by_name.get(name, 0) for name in names),
        fused=tuple(sorted(ids[f] for f in fused if f in ids and storage[ids[f]] == ids[f])),
        outputs_released=outputs_released,
        inplace=inplace_ids(pairs, ids, storage, nbytes),
    )
    timeline = liveness(problem, tuple(range(offset)), tuple(range(offset, n)), kept)

    def total(id_list) -> int:
        return sum(nbytes[s] for s in {storage[i] for i in id_list})

    return Simulation(
        peak=timeline.peak,
        timeline=timeline,
        names=tuple(names),
        saved_bytes=total(kept),
        tangent_bytes=total(tangents),
        grad_bytes=total(grads),
        output_bytes=total(user_outputs),
    )
