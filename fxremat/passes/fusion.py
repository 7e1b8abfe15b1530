"""Which nodes Inductor never materializes: pointwise values inlined into their consumers.

Inductor lowers a pointwise op into a loop body, not a buffer; the body is
inlined into each consumer's kernel unless something forces a buffer. A value
that only generated kernels read therefore never exists in memory, and the
memory model must not count it. This pass marks those values, by Inductor's
own rules (``torch/_inductor/graph.py`` and ``ir.StorageBox``), kept
conservative: when a rule is uncertain the value is counted, because
counting too much only costs memory while counting too little breaks the
budget.

A value is *fused* when:

- its op is tagged ``pointwise`` and allocates its own storage;
- no alias of it is a program output (outputs are always realized);
- every consumer (through views) is a pointwise op or a plain reduction that
  Inductor lowers into a generated kernel (extern kernels such as ``mm``,
  ``addmm``, ``convolution`` and fallbacks such as ``_scaled_dot_product_*``
  need their inputs in memory);
- it has a single consumer, or its inlined body reads at most
  ``REALIZE_READS_THRESHOLD`` buffers and holds no transcendental op
  (Inductor realizes a reused body that reads more, and on CPU one that
  contains ``exp``, ``log``, ``tanh``, ...);
- its inlined body (itself and the fused values it reads) reads at most
  ``REALIZE_ACC_READS_THRESHOLD`` buffers and holds at most
  ``REALIZE_OPCOUNT_THRESHOLD`` ops (Inductor realizes larger bodies).

The solvers see this as ``RematProblem.fused``: a fused value kept for the
backward is materialized by the forward (it is a forward output), otherwise
it costs nothing and its inputs stay alive until its consumers run.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .._torch_compat import inductor_lowering
from .cost import NodeCost, _hint

__all__ = ["fused_nodes", "REALIZE_READS_THRESHOLD", "REALIZE_ACC_READS_THRESHOLD", "REALIZE_OPCOUNT_THRESHOLD"]

# torch._inductor.config.realize_reads_threshold (4 in torch 2.13): a body with
# several users that reads more buffers than this is realized.
REALIZE_READS_THRESHOLD = 4
# torch._inductor.config._realize_acc_reads_threshold_default (8): a body that has
# accumulated more buffer reads than this is realized.
REALIZE_ACC_READS_THRESHOLD = 8
# torch._inductor.config.realize_cpu_opcount_threshold (50; 30 on GPU): larger
# bodies are realized. The GPU value is used: the smaller one is the safe one.
REALIZE_OPCOUNT_THRESHOLD = 30
# Untagged ops whose Inductor lowering is a pointwise loop body (torch/_inductor/lowering.py:
# `full`, `iota`, `scalar_tensor` fill by index; `embedding`, `gather` load by index;
# `slice_scatter`, `select_scatter`, `constant_pad_nd` select by index).
_POINTWISE_BODIES = frozenset({"full", "iota", "scalar_tensor", "embedding", "gather", "slice_scatter", "select_scatter", "constant_pad_nd"})
# Reductions Inductor generates code for (torch/_inductor/lowering.py `make_reduction`
# and `var_mean`); they read pointwise inputs inside their own loops.
_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "var_mean", "var", "prod", "any", "all", "argmax", "argmin"})
# How far back through pointwise producers a reused value's body is searched for them.
HEAVY_DEPTH = 4
# Ops whose presence in a reused body makes Inductor realize it on CPU
# (StorageBox.should_realize_on_reuse's heavy_ops list).
_HEAVY = frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"})


def _is_view(node: fx.Node, costs: dict[fx.Node, NodeCost]) -> bool:
    return node.op == "call_function" and costs[node].owner is not node and costs[node].nbytes == 0


def _is_pointwise(node: fx.Node) -> bool:
    """Tagged pointwise, or an op Inductor lowers to a pointwise loop body (fills, index loads)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in target.tags or _op_name(node) in _POINTWISE_BODIES


