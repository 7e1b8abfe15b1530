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
  ``REALIZE_READS_THRESHOLD`` distinct buffers and holds no transcendental
  op (Inductor realizes a reused body that reads more, and on CPU one that
  contains ``exp``, ``log``, ``tanh``, ...). The body is the value and the
  fused values it reads; for transcendental ops it also takes in producers
  this pass counts as realized without a structural reason (Inductor may
  inline them), which errs towards realizing;
- its inlined body (itself and the fused values it reads) reads at most
  ``REALIZE_ACC_READS_THRESHOLD`` buffers and holds at most
  ``REALIZE_OPCOUNT_THRESHOLD`` ops (Inductor realizes larger bodies).

Inductor's post-grad pattern ``add(mm(a, b), c) -> addmm(c, a, b)``
(``torch/_inductor/fx_passes/post_grad.py``) is applied too: such an ``mm``
never exists on its own (it is counted as fused: ``a`` and ``b`` stay alive
until the ``add`` runs), and the ``add`` becomes an extern kernel.

The solvers see this as ``RematProblem.fused``: a fused value kept for the
backward is materialized by the forward (it is a forward output), otherwise
it costs nothing and its inputs stay alive until its consumers run.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .._torch_compat import inductor_lowering
from .cost import NodeCost
from .opinfo import is_op_call, is_tagged_pointwise, is_view, numel_hint, packet_name

__all__ = [
    "fused_nodes",
    "absorbed_mm",
    "is_pointwise",
    "in_generated_kernel",
    "POINTWISE_BODIES",
    "REALIZE_READS_THRESHOLD",
    "REALIZE_ACC_READS_THRESHOLD",
    "REALIZE_OPCOUNT_THRESHOLD",
]

# Inductor's config.realize_reads_threshold (torch/_inductor/config.py; 4 in torch 2.13): a body with
# several users that reads more buffers than this is realized.
REALIZE_READS_THRESHOLD = 4
# Inductor's config._realize_acc_reads_threshold_default (torch/_inductor/config.py; 8): a body that has
# accumulated more buffer reads than this is realized.
REALIZE_ACC_READS_THRESHOLD = 8
# Inductor's config.realize_cpu_opcount_threshold (torch/_inductor/config.py; 50; 30 on GPU): larger
# bodies are realized. The GPU value is used: the smaller one is the safe one.
REALIZE_OPCOUNT_THRESHOLD = 30
# Untagged ops whose Inductor lowering is a pointwise loop body (torch/_inductor/lowering.py:
# `full`, `iota`, `scalar_tensor` fill by index; `embedding`, `gather` load by index;
# `slice_scatter`, `select_scatter`, `constant_pad_nd` select by index).
POINTWISE_BODIES = frozenset(
    {"full", "iota", "scalar_tensor", "embedding", "gather", "slice_scatter", "select_scatter", "constant_pad_nd"}
)
# Reductions Inductor generates code for (torch/_inductor/lowering.py `make_reduction`
# and `var_mean`); they read pointwise inputs inside their own loops.
_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "var_mean", "var", "prod", "any", "all", "argmax", "argmin"})
# Ops whose presence in a reused body makes Inductor realize it on CPU
# (StorageBox.should_realize_on_reuse's heavy_ops list).
_HEAVY = frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"})


def is_pointwise(node: fx.Node) -> bool:
    """An op Inductor lowers to a pointwise loop body: tagged pointwise, or in ``POINTWISE_BODIES``
    (fills and index loads)."""
    return is_tagged_pointwise(node) or (is_op_call(node) and packet_name(node) in POINTWISE_BODIES)


def absorbed_mm(node: fx.Node) -> fx.Node | None:
    """The ``mm`` that Inductor folds into ``node`` when ``node`` becomes an ``addmm``, else None.

    Mirrors the CPU condition of Inductor's ``addmm`` pattern (post_grad.py):
    ``aten.add.Tensor`` (no ``alpha``) of an ``mm`` with no other user and a
    tensor of the same dtype that broadcasts to the product's shape.
    """
    if node.op != "call_function" or node.target is not torch.ops.aten.add.Tensor:
        return None
    if node.kwargs or len(node.args) != 2:
        return None
    for mm, other in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        if not (isinstance(mm, fx.Node) and mm.op == "call_function" and mm.target is torch.ops.aten.mm.default):
            continue
        if len(mm.users) != 1 or not isinstance(other, fx.Node):
            continue
        vals = [n.meta.get("val") if isinstance(n, fx.Node) else None for n in (other, *mm.args)]
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        if len(tensors) != 3 or len({v.dtype for v in tensors}) != 1:
            continue
        inp, a, b = tensors
        if _expandable(tuple(inp.shape), (a.shape[0], b.shape[1])):
            return mm
    return None


