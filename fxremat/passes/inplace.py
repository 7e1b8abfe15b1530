"""Where Inductor writes a kernel's output into a dying input buffer (in-place reuse).

Inductor's ``config.inplace_buffers`` lets a generated pointwise kernel
write its output into one of the buffers it reads, when that read is the
buffer's last use and the two have the same size and are accessed at the
same index (``Scheduler``'s ``decide_inplace_update`` and
``SchedulerNode.can_inplace`` in ``torch/_inductor/scheduler.py``;
``can_match_buffer_size`` in ``codegen/wrapper.py``). The backward may also
write into saved tensors AOTAutograd donates to it (a saved tensor that no
input, user output or gradient aliases: ``collect_fw_donated_buffer_idxs``).
Counting such an output as a new allocation overstates the peak by a whole
buffer: GPT-2's loss backward writes the logits-sized gradient into the
saved log-softmax.

This pass lists candidate (writer, buffer) pairs; the liveness replay takes
a pair only where the buffer really dies at the writer under the plan
(``solvers.schedule.liveness``). A candidate must pass every check below,
each stricter than or equal to Inductor's, because assuming a reuse that
does not happen breaks the budget while missing one only costs memory:

- the writer is a realized (not fused) pointwise value with its own storage,
  computed in a kernel Inductor generates;
- the buffer is a call result with its own storage (or, in a backward
  program, a saved-tensor input), of the same dtype and byte size;
- the writer's kernel reads it at the writer's own index: every value on the
  path from the buffer to the writer (through views and fused pointwise
  values) is contiguous with the writer's number of elements, so no
  broadcast, transpose or slice changes the index;
- every other kernel that reads the buffer in the writer's program is an
  ancestor of the writer, so no schedule Inductor picks can run it later.

Verified against Inductor's own decisions in ``tests/test_inplace.py``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .cost import NodeCost
from .fusion import POINTWISE_BODIES, in_generated_kernel, is_pointwise
from .opinfo import is_view, packet_name

__all__ = ["inplace_pairs"]


def inplace_pairs(
    graph: fx.Graph,
    costs: dict[fx.Node, NodeCost],
    fused: set[fx.Node],
    forward: set[fx.Node] | None = None,
    saved: set[fx.Node] | None = None,
) -> list[tuple[fx.Node, fx.Node]]:
    """(writer, buffer) node pairs where Inductor may write ``writer`` into ``buffer``'s storage.

    Args:
        graph: a forward, backward or joint graph in AOTAutograd's aten IR.
        costs: the cost pass's table (``owner`` and ``nbytes`` per node).
        fused: the fusion pass's result for the same graph.
        forward: for a joint graph, its forward nodes: a writer and the
            buffer's other readers are then compared within one program.
            None for a graph that is a single program.
        saved: placeholders of a backward program that hold saved tensors;
            AOTAutograd donates them to the backward unless an input, user
            output or gradient aliases them, which the caller checks (the
            liveness replay never reuses a user output or a gradient).

    Returns:
        Candidate pairs in graph order (writer first, then buffer). A buffer
        may be a placeholder: a saved tensor of a backward program.

    Example:
        >>> pairs = inplace_pairs(bw.graph, annotate(bw, hw), fused_nodes(bw.graph, costs))  # doctest: +SKIP
    """
    order = {n: i for i, n in enumerate(graph.nodes)}

    def program(n: fx.Node) -> bool:
        return forward is None or n in forward

    pairs: list[tuple[fx.Node, fx.Node]] = []
    for writer in graph.nodes:
        if not _writes_in_place_capable_kernel(writer, costs, fused):
            continue
        numel = _static_numel(writer)
        if numel < 0:
            continue
        for buffer in _read_buffers(writer, costs, fused, numel, saved or set()):
            if not _same_buffer_size(buffer, writer, costs):
                continue
            side = program(writer)
            readers = [k for k in _reading_kernels(buffer, costs, fused) if program(k) == side]
            if all(k is writer or _is_ancestor(k, writer, order) for k in readers):
                pairs.append((writer, buffer))
    return sorted(pairs, key=lambda p: (order[p[0]], order[p[1]]))


def _is_ancestor(node: fx.Node, of: fx.Node, order: dict[fx.Node, int]) -> bool:
    """``node`` is an input of ``of``, directly or transitively (nodes before ``node`` are not searched)."""
    stack, seen = list(of.all_input_nodes), set()
    while stack:
        v = stack.pop()
        if v is node:
            return True
        if v in seen or order[v] < order[node]:
            continue
        seen.add(v)
        stack.extend(v.all_input_nodes)
    return False


def _writes_in_place_capable_kernel(node: fx.Node, costs: dict[fx.Node, NodeCost], fused: set[fx.Node]) -> bool:
    """A realized pointwise value with its own contiguous storage, in a generated kernel."""
    return (
        is_pointwise(node)
        and packet_name(node) not in POINTWISE_BODIES
        and node not in fused
        and costs[node].owner is node
        and costs[node].nbytes > 0
        and in_generated_kernel(node)
        and _contiguous(node)
    )


def _read_buffers(
    writer: fx.Node, costs: dict[fx.Node, NodeCost], fused: set[fx.Node], numel: int, saved: set[fx.Node]
) -> list[fx.Node]:
    """Storage owners the writer's kernel reads at the writer's own index.

    Walks back from the writer through fused pointwise values and views; a
    path stops (no candidate) at a value that is not contiguous with
    ``numel`` elements, or at an index-loading body (``embedding``, ...).
    """
    found: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = list(writer.all_input_nodes)
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        if _static_numel(value) != numel or not _contiguous(value):
            continue
        if value.op == "call_function" and is_view(value, costs):
            stack.extend(value.all_input_nodes[:1])
        elif value in fused:
            if packet_name(value) not in POINTWISE_BODIES:
                stack.extend(value.all_input_nodes)
        elif costs[value].owner is value and costs[value].nbytes > 0:
            if value.op == "call_function" or value in saved:
                found.append(value)
    return found


def _reading_kernels(buffer: fx.Node, costs: dict[fx.Node, NodeCost], fused: set[fx.Node]) -> set[fx.Node]:
    """The nodes whose kernels read ``buffer``: its users, looking through views and fused values."""
    kernels: set[fx.Node] = set()
    stack = list(buffer.users)
    seen: set[fx.Node] = set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.op == "call_function" and (is_view(user, costs) or user in fused):
            stack.extend(user.users)
        else:
            kernels.add(user)
    return kernels


def _same_buffer_size(buffer: fx.Node, writer: fx.Node, costs: dict[fx.Node, NodeCost]) -> bool:
    vb, vw = buffer.meta.get("val"), writer.meta.get("val")
    return (
        isinstance(vb, torch.Tensor)
        and isinstance(vw, torch.Tensor)
        and vb.dtype == vw.dtype
        and costs[buffer].nbytes == costs[writer].nbytes
    )


def _static(val: torch.Tensor) -> bool:
    return not any(isinstance(x, torch.SymInt) for x in (*val.shape, *val.stride()))


def _static_numel(node: fx.Node) -> int:
    """Elements of a statically shaped tensor value; -1 for anything else (never a candidate)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not _static(val):
        return -1
    return int(val.numel())


def _contiguous(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and _static(val) and bool(val.is_contiguous())
