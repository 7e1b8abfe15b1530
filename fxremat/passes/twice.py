"""Recompute values a second time in the backward where that lowers its peak (nested checkpoints).

``solvers/twice.py`` chooses the splits on the programs as a plain problem;
this pass makes the same edits on a copy of the backward GraphModule: each
split's copies are inserted before the split's first reader and every node
from there on reads them. A copy is named ``<value>_again`` and its metadata
is the value's; the forward is unchanged.
"""

from __future__ import annotations

import copy
import operator

import torch.fx as fx

from .._torch_compat import is_op_overload
from ..solvers.twice import TWICE_MAX_SPLITS, split_lifetimes
from .problem import is_tangent, never_recompute_reason
from .simulate import program_problem

__all__ = ["recompute_twice", "COPY_OF"]

# ``node.meta`` key of a copy: the name of the backward node it computes again.
COPY_OF = "fxremat_copy_of"


def _may_run_again(bw: fx.GraphModule) -> set[fx.Node]:
    """Backward nodes that may run a second time: ops that read no tangent (recomputed forward
    values and what is made from inputs alone), deterministic, mutating nothing."""
    from_tangents: set[fx.Node] = set()
    out = set()
    for n in bw.graph.nodes:
        if is_tangent(n) or any(a in from_tangents for a in n.all_input_nodes):
            from_tangents.add(n)
            continue
        if n.op != "call_function" or not (is_op_overload(n.target) or n.target is operator.getitem):
            continue
        if never_recompute_reason(n) is None:
            out.add(n)
    return out


def recompute_twice(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    num_fwd_outputs: int,
    scratch_by_name: dict[str, int] | None = None,
    *,
    fusion: bool = False,
    outputs_released: bool = False,
    max_splits: int = TWICE_MAX_SPLITS,
) -> tuple[fx.GraphModule, dict[str, str]]:
    """``bw`` with values recomputed again after the backward's peak where that lowers it.

    Args:
        fw, bw, num_fwd_outputs, scratch_by_name, fusion, outputs_released: as ``simulate``'s.
        max_splits: the most splits to take (``Decision.twice``: as many as the solver planned).

    Returns:
        (the backward, {copy's name: the name of the node it computes again}); ``bw`` itself
        and an empty dict when no split lowers the replayed peak.
    """
    programs = program_problem(
        fw, bw, num_fwd_outputs, scratch_by_name, fusion=fusion, outputs_released=outputs_released
    )
    movable = _may_run_again(bw)
    again = [i for i, n in enumerate(programs.nodes) if i >= programs.offset and n in movable]
    _, splits, _ = split_lifetimes(programs.problem, programs.offset, programs.kept, again, max_splits)
    if not splits:
        return bw, {}
    out = fx.GraphModule(bw, copy.deepcopy(bw.graph))
    # The copied graph's nodes in the problem's id order (forward ids stay the forward's nodes).
    twin = {n.name: n for n in out.graph.nodes}
    nodes = [twin.get(n.name, n) if i >= programs.offset else n for i, n in enumerate(programs.nodes)]
    made: dict[str, str] = {}
    for split in splits:
        before = nodes[split.at]
        copy_of: dict[fx.Node, fx.Node] = {}
        copies = []
        with out.graph.inserting_before(before):
            for i in split.copies:
                node = nodes[i]
                args = fx.map_arg(node.args, lambda a: copy_of.get(a, a))
                kwargs = fx.map_arg(node.kwargs, lambda a: copy_of.get(a, a))
                twin_node = out.graph.create_node(node.op, node.target, args, kwargs, name=f"{node.name}_again")
                twin_node.meta = dict(node.meta)
                original = node.meta.get(COPY_OF, node.name)
                twin_node.meta[COPY_OF] = original
                made[twin_node.name] = original
                copy_of[node] = twin_node
                copies.append(twin_node)
        for reader in nodes[split.at :]:
            for a in list(reader.all_input_nodes):
                if a in copy_of:
                    reader.replace_input_with(a, copy_of[a])
        nodes = nodes[: split.at] + copies + nodes[split.at :]
    out.graph.lint()
    out.recompile()
    return out, made
