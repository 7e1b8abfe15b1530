"""Chunk the LM head and its cross-entropy: the vocabulary-sized tensors exist a chunk of tokens at a time.

Recomputation cannot shrink a language model's loss: the logits (tokens x vocabulary),
their fp32 copy, the log-softmax saved for the backward and the logits' gradient are
each one vocabulary-sized tensor. This pass finds, in Dynamo's graph (before
AOTAutograd), a ``cross_entropy`` whose input is the output of a ``linear`` (the LM
head) reached through row-wise ops only (``float``/``to``, ``view``/``reshape`` that keep
the vocabulary dimension, ``contiguous``, slices of the token dimensions), and replaces
the loss by ``chunked_cross_entropy``: an autograd function that walks the tokens in
chunks in its forward, keeping one log-sum-exp per token, and walks the vocabulary in its
backward: each slice of classes has its logits made again for all tokens, turned into
their gradient at once, and multiplied out into that slice of the weight's gradient (made
once, never accumulated) and into the hidden states' gradient (tokens x hidden, summed).
AOTAutograd traces it like any other code, so the joint graph the planner sees holds the
chunks, unrolled, and the memory model prices them as usual.

When the logits are also a graph output (``model(...).logits``) the function makes them
whole in its forward (they are returned) and reads the loss's chunks from them; its
backward makes each slice again from the hidden states, so nothing vocabulary-sized is
saved for it.
A cross-entropy whose input is a graph input (the loss compiled apart from the head,
after a graph break) is chunked over its rows the same way, without a head to recompute.

``torch.nn.functional.linear_cross_entropy``'s chunked path is not used: it computes
the gradients inside its forward and writes them in place in its backward, which
``torch.compile`` cannot trace (it falls back to eager at that op).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .._torch_compat import DYNAMO_LINEAR
from .opinfo import size_hint

__all__ = [
    "LossSite",
    "ChunkNote",
    "find_loss_sites",
    "chunk_losses",
    "chunked_cross_entropy",
    "chunk_count",
    "noting",
    "current_notes",
    "reattach_head_grads",
    "is_head_gradient",
    "HEAD_GRADS",
]

log = logging.getLogger(__name__)

# The most chunks "auto" cuts a loss into: the loss region's vocabulary-sized tensors become 1/16
# of their size, the figure issue 16 asks of the loss region (8x smaller at least) with room
# for the chunk's own temporaries. Each chunk is its own code in the compiled graph: the first
# step of the LM head and loss of a 128k vocabulary on 512 tokens took 26 s in 8 chunks, 47 s in
# 16 and 84 s in 32 (cold kernel cache), for 33, 17 and 9 MiB of vocabulary-sized tensors.
AUTO_CHUNKS = 16
# Fewer token rows than this per chunk and the LM head's matmuls run below their speed
# (measured on this machine's CPU, the head and loss of a 128k vocabulary on 512 tokens: a step
# in 16 chunks of 32 rows took 2.18 s, in 8 of 64 2.30 s, unchunked 2.25 s).
MIN_ROWS_PER_CHUNK = 32
# Under a budget "auto" cuts the fewest chunks (doubling from 2, at most AUTO_CHUNKS) whose one
# vocabulary-sized fp32 chunk is at most this share of the budget: a loose budget gets few chunks
# (less code to compile, fewer passes over the head's weight), a tight one all it can.
CHUNK_SHARE = 1 / 16
# Returned logits smaller than this (fp32 bytes) keep their gradient path through the graph: the
# zero gradient the backward then takes for them is as small, while the path outside the graph
# costs every step 50-100 us of Python (``_HeadGradient``, one more output, its own zero gradient).
# The zoo's tiny ViT (10 classes, 80 bytes of logits), alternating with plain torch.compile in one
# process: 1.046x its step with the path outside, 0.996x without; the zoo's GPT-2 (256,000 bytes)
# peaked 1.05 MiB with it and 1.28 MiB without, for 1.006x against 0.985x.
DETACH_MIN_BYTES = 64 << 10

_LINEAR = {DYNAMO_LINEAR}  # F.linear is the same object
_CROSS_ENTROPY = {F.cross_entropy}
_CE_SIGNATURE = inspect.signature(F.cross_entropy)
# Methods and functions that act on each token row alone (keep the last dimension).
_CASTS = {"float", "to", "contiguous", "type_as"}
_RESHAPES = {"view", "reshape"}


@dataclass(frozen=True)
class LossSite:
    """One cross-entropy the pass can chunk.

    Attributes:
        loss: the ``cross_entropy`` node.
        head: the LM head's ``linear`` node, or None when the loss's input is a graph input.
        hidden: the head's input (the hidden states) or, without a head, the logits input.
        weight: the head's weight node (None without a head).
        bias: the head's bias node, if any.
        tokens: rows of the loss's input (tokens across the batch), at its size hint when symbolic (a
            graph Dynamo compiles for any length: the chunk count is chosen at the hint, and the chunks
            shrink with the length, ``chunked_cross_entropy``).
        vocab: the vocabulary size (the loss's classes).
        logits_escape: the head's output has users other than the loss (a graph output).
        logits_to_output_only: those other users are the graph's output alone (no op in the
            graph reads the logits): the logits can leave the compiled graph without a gradient
            path through it (``reattach_head_grads``).
    """

    loss: fx.Node
    head: fx.Node | None
    hidden: fx.Node
    weight: fx.Node | None
    bias: fx.Node | None
    tokens: int
    vocab: int
    logits_escape: bool
    logits_to_output_only: bool = False

    def logits_bytes(self) -> int:
        """Bytes of the loss's input in fp32: the size of each vocabulary-sized tensor it makes."""
        return self.tokens * self.vocab * 4


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _shape(node) -> torch.Size:
    """The shape of a node ``_val`` has checked."""
    val = _val(node)
    assert val is not None
    return val.shape


