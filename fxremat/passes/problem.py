"""Reduce AOTAutograd's joint graph to a plain ``RematProblem``.

Node ids are positions among the joint graph's call_function nodes and tangent
placeholders, in graph (topological) order. Graph inputs other than tangents
are not nodes: they exist before the step whatever the plan.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .._torch_compat import is_sym_node, op_schema
from ..solvers.types import BACKWARD, FORWARD, Decision, RematProblem
from .cost import NodeCost

__all__ = [
    "ProblemGraph",
    "build_problem",
    "assemble",
    "storages",
    "inplace_ids",
    "is_tangent",
    "never_recompute_reason",
    "saved_nodes",
]


@dataclass(frozen=True)
class ProblemGraph:
    """A problem and the fx nodes its ids stand for."""

    problem: RematProblem
    nodes: tuple[fx.Node, ...]

    def ids(self) -> dict[fx.Node, int]:
        return {n: i for i, n in enumerate(self.nodes)}


def is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and "tangents" in str(node.target)


def never_recompute_reason(node: fx.Node) -> str | None:
    """Why a forward node may not run a second time in the backward, or None."""
    target = node.target
    if target is operator.getitem:
        return None
    tags = getattr(target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags and not _randomness_off(node):
        return "random op (its RNG state is not replayed)"
    schema = op_schema(target)
    if schema is not None and schema.is_mutable:
        return "mutates its input"
    if getattr(target, "namespace", None) == "_c10d_functional":
        return "collective"
    if node.op == "call_function" and node.is_impure(impure_random=False):
        return "has side effects"
    if node.meta.get("partitioner_tag") == "must_be_in_forward":
        return "must run in the forward"
    return None


def _randomness_off(node: fx.Node) -> bool:
    """A seeded op called so that it draws nothing: attention with dropout_p=0, dropout with p=0 or train=False."""
    schema = op_schema(node.target)
    if schema is None:
        return False
    values = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    values.update({a.name: v for a, v in zip(schema.arguments, node.args)})
    values.update(node.kwargs)
    if "dropout_p" in values:
        return values["dropout_p"] == 0
    if "train" in values and values["train"] is False:
        return True
    return "p" in values and values["p"] == 0 and "train" in values


def _layers(nodes: list[fx.Node], forward: set[fx.Node]) -> dict[fx.Node, int]:
    """Index of the repeated block each forward node belongs to.

    The repeated block is the module class with at least two instances whose
    instances together contain the most forward nodes (a transformer layer, a
    ResNet stage block); instances are numbered in order of first appearance.
    """
    instances: dict[str, dict[str, int]] = {}  # class -> {path: covered count}
    for node in nodes:
        if node not in forward:
            continue
        for path, cls in (node.meta.get("nn_module_stack") or {}).values():
            cls_name = getattr(cls, "__qualname__", str(cls))
            paths = instances.setdefault(cls_name, {})
            paths[path] = paths.get(path, 0) + 1
    best, best_cover = None, 0
    for cls_name in sorted(instances):
        paths = instances[cls_name]
        cover = sum(paths.values())
        if len(paths) >= 2 and cover > best_cover:
            best, best_cover = cls_name, cover
    if best is None:
        return {}
    order: dict[str, int] = {}
    layer: dict[fx.Node, int] = {}
    for node in nodes:
        if node not in forward:
            continue
        for path, cls in (node.meta.get("nn_module_stack") or {}).values():
            if getattr(cls, "__qualname__", str(cls)) == best:
                layer[node] = order.setdefault(path, len(order))
                break
    return layer


def build_problem(
    joint: fx.GraphModule,
    forward_nodes: set[fx.Node],
    costs: dict[fx.Node, NodeCost],
    num_fwd_outputs: int,
    scratch: dict[fx.Node, int] | None = None,
    fused: set[fx.Node] | None = None,
    outputs_released: bool = False,
    inplace: list[tuple[fx.Node, fx.Node]] | None = None,
) -> ProblemGraph:
    """Build the plain problem for a joint graph.

    Args:
        joint: AOTAutograd's joint graph (after the stock tag passes).
        forward_nodes: nodes the forward must run (PyTorch's ``required_fw_nodes``).
        costs: the cost pass's table for ``joint``.
        num_fwd_outputs: how many of the joint graph's outputs belong to the forward.
        scratch: the scratch pass's table (bytes an op allocates inside itself).
        fused: nodes the inner compiler computes inside their consumers (``passes/fusion.py``).
        outputs_released: the caller drops the forward's outputs before the backward.
        inplace: (writer, buffer) node pairs where the writer may reuse a dying buffer
            (``passes/inplace.py``).

    Returns:
        The problem and the fx node behind each id.
    """
    nodes = [n for n in joint.graph.nodes if n.op == "call_function" or is_tangent(n)]
    ids = {n: i for i, n in enumerate(nodes)}
    output = next(iter(joint.graph.find_nodes(op="output")))
    outs = list(output.args[0])
    fw_outputs = sorted({ids[o] for o in outs[:num_fwd_outputs] if isinstance(o, fx.Node) and o in ids})
    bw_outputs = sorted({ids[o] for o in outs[num_fwd_outputs:] if isinstance(o, fx.Node) and o in ids})
    # A getitem of a forward node is part of the forward even when only the
    # backward reads it (a layer norm's mean and rstd): taking it is free.
    forward_nodes = set(forward_nodes)
    for n in nodes:
        if n.target is operator.getitem and n.args[0] in forward_nodes:
            forward_nodes.add(n)
    layer_of = _layers(nodes, forward_nodes)

    phase = [FORWARD if n in forward_nodes else BACKWARD for n in nodes]
    storage = storages(nodes, ids, costs)
    must_save, never, must_recompute = [], [], []
    never_set: set[int] = set()
    for i, n in enumerate(nodes):
        if phase[i] != FORWARD:
            continue
        policy = n.meta.get("recompute")
        parent = n.args[0] if n.target is operator.getitem else None
        if is_sym_node(n) or policy == CheckpointPolicy.MUST_SAVE:
            # A view is saved through its storage (one saved value per storage: schedule.close).
            must_save.append(storage[i] if phase[storage[i]] == FORWARD else i)
        if (
            is_sym_node(n)
            or never_recompute_reason(n) is not None
            or (parent is not None and ids.get(parent) in never_set)
        ):
            never.append(i)
            never_set.add(i)
        elif policy == CheckpointPolicy.MUST_RECOMPUTE or isinstance(n.meta.get("val"), (tuple, list)):
            # A tuple cannot be saved for the backward; its elements (getitems) can.
            must_recompute.append(i)
    problem = assemble(
        nodes,
        ids,
        costs,
        phase,
        fw_outputs,
        bw_outputs,
        [ids[n] for n in nodes if is_tangent(n)],
        scratch_by_name={n.name: b for n, b in (scratch or {}).items()},
        fused=fused or (),
        outputs_released=outputs_released,
        inplace=inplace or (),
        must_save=tuple(sorted(set(must_save))),
        never_recompute=tuple(never),
        must_recompute=tuple(must_recompute),
        layer=tuple(layer_of.get(n, -1) for n in nodes),
    )
    return ProblemGraph(problem, tuple(nodes))


def storages(nodes: list[fx.Node], ids: dict[fx.Node, int], costs: dict[fx.Node, NodeCost]) -> list[int]:
    """The id of the node owning each node's storage (its own id when it allocates).

    An alias of something that is not a node (a graph input) owns itself with no
    bytes; an alias of an alias lives in the first owner.
    """
    storage = []
    for i, n in enumerate(nodes):
        owner = ids.get(costs[n].owner)
        storage.append(owner if owner is not None and owner <= i else i)
    return [storage[s] for s in storage]


def assemble(
    nodes: list[fx.Node],
    ids: dict[fx.Node, int],
    costs: dict[fx.Node, NodeCost],
    phase: list[int],
    fw_outputs,
    bw_outputs,
    tangents,
    *,
    scratch_by_name: dict[str, int],
    fused,
    outputs_released: bool,
    inplace,
    **tags,
) -> RematProblem:
    """The one ``RematProblem`` builder, for the joint graph and for the programs that run.

    Args:
        nodes: the nodes that become ids, in execution order.
        ids: node -> id; may map more nodes than ``nodes`` (a backward program's
            saved-value placeholders stand for the forward nodes they receive).
        costs: cost records of every node in ``ids``.
        phase: ``FORWARD``/``BACKWARD`` per id.
        fw_outputs, bw_outputs, tangents: ids of the user outputs, returned gradients, gradient inputs.
        scratch_by_name: measured op workspace by node name.
        fused: nodes the inner compiler computes inside their consumers.
        outputs_released: the caller drops the user outputs before the backward.
        inplace: (writer, buffer) node pairs that may reuse a dying buffer.
        **tags: ``must_save``, ``never_recompute``, ``must_recompute``, ``layer``.
    """
    storage = storages(nodes, ids, costs)
    # A value aliasing a graph input (a parameter's view) allocates nothing.
    nbytes = [costs[n].nbytes if costs[n].owner is n else 0 for n in nodes]
    return RematProblem(
        names=tuple(n.name for n in nodes),
        phase=tuple(phase),
        inputs=tuple(
            tuple(sorted({ids[a] for a in n.all_input_nodes if a in ids and ids[a] < i})) for i, n in enumerate(nodes)
        ),
        nbytes=tuple(nbytes),
        storage=tuple(storage),
        seconds=tuple(costs[n].seconds for n in nodes),
        flops=tuple(costs[n].flops for n in nodes),
        fw_outputs=tuple(sorted(fw_outputs)),
        bw_outputs=tuple(sorted(bw_outputs)),
        tangents=tuple(tangents),
        scratch=tuple(scratch_by_name.get(n.name, 0) for n in nodes),
        fused=tuple(sorted(ids[n] for n in fused if n in ids and storage[ids[n]] == ids[n])),
        outputs_released=outputs_released,
        inplace=inplace_ids(inplace, ids, storage, nbytes),
        **tags,
    )


def inplace_ids(pairs, ids: dict, storage, nbytes) -> tuple[tuple[int, int], ...]:
    """In-place node pairs as problem ids: both owning a storage of bytes, the buffer first."""
    out = set()
    for writer, buffer in pairs:
        w, b = ids.get(writer), ids.get(buffer)
        if w is not None and b is not None and b < w and storage[w] == w and storage[b] == b and nbytes[b]:
            out.add((w, b))
    return tuple(sorted(out))


def saved_nodes(pg: ProblemGraph, decision: Decision) -> list[fx.Node]:
    """The fx nodes the forward hands the backward for ``decision``: the kept forward nodes,
    plus the graph inputs the backward reads (they cost nothing: they exist before the step,
    but the backward can only see what the forward hands it)."""
    problem = pg.problem
    readers = [pg.nodes[i] for i in range(problem.size) if problem.phase[i] == BACKWARD]
    readers += [pg.nodes[i] for i in decision.recomputed]
    inputs = {a for n in readers for a in n.all_input_nodes if a.op == "placeholder" and not is_tangent(a)}
    graph_inputs = [n for n in pg.nodes[0].graph.nodes if n in inputs]
    return graph_inputs + [pg.nodes[i] for i in decision.kept]
