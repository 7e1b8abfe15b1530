"""Identical layers: the values that play the same part in each copy of a repeated block.

A transformer's layers are one module class instantiated many times; their parts of
the joint graph are the same subgraph up to names. ``repeated_values`` finds them from
the problem alone (``RematProblem.layer``, set from each node's ``nn_module_stack``):
two layers are identical when their forward nodes, in graph order, have the same
inputs inside the layer, the same bytes, storage, cost, tags and backward readers.
Each class it returns holds one value per identical layer, the first layer's first.

A solver that gives every value of a class the same decision solves one layer and
applies its choice to every copy (``solve_ilp(..., tie_layers=True)``); the layers at the
ends of the stack stay free (``FREE_FIRST``, ``FREE_LAST``). Values read outside their layer (a layer's output, read by the next one) are boundary values:
they are never tied, so the global problem still chooses where the checkpoints
between layers sit.

Example:
    >>> classes = repeated_values(problem)
    >>> len(classes[0])  # one value per tied layer: 12 identical layers, less 3 left free
    9
"""

from __future__ import annotations

from .rules import Rules
from .schedule import bw_reads
from .types import RematProblem

__all__ = ["repeated_values", "MIN_COPIES", "FREE_FIRST", "FREE_LAST"]

# Fewer identical layers than this are not tied: with two, tying halves a search that is
# small anyway, and the whole graph's optimum is within reach.
MIN_COPIES = 3
# Identical layers left free at each end of the stack, each decided on its own. The best plans are
# not uniform there: the last layers' backward runs first, while the rest of the forward's saved
# values are alive, and the first layer's input is the embedding. On the synthetic 8-layer GPT stack
# of tests/test_solvers.py, at three budgets, tying all 8 layers gave plans 3-6% slower than the
# whole graph's ILP; leaving the first layer and the last two free gave the same plans (0.340,
# 1.633 ms) or a faster one than the whole graph's ILP found within its work limit (0.869 vs 0.877
# ms), proven optimal among the tied plans in 0.8-3.9 s against 0.2-7.0 s.
FREE_FIRST, FREE_LAST = 1, 2


def repeated_values(problem: RematProblem, rule: Rules) -> tuple[tuple[int, ...], ...]:
    """Classes of relevant, non-boundary forward values, one value per identical layer.

    Args:
        problem: the joint graph.
        rule: its resolved tags (``rules.rules``): only ``rule.relevant`` values are
            classed, the ones a solver chooses among.

    Returns:
        Tuples of ids, each ``(v in layer a, v in layer b, ...)`` in layer order, for the
        largest group of identical layers less ``FREE_FIRST`` and ``FREE_LAST`` at its ends
        (at least ``MIN_COPIES`` left); empty when the problem has no layers or too few repeat.
    """
    if not problem.layer:
        return ()
    members: dict[int, list[int]] = {}
    for v, layer in enumerate(problem.layer):
        if layer >= 0 and problem.is_forward(v):
            members.setdefault(layer, []).append(v)
    if len(members) < MIN_COPIES:
        return ()
    readers: dict[int, list[int]] = {}
    for v, inputs in enumerate(problem.inputs):
        for u in inputs:
            readers.setdefault(u, []).append(v)
    boundary = set(problem.fw_outputs)
    for v, layer in enumerate(problem.layer):
        if layer >= 0 and any(problem.is_forward(w) and problem.layer[w] != layer for w in readers.get(v, ())):
            boundary.add(v)
    groups: dict[tuple, list[int]] = {}
    for layer in sorted(members):
        groups.setdefault(_signature(problem, rule, members[layer], boundary, readers), []).append(layer)
    same = max(groups.values(), key=lambda layers: (len(layers), -layers[0]))
    same = same[FREE_FIRST : len(same) - FREE_LAST]
    if len(same) < MIN_COPIES:
        return ()
    relevant = set(rule.relevant)
    first = members[same[0]]
    return tuple(
        tuple(members[layer][k] for layer in same) for k, v in enumerate(first) if v in relevant and v not in boundary
    )


def _signature(problem: RematProblem, rule: Rules, nodes: list[int], boundary: set[int], readers) -> tuple:
    """What makes two layers the same subgraph, up to names and position in the graph."""
    index = {v: k for k, v in enumerate(nodes)}
    needed = set(bw_reads(problem))
    fused = set(problem.fused)
    tags = (set(problem.must_save), set(problem.never_recompute), rule.no_keep, rule.no_recompute)

    def at(u: int) -> object:
        # A value of this layer by its position in it; anything else (the previous layer's
        # output, a parameter's use) by its kind only.
        return index.get(u, "forward" if problem.is_forward(u) else "backward")

    return tuple(
        (
            tuple(at(u) for u in problem.inputs[v]),
            problem.nbytes[v],
            at(problem.storage[v]),
            problem.seconds[v],
            problem.flops[v],
            problem.scratch[v] if problem.scratch else 0,
            v in needed,
            v in fused,
            v in boundary,
            tuple(v in tag for tag in tags),
            sum(not problem.is_forward(w) for w in readers.get(v, ())),
        )
        for v in nodes
    )