def _row_wise(node: fx.Node, vocab) -> fx.Node | None:
    """The input of ``node`` when ``node`` acts on each last-dimension row alone (rows of ``vocab``), else None."""
    val = _val(node)
    if val is None or val.dim() < 1 or not _same(val.shape[-1], vocab):
        return None
    if node.op == "call_method" and node.target in _CASTS | _RESHAPES:
        source = node.args[0]
        if isinstance(source, fx.Node) and _val(source) is not None and _same(_shape(source)[-1], vocab):
            if node.target == "to" and any(isinstance(a, torch.device) for a in node.args[1:]):
                return None
            return source
        return None
    if node.op == "call_function" and node.target is operator.getitem:
        source, index = node.args
        if not isinstance(source, fx.Node) or _val(source) is None:
            return None
        index = index if isinstance(index, tuple) else (index,)
        # Slices of leading (token) dimensions only; a site whose rows then differ from the
        # head's input rows is not chunked (find_loss_sites checks the counts).
        if not all(i is Ellipsis or (isinstance(i, slice) and i.step in (None, 1)) for i in index):
            return None
        whole_last = index[-1] == slice(None) or (Ellipsis not in index and len(index) < len(_shape(source)))
        return source if whole_last else None
    return None


def find_loss_sites(gm: fx.GraphModule) -> list[LossSite]:
    """The cross-entropies of ``gm`` whose vocabulary-sized input the pass can chunk.

    Args:
        gm: a graph Dynamo captured (torch-level calls, ``example_value`` metadata).

    Returns:
        One ``LossSite`` per chunkable cross-entropy, in graph order.
    """
    sites = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _CROSS_ENTROPY:
            continue
        site = _site(node)
        if site is not None:
            sites.append(site)
    return sites


