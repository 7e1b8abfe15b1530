"""Run one fx node's op on its own, on real tensors shaped like its FakeTensor inputs.

``scratch.py`` (workspace an op allocates) and ``calibrate.py`` (time an op
takes) both run graph ops standalone: inputs are synthetic tensors of the
node's shapes, strides and dtypes, on its device, created and run outside
AOTAutograd's fake mode without moving the user's random generator. Nodes
with the same ``op_signature`` run once.

An op call a compiler makes that no graph of fxremat's holds (Inductor's post-grad
passes fold ``mm`` and ``add`` into ``addmm``) travels as an ``OpCall``: plain values,
picklable from a forked lowering, which ``node_of_call`` turns back into a node to run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.fx as fx

from .._torch_compat import FakeTensorMode, disable_current_modes, is_op_overload
from .opinfo import size_hint, strides_hint

__all__ = [
    "MAX_STANDALONE_BYTES",
    "OpCall",
    "TensorArg",
    "materialize",
    "node_of_call",
    "op_call",
    "op_signature",
    "standalone_call",
    "real_tensors",
]

# Running an op allocates its inputs for real; skip ops whose inputs and
# outputs together exceed this (1 GiB), so planning never risks an OOM itself.
MAX_STANDALONE_BYTES = 1 << 30


def materialize(val: torch.Tensor, stride: tuple[int, ...] | None = None) -> torch.Tensor:
    """A real tensor shaped like a FakeTensor ``val`` (sizes at their hints, same strides, dtype, device).

    ``stride``: other strides to lay it out with (a compiler's layout of the same value).
    Floating-point values are uniform in [0.1, 1) (positive: safe for log, sqrt,
    division); integers and bools are zeros (valid indices).
    """
    shape = [size_hint(s) for s in val.shape]
    strides = list(stride) if stride is not None else list(strides_hint(val))
    # Fill the backing storage, then view it: expanded (stride 0) tensors cannot be written.
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, strides)) if all(shape) else 0
    flat = torch.empty(extent, dtype=val.dtype, device=val.device)
    if val.dtype.is_floating_point or val.dtype.is_complex:
        flat.uniform_(0.1, 1.0)
    else:
        flat.zero_()
    return flat.as_strided(shape, strides)


def op_signature(node: fx.Node) -> tuple:
    """What makes two runs of ``node``'s op equal: the target, argument shapes, strides, dtypes and constants.

    Raises:
        Exception: from the size hint of an argument whose size has none.
    """

    def sig(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return ("T", tuple(size_hint(s) for s in v.shape), strides_hint(v), v.dtype)
            return ("V", repr(v))
        return ("C", repr(a))

    args = fx.node.map_aggregate(node.args, sig)
    kwargs = fx.node.map_aggregate(node.kwargs, sig)
    return (node.target, repr(args), repr(kwargs))


def _concrete(value, stride: tuple[int, ...] | None = None):
    """A node's value with tensors materialized and symbolic ints at their hints (never guarded: a graph
    with dynamic sizes stays dynamic), others as they are."""
    if isinstance(value, torch.Tensor):
        return materialize(value, stride)
    if isinstance(value, (list, tuple)):
        return type(value)(_concrete(v) for v in value)
    if isinstance(value, torch.SymInt):
        return size_hint(value)
    return value


def standalone_call(node: fx.Node, *, strides: dict[fx.Node, tuple[int, ...]] | None = None) -> Callable[[], object]:
    """A zero-argument callable running ``node``'s op on fresh real inputs (made now, once).

    Args:
        node: a ``call_function`` node whose target is callable (an op overload)
            and whose inputs carry ``meta["val"]``; call inside ``real_tensors()``.
        strides: input node -> the strides to lay that input out with instead of its own.

    Example:
        >>> with real_tensors():  # doctest: +SKIP
        ...     out = standalone_call(node)()
    """
    strides = strides or {}
    real = {a: _concrete(a.meta.get("val"), strides.get(a)) for a in node.all_input_nodes}
    args = fx.node.map_arg(node.args, lambda a: real[a])
    kwargs = fx.node.map_arg(node.kwargs, lambda a: real[a])
    target = node.target
    assert callable(target), f"{node.format_node()}: target is not callable"
    return lambda: target(*args, **kwargs)


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """Run ops on real tensors: outside the current fake mode, without autograd, and
    without moving the user's CPU random generator."""
    with disable_current_modes(), torch.random.fork_rng(devices=[]), torch.no_grad():
        yield


class TensorArg(NamedTuple):
    """A tensor argument of an ``OpCall``: its sizes, strides, dtype and device."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str


class OpCall(NamedTuple):
    """An op call in plain values: the op's qualified name (``"aten.addmm.default"``), its
    arguments with ``TensorArg`` for each tensor, and its keyword arguments as sorted pairs."""

    op: str
    args: tuple
    kwargs: tuple


# Constants an OpCall carries as they are (all pickle by value).
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def op_call(node: fx.Node, strides: tuple[tuple[int, ...], ...]) -> OpCall | None:
    """``node``'s op call with its tensor inputs laid out at ``strides`` (one tuple per tensor
    input, in ``all_input_nodes`` order), or None when it cannot be written in plain values
    (not an op overload, a symbolic size, an argument of another kind).
    """
    if node.op != "call_function" or not is_op_overload(node.target):
        return None
    tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    if len(tensors) != len(strides):
        return None
    at = dict(zip(tensors, strides))

    def plain(a):
        if isinstance(a, fx.Node):
            val = a.meta["val"] if a in at else None
            if not isinstance(val, torch.Tensor) or not all(isinstance(s, int) for s in val.shape):
                raise ValueError(a)
            return TensorArg(tuple(val.shape), tuple(at[a]), val.dtype, str(val.device))
        if isinstance(a, (list, tuple)):
            return tuple(plain(x) for x in a)
        if isinstance(a, _PLAIN):
            return a
        raise ValueError(a)

    try:
        args = plain(node.args)
        kwargs = tuple(sorted((k, plain(v)) for k, v in node.kwargs.items()))
    except ValueError:
        return None
    return OpCall(str(node.target), args, kwargs)


def node_of_call(call: OpCall) -> fx.Node | None:
    """A node of a graph of its own that runs ``call`` (its inputs: placeholders with fake values at
    the call's sizes and strides), for ``standalone_call``; None when the op is not found."""
    target: object = torch.ops
    for part in call.op.split("."):
        target = getattr(target, part, None)
        if target is None:
            return None
    if not is_op_overload(target):
        return None
    graph = fx.Graph()
    mode = FakeTensorMode()

    def build(a):
        if isinstance(a, TensorArg):
            ph = graph.placeholder(f"arg{len(graph.nodes)}")
            with mode:
                ph.meta["val"] = torch.empty_strided(a.shape, a.stride, dtype=a.dtype, device=a.device)
            return ph
        if isinstance(a, tuple):
            return [build(x) for x in a]
        return a

    args = tuple(build(a) for a in call.args)
    kwargs = {k: build(v) for k, v in call.kwargs}
    return graph.call_function(target, args, kwargs)
