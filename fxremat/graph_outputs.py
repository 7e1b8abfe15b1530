"""What a Dynamo graph returns, read from its example values, and the least any plan of it must hold.

Before any plan is made, the outputs of Dynamo's graph already bound what planning can
reach: the largest storage the graph allocates and returns is alive when its forward
returns, under every plan. ``steps.py`` plans the least-memory plan at once where the
budget is below it, and ``chunking.py`` does not plan the loss whole first there.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ._torch_compat import StorageWeakRef
from .options import Options

__all__ = ["output_values", "output_bytes", "allocated_output_bytes", "returns_loss", "out_of_reach_at_once"]


def output_values(gm: fx.GraphModule) -> list:
    """Dynamo's example values of the graph's outputs."""
    nodes: list[fx.Node] = []
    for out in gm.graph.find_nodes(op="output"):
        fx.node.map_arg(out.args, nodes.append)
    return [n.meta.get("example_value") for n in nodes]


def output_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the graph's outputs, from Dynamo's example values (an upper bound: aliases counted apiece)."""
    return sum(v.untyped_storage().nbytes() for v in output_values(gm) if isinstance(v, torch.Tensor))


def allocated_output_bytes(gm: fx.GraphModule) -> int:
    """The largest storage the graph allocates and returns (an output, or the tensor an output views, but
    no input's), from Dynamo's example values: every plan's forward holds it when it returns, so none
    peaks below it. 0 where sizes are symbolic."""
    inputs = {
        StorageWeakRef(v.untyped_storage())
        for v in (n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder"))
        if isinstance(v, torch.Tensor)
    }
    sizes = [
        v.untyped_storage().nbytes()
        for v in output_values(gm)
        if isinstance(v, torch.Tensor) and StorageWeakRef(v.untyped_storage()) not in inputs
    ]
    return max((n for n in sizes if isinstance(n, int)), default=0)


def returns_loss(gm: fx.GraphModule) -> bool:
    """Whether one of the graph's outputs is a differentiable scalar (its loss), from Dynamo's example values."""
    return any(
        isinstance(v, torch.Tensor) and v.requires_grad and v.is_floating_point() and _numel(v) == 1
        for v in output_values(gm)
    )


def out_of_reach_at_once(options: Options, floor: int) -> bool:
    """Whether the least plan is planned at once: ``on_infeasible="min"`` and a budget (less the reserve)
    below ``floor``, an output the graph allocates (``allocated_output_bytes``), which no plan can fit under."""
    return options.on_infeasible == "min" and options.budget is not None and options.budget - options.reserve < floor


def _numel(v: torch.Tensor) -> int:
    """Elements of ``v``; 0 where its size is symbolic (no guard on it)."""
    n = v.numel()
    return n if isinstance(n, int) else 0