def _loss_args(loss: fx.Node) -> dict | None:
    """``loss``'s arguments by name, defaults filled in (``nn.CrossEntropyLoss`` passes them all by
    position, HF's ``ForCausalLMLoss`` by keyword), or None when they do not bind."""
    try:
        bound = _CE_SIGNATURE.bind(*loss.args, **loss.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _site(loss: fx.Node) -> LossSite | None:
    args = _loss_args(loss)
    if args is None:
        return None
    logits, target = args["input"], args["target"]
    if not isinstance(logits, fx.Node):
        return None
    val, labels = _val(logits), _val(target)
    if val is None or labels is None or val.dim() != 2 or labels.dim() != 1 or labels.dtype != torch.int64:
        return None  # class probabilities, K-dimensional losses: not chunked
    if args["weight"] is not None or args["size_average"] is not None or args["reduce"] is not None:
        return None  # class weights change the normaliser, legacy reductions; not chunked
    if args["reduction"] not in ("mean", "sum") or not isinstance(args["ignore_index"], int):
        return None
    if not isinstance(args["label_smoothing"], (int, float)):
        return None
    # Sizes read without guarding on them: a guard would fix a dynamic graph to this one length.
    tokens, vocab = size_hint(val.shape[0]), size_hint(val.shape[1])
    node = logits
    while True:
        if node.op == "placeholder":
            return LossSite(loss, None, logits, None, None, tokens, vocab, logits_escape=False)
        if node.op == "call_function" and node.target in _LINEAR:
            hidden, weight = node.args[0], node.args[1]
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            wval = _val(weight)
            if not isinstance(hidden, fx.Node) or not isinstance(weight, fx.Node) or _val(hidden) is None:
                return None
            if bias is not None and not isinstance(bias, fx.Node):
                return None
            if wval is None or wval.dim() != 2 or not _same(wval.shape[0], val.shape[1]):
                return None
            if not _same(_rows(_shape(hidden)), val.shape[0]):
                return None  # a slice between head and loss: the rows no longer line up
            outside = _outside_readers(node, loss)
            # Only the graph's output reads the head itself: the logits can leave without a gradient path.
            only_output = bool(outside) and all(n is node and user.op == "output" for n, user in outside)
            return LossSite(loss, node, hidden, weight, bias, tokens, vocab, bool(outside), only_output)
        source = _row_wise(node, val.shape[1])
        if source is None:
            return None
        node = source


def _rows(shape: torch.Size):
    """The product of every size but the last, kept symbolic (``Size.numel`` would guard on each size)."""
    rows = 1
    for size in shape[:-1]:
        rows = rows * size
    return rows


def _same(a, b) -> bool:
    """Whether two sizes are known equal, asked without a guard (a guard on a symbolic size fixes it)."""
    if not isinstance(a, torch.SymInt) and not isinstance(b, torch.SymInt):
        return a == b
    return statically_known_true(a == b)


def _outside_readers(head: fx.Node, loss: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """(node, reader) for each read of the head's output, or of a row-wise view of it, outside the chain into ``loss``."""
    vocab = _shape(head)[-1]
    stack, seen, outside = [head], set(), []
    while stack:
        node = stack.pop()
        for user in node.users:
            if user is loss or user in seen:
                continue
            seen.add(user)
            if _row_wise(user, vocab) is node:
                stack.append(user)
            else:
                outside.append((node, user))
    return outside


def chunk_count(site: LossSite, chunks: int | None = None, budget: int | None = None) -> int:
    """How many chunks ``site`` is cut into.

    Args:
        site: the loss.
        chunks: this many (at most one per token), if given.
        budget: else, under this budget, the fewest chunks, doubling from 2, whose one fp32
            chunk of logits is at most ``CHUNK_SHARE`` of it; with no budget, the most.
            Never more than ``AUTO_CHUNKS``, nor below ``MIN_ROWS_PER_CHUNK`` tokens a chunk.

    Example:
        >>> chunk_count(site)  # 512 tokens x 128k classes: 16 (32 tokens each)
        >>> chunk_count(site, budget=4 << 30)  # 256 MiB of fp32 logits: 2 chunks of 128 MiB, each <= 4 GiB / 16
    """
    if chunks is not None:
        return max(1, min(chunks, site.tokens))
    most = max(1, min(AUTO_CHUNKS, site.tokens // MIN_ROWS_PER_CHUNK))
    if budget is None:
        return most
    n = 2
    while n < most and site.logits_bytes() > CHUNK_SHARE * budget * n:
        n *= 2
    return min(n, most)


def chunk_losses(gm: fx.GraphModule, chunks: dict[fx.Node, int]) -> int:
    """Rewrite each site's loss in place to ``chunked_cross_entropy``; let returned logits leave without a gradient path.

    A site with 2 chunks or more is chunked. Every site whose logits are also returned (and read by
    nothing else in the graph) returns them without a gradient path through the graph, chunked or
    not (unchunked: logits of ``DETACH_MIN_BYTES`` at least): the graph returns the head's input as
    one more output and ``reattach_head_grads`` gives the logits the head's own backward outside
    it, so the backward takes no logits-sized gradient of zeros (what autograd hands a graph for an
    output nobody differentiated).

    Args:
        gm: Dynamo's graph; changed in place and recompiled.
        chunks: each site's loss node to its number of chunks (>= 2 to chunk it; absent: 1).

    Returns:
        How many losses were chunked.
    """
    done = 0
    changed = False
    for site in find_loss_sites(gm):
        n = chunks.get(site.loss, 1)
        if n >= 2:
            _rewrite(gm, site, n)
            done += 1
            changed = True
        elif _detachable(gm, site):
            assert site.head is not None
            with gm.graph.inserting_after(site.head):
                detached = gm.graph.call_method("detach", (site.head,))
            _leave_without_grad(gm, site, site.head, detached, _unsliced(site.hidden))
            changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return done


def _unsliced(node: fx.Node) -> fx.Node:
    """``node`` or, where it is a slice that keeps every element (HF's ``hidden[:, slice(-0, None), :]``), the
    tensor sliced: a graph output that is a view of another value is made again at every call (an
    ``aten._unsafe_view`` in AOTAutograd's runtime wrapper, 20 us), its base is returned as it is."""
    while node.op == "call_function" and node.target is operator.getitem:
        source, index = node.args
        if not isinstance(source, fx.Node):
            break
        index = index if isinstance(index, tuple) else (index,)
        if not all(
            isinstance(i, slice) and i.step in (None, 1) and i.start in (None, 0) and i.stop is None for i in index
        ):
            break
        if [str(d) for d in _shape(source)] != [str(d) for d in _shape(node)]:
            break  # compared as written: comparing symbolic sizes would guard on them
        node = source
    return node


def _detachable(gm: fx.GraphModule, site: LossSite) -> bool:
    """Whether ``site``'s logits can leave the graph without a gradient path (``chunk_losses``), and are
    large enough for it to pay (``DETACH_MIN_BYTES``)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    return (
        site.logits_to_output_only
        and site.logits_bytes() >= DETACH_MIN_BYTES
        and site.weight in placeholders
        and (site.bias is None or site.bias in placeholders)
    )


def _leave_without_grad(gm: fx.GraphModule, site: LossSite, returned: fx.Node, detached: fx.Node, hidden: fx.Node):
    """The graph returns ``detached`` where it returned ``returned``, and ``hidden`` last; noted in its meta."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    output = next(iter(gm.graph.find_nodes(op="output")))
    outs = output.args[0]
    assert isinstance(outs, (tuple, list))
    positions = tuple(i for i, a in enumerate(outs) if a is returned)
    output.args = (type(outs)([detached if a is returned else a for a in outs] + [hidden]),)
    weight = placeholders.index(site.weight)
    bias = placeholders.index(site.bias) if site.bias is not None else None
    gm.meta.setdefault(HEAD_GRADS, []).append(HeadGrad(positions, weight, bias))


def _rewrite(gm: fx.GraphModule, site: LossSite, n: int) -> None:
    graph = gm.graph
    loss = site.loss
    args = _loss_args(loss)
    assert args is not None  # a site's loss binds (_site)
    chain, target = args["input"], args["target"]
    loss_val = _val(loss)
    assert isinstance(chain, fx.Node) and loss_val is not None
    head = site.head
    # Logits that only leave the graph leave it without a gradient path through it (chunk_losses).
    detach = _detachable(gm, site)
    with graph.inserting_before(loss):
        if head is None:
            hidden: fx.Node = chain
        else:
            hidden = graph.call_function(_token_rows, (site.hidden,))
        new = graph.call_function(
            chunked_cross_entropy,
            (hidden, site.weight, site.bias, target),
            {
                "chunks": n,
                "ignore_index": args["ignore_index"],
                "reduction": args["reduction"],
                "label_smoothing": float(args["label_smoothing"]),
                "dtype": loss_val.dtype,
                "return_logits": site.logits_escape,
                "logits_grad": not detach,
            },
        )
        out = new
        if site.logits_escape:
            out = graph.call_function(operator.getitem, (new, 0))
            logits = graph.call_function(operator.getitem, (new, 1))
            logits = graph.call_function(_shaped_as_head, (logits, site.hidden))
    out.meta = dict(loss.meta)
    loss.replace_all_uses_with(out)
    graph.erase_node(loss)
    # The row-wise chain from the head to the loss, now unread.
    node: fx.Node | None = chain if head is not None else None
    while node is not None and node is not head and not node.users:
        source = node.args[0]
        graph.erase_node(node)
        node = source if isinstance(source, fx.Node) else None
    if head is not None:
        # The function makes the logits the head's other users read (a graph output), in the same
        # pass that makes the loss: the head's own matmul goes.
        if head.users:
            head.replace_all_uses_with(logits)
            # Readers of the logits that stay (OPT's `logits = lm_head(h).contiguous()`, returned
            # and read by the loss) come before the function, which sits where the loss was.
            _move_readers_after(graph, logits)
        graph.erase_node(head)
    if detach:
        _leave_without_grad(gm, site, logits, logits, _unsliced(site.hidden))


def _token_rows(hidden: torch.Tensor) -> torch.Tensor:
    """The head's input as ``(tokens, hidden)`` rows; its sizes as the graph has them (symbolic ones stay so)."""
    return hidden.reshape(-1, hidden.shape[-1])


def _shaped_as_head(logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``(tokens, vocab)`` logits in the head's output shape: ``hidden``'s, the last size the vocabulary."""
    return logits.view(*hidden.shape[:-1], logits.shape[-1])


def _move_readers_after(graph: fx.Graph, node: fx.Node) -> None:
    """Move the nodes placed before ``node`` that read it (directly or through each other) to just
    after it, in their order: the graph stays topologically ordered."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    early, stack, seen = [], list(node.users), set()
    while stack:
        reader = stack.pop()
        if reader in seen or reader.op == "output" or order[reader] > order[node]:
            continue
        seen.add(reader)
        early.append(reader)
        stack.extend(reader.users)
    where = node
    for reader in sorted(early, key=order.__getitem__):
        where.append(reader)
        where = reader


HEAD_GRADS = "fxremat_head_grads"
"""Key in a chunked Dynamo graph's meta: a ``HeadGrad`` per head whose logits leave the graph without a
gradient path; the graph returns each head's input as one more output, last, in this order."""


@dataclass(frozen=True)
class HeadGrad:
    """Where a head's logits leave the graph, and where its weight and bias come in."""

    outputs: tuple[int, ...]
    weight: int
    bias: int | None


def reattach_head_grads(compiled, heads: list[HeadGrad]):
    """Wrap a compiled chunked graph: each head's logits get their gradient path back, outside the graph.

    The graph returns the logits without one (no vocabulary-sized zero gradient for them in
    its backward) and each head's input as an extra output; ``_HeadGradient`` gives the
    logits the head's own backward: ``model(x).logits`` differentiates as before.
    """

    def run(*args):
        outs = list(compiled(*args))
        hidden = outs[len(outs) - len(heads) :]
        del outs[len(outs) - len(heads) :]
        for head, h in zip(heads, hidden):
            bias = args[head.bias] if head.bias is not None else None
            for i in head.outputs:
                outs[i] = _HeadGradient.apply(outs[i], h, args[head.weight], bias)
        return outs

    return run


def is_head_gradient(node) -> bool:
    """Whether an autograd node is ``reattach_head_grads``'s (its life is the logits', not the graph's)."""
    return isinstance(node, _HeadGradient._backward_cls)


class _HeadGradient(torch.autograd.Function):
    """Identity on the logits whose backward is the head's: ``linear(hidden, weight, bias)``."""

    @staticmethod
    def forward(ctx, logits, hidden, weight, bias):
        ctx.save_for_backward(hidden, weight)
        ctx.has_bias = bias is not None
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        g = grad.reshape(-1, weight.shape[0]).to(weight.dtype)
        grad_hidden = (g @ weight).view(hidden.shape) if ctx.needs_input_grad[1] else None
        grad_weight = g.t() @ hidden.reshape(-1, hidden.shape[-1]) if ctx.needs_input_grad[2] else None
        grad_bias = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return None, grad_hidden, grad_weight, grad_bias


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    chunks: int = AUTO_CHUNKS,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    dtype: torch.dtype = torch.float32,
    return_logits: bool = False,
    logits_grad: bool = True,
):
    """``cross_entropy(linear(hidden, weight, bias).to(dtype), target)`` a chunk of rows at a time.

    Args:
        hidden: ``(tokens, hidden)`` inputs of the head, or ``(tokens, vocab)`` logits when
            ``weight`` is None.
        weight: the head's ``(vocab, hidden)`` weight, or None.
        bias: the head's bias, or None.
        target: ``(tokens,)`` class indices; ``ignore_index`` rows count for nothing.
        chunks: how many chunks of rows.
        ignore_index, reduction, label_smoothing: as in ``torch.nn.functional.cross_entropy``
            (reduction "mean" or "sum").
        dtype: the dtype the loss is computed in (the dtype of cross-entropy's input).
        return_logits: also return the head's whole output (the model returns it); the
            backward adds its gradient a chunk at a time and still saves nothing of it.
        logits_grad: with ``return_logits``, whether the logits are differentiable here (False: they
            are marked non-differentiable; ``reattach_head_grads`` gives them a gradient path).

    Returns:
        The loss, a scalar of ``dtype``; with ``return_logits``, (loss, logits).

    Example:
        >>> loss = chunked_cross_entropy(h.reshape(-1, 256), lm_head.weight, None, labels.reshape(-1), chunks=8)
    """
    return _ChunkedCrossEntropy.apply(
        hidden,
        weight,
        bias,
        target,
        chunks,
        ignore_index,
        reduction,
        label_smoothing,
        dtype,
        return_logits,
        logits_grad,
    )


def _bounds(rows, chunks: int) -> list:
    """(start, end) of each chunk of ``rows``: ``ceil(rows / chunks)`` rows each, the last the rest.

    Symbolic rows (a graph compiled for any length): exactly ``chunks`` chunks, their bounds
    clipped to the rows with ``sym_min`` rather than compared with them (a comparison would
    guard the length to one value); a chunk past the rows is empty.
    """
    if isinstance(rows, torch.SymInt):
        size = _chunk_rows(rows, chunks)
        return [(torch.sym_min(i * size, rows), torch.sym_min((i + 1) * size, rows)) for i in range(chunks)]
    size = _chunk_rows(rows, chunks)
    return [(start, min(start + size, rows)) for start in range(0, rows, size)]


def _chunk_rows(rows, chunks: int):
    """Rows of the largest chunk, ``ceil(rows / chunks)``; symbolic rows keep it symbolic."""
    return (rows + chunks - 1) // chunks


def _rows_of(t: torch.Tensor, start, end, pad_to=None) -> torch.Tensor:
    """Rows ``start:end`` of ``t``; with ``pad_to``, padded with zeros (False) to that many rows.

    Under symbolic sizes each chunk is padded to the largest chunk's rows: every tensor the loss
    allocates is then as large as the length's largest chunk, and grows with the length
    (``passes/sizes.py`` caps a graph's sizes only where every tensor does; a clipped chunk's
    own rows do not: the last chunk can be shorter at a longer length). The padded rows are
    counted as ignored.
    """
    rows = t[start:end]
    if pad_to is None:
        return rows
    return F.pad(rows, (0, 0) * (t.dim() - 1) + (0, pad_to - (end - start)))


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, bias, target, chunks, ignore_index, reduction, smoothing, dtype, return_logits, logits_grad
    ):
        rows = hidden.shape[0]
        vocab = weight.shape[0] if weight is not None else hidden.shape[1]
        valid = target != ignore_index
        safe = torch.where(valid, target, 0)
        logits = F.linear(hidden, weight, bias) if return_logits else None
        # Symbolic rows: every chunk padded to the largest one's rows (_rows_of).
        pad_to = _chunk_rows(rows, chunks) if isinstance(rows, torch.SymInt) else None
        total = None
        lses = []
        bounds = _bounds(rows, chunks)
        pieces = _row_pieces(safe, valid, bounds) if pad_to is None else None
        for k, (start, end) in enumerate(bounds):
            z = _chunk_logits(hidden, weight, bias, logits, start, end, pad_to).float()
            lse = torch.logsumexp(z, dim=-1)
            if pieces is None:
                target, keep = _rows_of(safe, start, end, pad_to), _rows_of(valid, start, end, pad_to)
            else:
                target, keep = pieces(k)
            picked = z.gather(1, target.unsqueeze(1)).squeeze(1)
            row_loss = lse - picked
            if smoothing:
                row_loss = (1.0 - smoothing) * row_loss + smoothing * (lse - z.mean(dim=-1))
            part = torch.where(keep, row_loss, 0.0).sum()
            total = part if total is None else total + part
            lses.append(lse)
        assert total is not None
        lse_all = torch.cat(lses)
        if pad_to is not None:
            lse_all = lse_all[:rows]
        count = valid.sum()
        loss = total / count if reduction == "mean" else total
        ctx.save_for_backward(hidden, weight, bias, safe, valid, lse_all, count)
        ctx.config = (chunks, reduction, smoothing, vocab)
        ctx.set_materialize_grads(False)
        if return_logits and not logits_grad:
            ctx.mark_non_differentiable(logits)
        return (loss.to(dtype), logits) if return_logits else loss.to(dtype)

    @staticmethod
    def backward(ctx, grad_loss, grad_logits=None):
        hidden, weight, bias, safe, valid, lse_all, count = ctx.saved_tensors
        chunks, reduction, smoothing, vocab = ctx.config
        if grad_loss is None:
            grad_loss = torch.zeros((), dtype=lse_all.dtype, device=lse_all.device)
        scale = grad_loss.float() / count if reduction == "mean" else grad_loss.float()
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        row_scale = torch.where(valid, scale, 0.0).unsqueeze(1)
        if weight is None and isinstance(hidden.shape[0], torch.SymInt):
            # The logits' gradient a slice of the vocabulary at a time: chunks of rows would be clipped
            # to the length (_rows_of), a slice of classes is as long as the rows.
            columns = []
            for start, end in _bounds(vocab, chunks):
                g = _logits_grad(hidden[:, start:end], lse_all, safe, row_scale, start, smoothing, vocab)
                if grad_logits is not None:
                    g = g + grad_logits[:, start:end]
                columns.append(g.to(hidden.dtype))
            return torch.cat(columns, dim=1), None, None, *(None,) * 8
        if weight is None:
            # The loss's input is the logits: its gradient is the output, made a chunk of rows at a time.
            rows = []
            for start, end in _bounds(hidden.shape[0], chunks):
                g = _logits_grad(
                    hidden[start:end], lse_all[start:end], safe[start:end], row_scale[start:end], 0, smoothing, vocab
                )
                if grad_logits is not None:
                    g = g + grad_logits[start:end]
                rows.append(g.to(hidden.dtype))
            return torch.cat(rows), None, None, *(None,) * 8
        # With a head, the backward walks the vocabulary: each slice of the weight's gradient is made once
        # (nothing vocabulary x hidden is accumulated), the hidden states' gradient (tokens x hidden) is.
        grad_hidden, weight_parts, bias_parts = None, [], []
        slices = _bounds(vocab, chunks)
        shifted = _shifted_targets(safe, slices)
        for k, (start, end) in enumerate(slices):
            z = F.linear(hidden, weight[start:end], bias[start:end] if bias is not None else None)
            if shifted is None:
                g = _logits_grad(z, lse_all, safe, row_scale, start, smoothing, vocab)
            else:
                g = _logits_grad(z, lse_all, shifted(k), row_scale, 0, smoothing, vocab)
            if grad_logits is not None:
                g = g + grad_logits[:, start:end]
            g = g.to(z.dtype)
            if need_hidden:
                part = g @ weight[start:end]
                grad_hidden = part if grad_hidden is None else grad_hidden + part
            if need_weight:
                weight_parts.append(g.t() @ hidden)
            if need_bias and bias is not None:
                bias_parts.append(g.sum(0))
        grad_weight = torch.cat(weight_parts) if weight_parts else None
        grad_bias = torch.cat(bias_parts) if bias_parts else None
        return grad_hidden, grad_weight, grad_bias, *(None,) * 8


def _logits_grad(z, lse, safe, row_scale, first_class, smoothing, vocab):
    """d loss / d z for logits ``z`` of classes ``first_class:first_class + z.shape[1]``, in fp32.

    ``softmax(z) - (1 - smoothing) * onehot(target) - smoothing / vocab``, times each row's scale
    (0 for ignored rows). ``safe``: each row's class (int64), or its class less ``first_class`` as
    float64 (``_shifted_targets``, with ``first_class`` 0).
    """
    g = torch.exp(z.float() - lse.unsqueeze(1))
    if smoothing:
        g = g - smoothing / vocab
    classes = torch.arange(first_class, first_class + z.shape[1], device=z.device, dtype=safe.dtype)
    hit = (safe.unsqueeze(1) == classes.unsqueeze(0)).to(g.dtype)
    return (g - (1.0 - smoothing) * hit) * row_scale


def _shifted_targets(safe: torch.Tensor, slices: list):
    """Each slice of the vocabulary's targets less its first class, for ``_logits_grad``: a function of
    the slice's index, or None (one slice, symbolic slices, or a device without float64).

    Inductor writes the offset of a view, and a constant such as a slice's first class, into the code
    of each kernel that reads it: a one-hot against ``arange(start, end)`` generates and compiles a
    kernel per slice, the same loop each time (16 C++ compiles of 1.6-2 s each on a 2-core host for
    the benchmark BERT's least plan). Here each slice's shifted targets come out of an extern matmul
    (a row of the identity times the targets shifted for every slice, made once), a buffer of its
    own: every slice of one width then runs the same kernel, compiled once.
    """
    n = len(slices)
    first, last = slices[0], slices[-1]
    if n < 2 or not all(isinstance(b, int) for b in (*first, *last)) or safe.device.type == "mps":
        return None
    # float64: exact for any class index, and no float32 matmul mode (TF32, bf16) applies to it.
    starts = torch.arange(n, device=safe.device, dtype=torch.float64) * (first[1] - first[0])
    shifted = safe.to(torch.float64).unsqueeze(0) - starts.unsqueeze(1)  # (slices, rows); slice k: class - start
    return _picker(shifted, n)


def _row_pieces(safe: torch.Tensor, valid: torch.Tensor, chunks: list):
    """Each chunk of rows' (targets, valid mask), as ``_shifted_targets`` makes a slice's targets: out of an
    extern matmul, so the forward's chunks of one size share a kernel; None where the chunks are not all
    of one static size (or the device has no float64)."""
    n = len(chunks)
    rows = chunks[0][1] - chunks[0][0] if n and isinstance(chunks[0][1], int) else None
    if n < 2 or rows is None or chunks[-1][1] != n * rows or safe.device.type == "mps":
        return None
    both = torch.cat([safe.to(torch.float64).view(n, rows), valid.to(torch.float64).view(n, rows)], dim=1)
    pick = _picker(both, n)

    def piece(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = pick(k)
        return row[:rows].to(safe.dtype), row[rows:] != 0

    return piece


def _picker(matrix: torch.Tensor, n: int):
    """Row ``k`` of the ``(n, m)`` float64 ``matrix`` as a buffer of its own: a row of the identity times it."""
    pick = torch.eye(n, device=matrix.device, dtype=torch.float64)
    return lambda k: (pick[k : k + 1] @ matrix).view(-1)


def _chunk_logits(hidden, weight, bias, logits, start, end, pad_to=None):
    """The logits of rows ``start:end``, in the head's dtype; with ``pad_to``, padded to that many rows
    (``_rows_of``; the head's input is padded before its matmul)."""
    if logits is not None:
        return _rows_of(logits, start, end, pad_to)
    if weight is None:
        return _rows_of(hidden, start, end, pad_to)
    return F.linear(_rows_of(hidden, start, end, pad_to), weight, bias)


@dataclass(frozen=True)
class ChunkNote:
    """What the plan says of one chunked loss.

    Attributes:
        site: where it is (``"lm_head + cross_entropy"``), from ``LossSite.describe``.
        chunks: how many chunks of tokens.
        tokens, vocab: the loss's rows and classes.
        logits_bytes: one vocabulary-sized fp32 tensor of the unchunked loss.
        extra_flops: what chunking adds outside the plan's recompute time: the head's matmul again,
            in the backward (``note_for``).
        unchunked_peak: the least (or chosen) predicted peak without chunking, when it was planned.
    """

    site: str
    chunks: int
    tokens: int
    vocab: int
    logits_bytes: int
    extra_flops: int
    unchunked_peak: int | None = None


_NOTES: contextvars.ContextVar[tuple[ChunkNote, ...]] = contextvars.ContextVar("fxremat_chunk_notes", default=())


@contextlib.contextmanager
def noting(notes: tuple[ChunkNote, ...]):
    """Plans made inside the block describe these chunked losses (``Plan.chunked``)."""
    token = _NOTES.set(notes)
    try:
        yield
    finally:
        _NOTES.reset(token)


def current_notes() -> tuple[ChunkNote, ...]:
    """The chunked losses of the graph being planned (empty outside ``noting``)."""
    return _NOTES.get()


def note_for(site: LossSite, chunks: int, unchunked_peak: int | None = None) -> ChunkNote:
    """The ``ChunkNote`` of ``site`` cut into ``chunks``.

    With a head, the backward makes the logits again, a slice of the vocabulary at a time: the
    head's matmul once more (``extra_flops``). Without one there is nothing to make again.
    """
    where = f"{site.head.name} + cross_entropy" if site.head is not None else "cross_entropy"
    hidden = _shape(site.hidden)[-1] if site.head is not None else 0
    extra = 2 * site.tokens * hidden * site.vocab
    return ChunkNote(where, chunks, site.tokens, site.vocab, site.logits_bytes(), extra, unchunked_peak)
