"""A gradient summed with an embedding's gradient: accumulated into it instead.

An embedding's backward (``embedding_dense_backward``, decomposed) makes a zero
tensor of the weight's size and accumulates the rows' gradients into a copy of it
(``_unsafe_masked_index_put_accumulate``, or ``index_put`` with ``accumulate=True``).
Where the weight is used elsewhere too (an LM head tied to the embedding: GPT-2,
Gemma, T5), the backward then adds the two gradients. At that moment three tensors
of the weight's size are alive: the other gradient, the zeros and the accumulated
copy (a GPT-2 with 131,072 classes and hidden 256: 3 x 128 MiB at the backward's
peak).

``fold_sums_into_index_put`` rewrites ``add(g, index_put_acc(zeros, ...))`` into
``index_put_acc(g, ...)``: the same sum, accumulated into a copy of ``g``, so at most
two tensors of that size are alive, and no zeros. The rows are added to ``g``
instead of to zeros first, so the sum may round differently in its last bit.

Inductor's decompositions split ``embedding_dense_backward`` into the zeros and the
index-put. The eager inner compiler keeps the op whole (its output is the third
tensor); ``add(g, embedding_dense_backward(rows, ids, ...))`` becomes the same
accumulating index-put into ``g`` (the rows and ids flattened, the padding index's
rows masked out), unless it scales by frequency.
"""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["fold_sums_into_index_put"]

aten = torch.ops.aten

# Accumulating index-puts, by the position of the tensor they accumulate into (always first).
ACCUMULATING = (aten._unsafe_masked_index_put_accumulate.default, aten.index_put.default)


def _accumulates(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in ACCUMULATING:
        return False
    if node.target is aten.index_put.default:
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        return accumulate is True
    return True


def _zeros(node: object) -> bool:
    """A ``full`` of zeros (what the embedding's backward accumulates into), used once."""
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target in (aten.full.default, aten.zeros.default)
        and (node.target is aten.zeros.default or bool(node.args[1] == 0))
        and len(node.users) == 1
    )


def _same_layout(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return False
    if not all(isinstance(d, int) for v in (va, vb) for d in (*v.shape, *v.stride())):
        return False  # symbolic sizes (dynamic shapes): comparing them would guard on them
    return va.shape == vb.shape and va.dtype == vb.dtype and va.stride() == vb.stride() and va.device == vb.device


def _dense_backward(node: object) -> bool:
    """An un-decomposed ``embedding_dense_backward`` without scaling by frequency."""
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target is aten.embedding_dense_backward.default
        and len(node.args) == 5
        and node.args[4] is False
        and isinstance(node.args[3], int)
    )


def _node(graph: fx.Graph, target, args: tuple) -> fx.Node:
    """A new node, its value computed on the fake values of its inputs (they dispatch to their own mode)."""

    def value(arg):
        if isinstance(arg, list):
            return [value(a) for a in arg]
        return arg.meta["val"] if isinstance(arg, fx.Node) else arg

    values = tuple(value(arg) for arg in args)
    node = graph.call_function(target, args)
    node.meta["val"] = target(*values)
    return node


def _accumulated(graph: fx.Graph, other: fx.Node, dense: fx.Node) -> fx.Node:
    """``embedding_dense_backward`` added to ``other``, as an accumulating index-put into ``other``."""
    rows, ids, _, padding, _ = dense.args
    assert isinstance(rows, fx.Node) and isinstance(ids, fx.Node) and isinstance(padding, int)
    hidden = other.meta["val"].shape[-1]
    flat_ids = _node(graph, aten.reshape.default, (ids, [-1]))
    flat_rows = _node(graph, aten.reshape.default, (rows, [-1, hidden]))
    if padding < 0:
        return _node(graph, aten.index_put.default, (other, [flat_ids], flat_rows, True))
    kept = _node(graph, aten.ne.Scalar, (flat_ids, padding))
    mask = _node(graph, aten.unsqueeze.default, (kept, -1))
    return _node(graph, aten._unsafe_masked_index_put_accumulate.default, (other, mask, [flat_ids], flat_rows))


def _into(graph: fx.Graph, other: fx.Node, put: fx.Node) -> fx.Node:
    """``put`` (an accumulating index-put into zeros) accumulating into ``other`` instead."""
    target = put.target
    assert callable(target)
    into = graph.call_function(target, (other, *put.args[1:]), dict(put.kwargs))
    into.meta["val"] = other.meta["val"]  # the same shape, dtype and layout (``_same_layout``)
    return into


def fold_sums_into_index_put(gm: fx.GraphModule) -> int:
    """Rewrite ``add(g, index_put_acc(zeros, ...))`` (either order) into ``index_put_acc(g, ...)`` in ``gm``;
    the number rewritten. Only where the index-put and its zeros have no other user, and ``g``, the
    index-put and the sum have one shape, dtype, layout and device (no broadcast, no promotion)."""
    graph = gm.graph
    folded = 0
    for add in list(graph.nodes):
        if add.op != "call_function" or add.target is not aten.add.Tensor or add.kwargs or len(add.args) != 2:
            continue
        for put, other in ((add.args[1], add.args[0]), (add.args[0], add.args[1])):
            if not (isinstance(put, fx.Node) and isinstance(other, fx.Node)) or len(put.users) != 1:
                continue
            dense = _dense_backward(put)
            zeros = put.args[0] if _accumulates(put) else None
            if not dense and not _zeros(zeros):
                continue
            if not (_same_layout(other, add) and _same_layout(put, add)):
                continue
            with graph.inserting_before(add):
                into = _accumulated(graph, other, put) if dense else _into(graph, other, put)
            into.meta = {**put.meta, "val": into.meta["val"]}
            add.replace_all_uses_with(into)
            for dead in (add, put, zeros):
                if isinstance(dead, fx.Node):
                    graph.erase_node(dead)
            folded += 1
            break
    if folded:
        graph.lint()
        gm.recompile()
    return folded
