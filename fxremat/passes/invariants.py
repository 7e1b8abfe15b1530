"""Checks a planned forward/backward pair must pass before it runs.

A plan that breaks one of these would compute a wrong gradient without any
error, so the planner checks the real programs (not the plain problem) and
refuses to hand them on.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["PlanInvariantError", "check_saved_aliases", "storage_of", "outputs_of"]


class PlanInvariantError(RuntimeError):
    """A planned program pair breaks an invariant the backward relies on (a bug in fxremat)."""


def storage_of(node) -> StorageWeakRef | None:
    """The storage of a node's value (fake tensors share one for views), or None for non-tensors."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.layout != torch.strided:
        return None
    return StorageWeakRef(val.untyped_storage())


def outputs_of(gm: fx.GraphModule) -> list:
    """The values a program returns, in order."""
    return list(next(iter(gm.graph.find_nodes(op="output"))).args[0])


def check_saved_aliases(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Raise when two saved tensors that the backward may overwrite share a storage.

    AOTAutograd marks as *donated* every saved tensor whose storage no forward
    input, user output or returned gradient shares, and Inductor may then write
    into it at what it sees as its last use. It does not look for aliasing
    between saved tensors, so with a value and a view of it both saved, a later
    read of the other one sees overwritten memory. ``solvers.schedule.close``
    keeps one value per storage; this is the check on the programs that run.

    Args:
        fw: the planned forward; its outputs are the user outputs, then the saved values.
        bw: the planned backward; its outputs are the gradients.
        num_fwd_outputs: how many forward outputs the user sees.

    Raises:
        PlanInvariantError: naming the saved nodes that share a storage.
    """
    outputs = outputs_of(fw)
    undonated = {
        s
        for s in map(
            storage_of, list(fw.graph.find_nodes(op="placeholder")) + outputs[:num_fwd_outputs] + outputs_of(bw)
        )
        if s is not None
    }
    groups: dict[StorageWeakRef, list[str]] = {}
    for node in outputs[num_fwd_outputs:]:
        s = storage_of(node)
        if s is not None and s not in undonated:
            names = groups.setdefault(s, [])
            if node.name not in names:
                names.append(node.name)
    shared = [names for names in groups.values() if len(names) > 1]
    if shared:
        listed = "; ".join(", ".join(names) for names in shared)
        raise PlanInvariantError(
            f"the plan saves aliases of one storage for the backward ({listed}); the backward may overwrite "
            "one of them in place while the other is still to be read. This is a bug in fxremat; please report it"
        )