def _in_generated_kernel(node: fx.Node) -> bool:
    """Inductor lowers ``node`` into a kernel it generates, so it can inline pointwise inputs.

    Pointwise ops and the plain reductions only: matmuls and convolutions run
    as extern kernels (``addmm`` realizes its inputs inside its lowering, so
    the lowering tables alone do not say so), and other ops (``cat``, index
    ops, fallbacks) are treated as realizing their inputs, the safe answer.
    """
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target in inductor_lowering.fallbacks or target in inductor_lowering.needs_realized_inputs:
        return False
    if target not in inductor_lowering.lowerings:
        return False
    return _is_pointwise(node) or _op_name(node) in _REDUCTIONS


def _op_name(node: fx.Node) -> str:
    target = node.target
    return getattr(getattr(target, "overloadpacket", None), "__name__", str(target))


def fused_nodes(graph: fx.Graph, costs: dict[fx.Node, NodeCost]) -> set[fx.Node]:
    """Values of ``graph`` that Inductor computes inside their consumers' kernels.

    Args:
        graph: a forward, backward or joint graph in AOTAutograd's aten IR.
        costs: the cost pass's table (``owner`` and ``nbytes`` per node).

    Returns:
        The fused nodes. Their consumers, for a joint graph, are consumers in
        either program; a value whose consumers all fuse it in both is fused.
    """
    output = next(iter(graph.find_nodes(op="output")))
    returned = {costs[o].owner if o in costs else o for o in output.all_input_nodes}
    fused: set[fx.Node] = set()
    reads: dict[fx.Node, int] = {}
    ops: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if not _is_pointwise(node) or costs[node].owner is not node or not costs[node].nbytes or node in returned:
            continue
        consumers = _consumers(node, costs)
        if consumers is None or not consumers or not all(_in_generated_kernel(c) for c in consumers):
            continue
        body_reads = sum(reads[a] if a in fused else 1 for a in node.all_input_nodes)
        body_ops = 1 + sum(ops[a] for a in node.all_input_nodes if a in fused)
        body_heavy = _heavy_nearby(node)
        if body_reads > REALIZE_ACC_READS_THRESHOLD or body_ops > REALIZE_OPCOUNT_THRESHOLD:
            continue
        if len(consumers) > 1 and (body_heavy or body_reads > REALIZE_READS_THRESHOLD):
            continue
        if body_heavy and any(_numel(c) > _numel(node) for c in consumers):
            # A transcendental body broadcast into a larger consumer (log of a softmax's
            # sum) is realized rather than recomputed per output element.
            continue
        fused.add(node)
        reads[node], ops[node] = body_reads, body_ops
    return fused


def _numel(node: fx.Node) -> int:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    return _hint(val.numel())


def _heavy_nearby(node: fx.Node) -> bool:
    """A transcendental op in ``node`` or its pointwise producers up to ``HEAVY_DEPTH`` steps back.

    Inductor judges the inlined body, which may include producers this pass
    counts as materialized; looking at all nearby pointwise producers errs on
    the side of realizing.
    """
    frontier, seen = [node], {node}
    for _ in range(HEAVY_DEPTH + 1):
        nxt: list[fx.Node] = []
        for n in frontier:
            if _op_name(n) in _HEAVY:
                return True
            nxt.extend(a for a in n.all_input_nodes if a not in seen and _is_pointwise(a))
        seen.update(nxt)
        frontier = nxt
    return False


def _consumers(node: fx.Node, costs: dict[fx.Node, NodeCost]) -> list[fx.Node] | None:
    """Nodes that read ``node``'s values, looking through views; None if an alias escapes
    (returned, or read by something that is not an op)."""
    out: list[fx.Node] = []
    stack = list(node.users)
    seen: set[fx.Node] = set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.op != "call_function" or user.target is operator.getitem:
            return None
        if _is_view(user, costs):
            stack.extend(user.users)
            continue
        out.append(user)
    return sorted(out, key=lambda n: n.name)

