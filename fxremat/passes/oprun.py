"""Run one fx node's op on its own, on real tensors shaped like its FakeTensor inputs.

``scratch.py`` (workspace an op allocates) and ``calibrate.py`` (time an op
takes) both run graph ops standalone: inputs are synthetic tensors of the
node's shapes, strides and dtypes, on its device, created and run outside
AOTAutograd's fake mode without moving the user's random generator. Nodes
with the same ``op_signature`` run once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.fx as fx

from .._torch_compat import disable_current_modes
from .opinfo import size_hint

__all__ = ["MAX_STANDALONE_BYTES", "materialize", "op_signature", "standalone_call", "real_tensors"]

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
    strides = list(stride) if stride is not None else [size_hint(s) for s in val.stride()]
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
                return ("T", tuple(size_hint(s) for s in v.shape), tuple(size_hint(s) for s in v.stride()), v.dtype)
            return ("V", repr(v))
        return ("C", repr(a))

    args = fx.node.map_aggregate(node.args, sig)
    kwargs = fx.node.map_aggregate(node.kwargs, sig)
    return (node.target, repr(args), repr(kwargs))


def _concrete(value, keep_symints: bool, stride: tuple[int, ...] | None = None):
    """A node's value with tensors materialized and symbolic ints at their hints (or kept), others as they are."""
    if isinstance(value, torch.Tensor):
        return materialize(value, stride)
    if isinstance(value, (list, tuple)):
        return type(value)(_concrete(v, keep_symints) for v in value)
    if isinstance(value, torch.SymInt) and not keep_symints:
        return size_hint(value)
    return value


def standalone_call(
    node: fx.Node, *, keep_symints: bool = False, strides: dict[fx.Node, tuple[int, ...]] | None = None
) -> Callable[[], object]:
    """A zero-argument callable running ``node``'s op on fresh real inputs (made now, once).

    Args:
        node: a ``call_function`` node whose target is callable (an op overload)
            and whose inputs carry ``meta["val"]``; call inside ``real_tensors()``.
        keep_symints: pass symbolic-int arguments to the op as they are instead of
            at their hints; the op then guards each to its current value, which
            specializes the graph's sizes (one compile per size under ``dynamic=True``).
        strides: input node -> the strides to lay that input out with instead of its own.

    Example:
        >>> with real_tensors():  # doctest: +SKIP
        ...     out = standalone_call(node)()
    """
    strides = strides or {}
    real = {a: _concrete(a.meta.get("val"), keep_symints, strides.get(a)) for a in node.all_input_nodes}
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
