"""Facts about an fx node's op and value: names, view and pointwise tests, sizes.

Every pass that asks "what op is this", "does it own its storage" or "how many
elements at the size hints" asks here, so the answers cannot drift apart.
Under dynamic shapes sizes are ``torch.SymInt``; the ``*_hint`` functions
evaluate them at the size hints the graph was traced with.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint

from .._torch_compat import is_op_overload, op_schema

if TYPE_CHECKING:
    from .cost import NodeCost

__all__ = [
    "size_hint",
    "strides_hint",
    "tensors_of",
    "nbytes_hint",
    "numel_hint",
    "qualified_op_name",
    "packet_name",
    "is_op_call",
    "is_tagged_pointwise",
    "alias_source",
    "is_view",
]


def size_hint(x) -> int:
    """A size as an int: a ``SymInt`` evaluated at its hint, anything else through ``int``.

    Example:
        >>> size_hint(3)
        3
    """
    return int(optimization_hint(x)) if isinstance(x, torch.SymInt) else int(x)


def strides_hint(t: torch.Tensor) -> tuple[int, ...]:
    """A tensor's strides as ints, symbolic ones at their hints (read without a guard)."""
    return tuple(size_hint(s) for s in t.stride())


def tensors_of(value) -> list[torch.Tensor]:
    """The tensors in a node's value (a tensor, or nested lists and tuples of them), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


def nbytes_hint(value) -> int:
    """Bytes of the elements of every tensor in ``value`` at the size hints (0 for non-tensors)."""
    return sum(size_hint(t.numel()) * t.element_size() for t in tensors_of(value))


def numel_hint(node: fx.Node) -> int:
    """Elements of ``node``'s tensor value at the size hints; 0 when its value is not a tensor."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    return size_hint(val.numel())


def qualified_op_name(node: fx.Node) -> str:
    """The op's namespaced name as reports show it.

    Returns:
        ``"aten.mm"`` for an op overload (namespace and packet, no overload),
        ``"getitem"``, a Python callable's ``__name__``, or the node kind
        (``"placeholder"``, ``"output"``) for nodes that call nothing.
    """
    target = node.target
    if node.op != "call_function":
        return node.op
    if target is operator.getitem:
        return "getitem"
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return str(packet)  # "aten.mm": the packet's qualified name, "::" written "."
    return getattr(target, "__name__", str(target))


def packet_name(node: fx.Node) -> str:
    """The op's bare name, as Inductor's tables and our op lists spell it.

    Returns:
        ``"mm"`` for ``aten.mm.default`` (its overload packet's ``__name__``);
        ``str(target)`` for anything that is not an op overload.
    """
    target = node.target
    return getattr(getattr(target, "overloadpacket", None), "__name__", str(target))


def is_op_call(node: fx.Node) -> bool:
    """A ``call_function`` node whose target is an aten/prims op overload (not getitem, not Python)."""
    return node.op == "call_function" and is_op_overload(node.target)


def is_tagged_pointwise(node: fx.Node) -> bool:
    """An op overload that torch tags ``pointwise`` (elementwise: each output element from the same index)."""
    target = node.target
    return node.op == "call_function" and is_op_overload(target) and torch.Tag.pointwise in target.tags


def alias_source(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node``'s output lives in, per the op schema; None when it allocates.

    Views return ``Tensor(a)`` and in-place ops ``Tensor(a!)``: both live in input
    ``a``'s storage. A getitem aliases whatever its producer aliases.
    """
    if node.op != "call_function":
        return None
    target = node.target
    if target is operator.getitem:
        parent = node.args[0]
        if isinstance(parent, fx.Node):
            return alias_source(parent)
        return None
    schema = op_schema(target)
    if schema is None or not schema.returns:
        return None
    alias = schema.returns[0].alias_info
    if alias is None:
        return None
    if not alias.before_set and str(schema.returns[0].type).startswith("List"):
        # split/unbind/chunk return Tensor(a)[]: Python sees the list's alias set
        # empty, but every element is a view of the one input that carries an alias.
        viewed = [arg for arg, sarg in zip(node.args, schema.arguments) if sarg.alias_info is not None]
        return viewed[0] if len(viewed) == 1 and isinstance(viewed[0], fx.Node) else None
    for arg, sarg in zip(node.args, schema.arguments):
        if sarg.alias_info is not None and sarg.alias_info.before_set & alias.before_set and isinstance(arg, fx.Node):
            return arg
    return None


def is_view(node: fx.Node, costs: dict[fx.Node, NodeCost]) -> bool:
    """A call whose output lives in another node's storage (a view, alias or in-place result).

    Args:
        node: a node of the graph ``costs`` was computed for.
        costs: the cost pass's table (``owner`` and ``nbytes`` per node).
    """
    return node.op == "call_function" and costs[node].owner is not node and costs[node].nbytes == 0