def _expandable(shape: tuple, target: tuple) -> bool:
    if len(shape) > len(target):
        return False
    for have, want in zip(reversed(shape), reversed(target)):
        if not (have == want or have == 1):
            return False
    return True


def in_generated_kernel(node: fx.Node) -> bool:
    """Inductor lowers ``node`` into a kernel it generates, so it can inline pointwise inputs.

    Pointwise ops and the plain reductions only: matmuls and convolutions run
    as extern kernels (``addmm`` realizes its inputs inside its lowering, so
    the lowering tables alone do not say so), and other ops (``cat``, index
    ops, fallbacks) are treated as realizing their inputs, the safe answer.
    """
    target = node.target
    if not is_op_call(node) or absorbed_mm(node) is not None:
        return False
    if target in inductor_lowering.fallbacks or target in inductor_lowering.needs_realized_inputs:
        return False
    if target not in inductor_lowering.lowerings:
        return False
    return is_pointwise(node) or packet_name(node) in _REDUCTIONS


def fused_nodes(graph: fx.Graph, costs: dict[fx.Node, NodeCost], forward: set[fx.Node] | None = None) -> set[fx.Node]:
    """Values of ``graph`` that Inductor computes inside their consumers' kernels.

    Args:
        graph: a forward, backward or joint graph in AOTAutograd's aten IR.
        costs: the cost pass's table (``owner`` and ``nbytes`` per node).
        forward: for a joint graph, its forward nodes. A backward body then
            counts each forward value it reads as a buffer read: in the
            backward program that value is a saved input (a constant the
            forward fills, for one, reads nothing in the joint graph but is a
            buffer in the backward that Inductor compiles).

    Returns:
        The fused nodes. Their consumers, for a joint graph, are consumers in
        either program; a value whose consumers all fuse it in both is fused.
    """
    output = next(iter(graph.find_nodes(op="output")))
    returned = {costs[o].owner if o in costs else o for o in output.all_input_nodes}
    # An mm folded into an addmm: never materialized; its inputs live until the add.
    fused: set[fx.Node] = {mm for n in graph.nodes if (mm := absorbed_mm(n)) is not None and mm not in returned}
    # Per fused value, the buffers its inlined body reads (Inductor counts distinct reads;
    # views of fused values and index bodies such as ``iota`` read nothing) and its op count.
    reads: dict[fx.Node, frozenset[fx.Node]] = {}
    ops: dict[fx.Node, int] = {}
    # A transcendental op in the body Inductor may inline: through fused values and through
    # values this pass counts as realized without knowing that Inductor does (``sure`` stops it).
    heavy: dict[fx.Node, bool] = {}
    sure: set[fx.Node] = set()
    for node in graph.nodes:
        if not is_pointwise(node) or costs[node].owner is not node or not costs[node].nbytes or node in returned:
            continue
        bases = [_base(a, costs) for a in node.all_input_nodes]
        heavy[node] = packet_name(node) in _HEAVY or any(heavy.get(b, False) and b not in sure for b in bases)
        if absorbed_mm(node) is not None:
            sure.add(node)
            continue
        consumers = _consumers(node, costs)
        if consumers is None or not consumers or not all(in_generated_kernel(c) for c in consumers):
            sure.add(node)
            continue
        # Forward values a backward node reads are saved inputs of the backward program.
        inlined = [b for b in bases if b in fused and (forward is None or node in forward or b not in forward)]
        body = frozenset().union(*(reads.get(b, frozenset()) if b in inlined else {b} for b in bases))
        body_ops = 1 + sum(ops.get(b, 1) for b in set(inlined))
        if len(body) > REALIZE_ACC_READS_THRESHOLD or body_ops > REALIZE_OPCOUNT_THRESHOLD:
            continue
        if len(consumers) > 1 and (heavy[node] or len(body) > REALIZE_READS_THRESHOLD):
            continue
        if heavy[node] and any(numel_hint(c) > numel_hint(node) for c in consumers):
            # A transcendental body broadcast into a larger consumer (log of a softmax's
            # sum) is realized rather than recomputed per output element.
            continue
        fused.add(node)
        reads[node], ops[node] = body, body_ops
    return fused


def _base(node: fx.Node, costs: dict[fx.Node, NodeCost]) -> fx.Node:
    """The value a view reads (its storage owner); the node itself otherwise."""
    return costs[node].owner if is_view(node, costs) else node


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
        if is_view(user, costs):
            stack.extend(user.users)
            continue
        out.append(user)
    return sorted(out, key=lambda n: n.name)
