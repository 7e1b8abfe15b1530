"""Parameter gradients added into ``.grad`` as the backward makes them: the backward's rewrite.

A compiled backward returns every parameter's gradient at its end, and autograd
adds each into ``.grad`` only then, so all of them are alive at once at the end
of the backward. ``hand_over_gradients`` rewrites a planned backward so that it
takes each such parameter's ``.grad`` as one more input and adds the gradient
into it in place (``aten.add_``) right after the gradient's last use in the
program; the program returns None in the gradient's place. The add is an op of
the program like any other: Inductor fuses it into a kernel, and no call into
Python is made for it. ``fxremat/grads.py`` runs that version when a backward's
``.grad`` tensors exist, passing them after the backward's usual inputs in the
order of the indices handed over.

Each ``.grad`` input carries, in ``node.meta[GRAD_INPUT]``, the index of the
backward output it stands for, and each add, in ``node.meta[HAND_OVER]``, the
same index; ``handed_over`` finds the adds. The memory models
(``passes/simulate.py``, ``passes/inductor_memory.py``) count the ``.grad``
inputs as the caller's memory, so a gradient handed over is freed after its
add, where one returned is alive to the backward's end.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .invariants import storage_of

__all__ = [
    "GRAD_INPUT",
    "HAND_OVER",
    "HAND_OVER_SPEC",
    "SMALL_GRADIENTS_SHARE",
    "grad_inputs",
    "gradients_to_hand_over",
    "hand_over_gradients",
    "handed_over",
]

# The smallest gradients, together at most this share of the bytes of the gradients that could be
# handed over, are returned at the end instead: their adds would split Inductor's fused kernels
# for memory that does not matter. On a tiny HF GPT-2 (2 layers, hidden 64), its 17 biases and
# norm weights are 0.9% of the gradients' bytes.
SMALL_GRADIENTS_SHARE = 0.01

HAND_OVER = "fxremat_hand_over"
"""``node.meta`` key of an add into ``.grad``: the backward output index it hands over."""
GRAD_INPUT = "fxremat_grad_input"
"""``node.meta`` key of a ``.grad`` input of a handing backward: the backward output index it receives."""
HAND_OVER_SPEC = "fxremat_hand_over_spec"
"""``GraphModule.meta`` key of a planned backward: ``(parameter output indices, input edges)``, what
``fxremat/grads.py`` needs to build and run the program that hands their gradients over."""


def hand_over_gradients(bw: fx.GraphModule, indices: list[int]) -> tuple[int, ...]:
    """Add the gradients the backward returns at ``indices`` into ``.grad`` inputs as soon as they are made.

    A gradient is handed over only when its memory is its own: not a backward
    input's (a tangent passed through), and shared with no other output. The
    smallest of those, together at most ``SMALL_GRADIENTS_SHARE`` of their bytes
    (biases, norm weights), stay returned. For each gradient handed over, the
    program gains an input (after its others, in the order of the returned
    indices) standing for that parameter's ``.grad``, laid out contiguously like
    the gradient (``fxremat/grads.py`` lays it out as the real ``.grad`` before
    compiling), and returns None in the gradient's place.

    Args:
        bw: the planned backward program (rewritten in place).
        indices: positions of the backward's outputs that are parameters' gradients.

    Returns:
        The indices handed over, in order.
    """
    out = next(iter(bw.graph.find_nodes(op="output")))
    outs = list(out.args[0])
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    own = gradients_to_hand_over(bw, indices)
    at = list(bw.graph.find_nodes(op="placeholder"))[-1]
    handed = []
    for k in indices:
        if k not in own:
            continue
        g = outs[k]
        val = g.meta["val"]
        with bw.graph.inserting_after(at):
            grad = at = bw.graph.placeholder(f"grad_{k}")
        grad.meta["val"] = val.new_empty(val.shape)
        grad.meta[GRAD_INPUT] = k
        last = max((u for u in g.users if u is not out), key=order.__getitem__, default=g)
        with bw.graph.inserting_after(last):
            add = bw.graph.call_function(torch.ops.aten.add_.Tensor, (grad, g))
        add.meta["val"] = grad.meta["val"]
        add.meta[HAND_OVER] = k
        outs[k] = None
        handed.append(k)
    if handed:
        out.args = (type(out.args[0])(outs),)
        bw.recompile()
    return tuple(handed)


def gradients_to_hand_over(bw: fx.GraphModule, indices: list[int]) -> dict[int, int]:
    """The gradients ``hand_over_gradients`` hands over: output index -> bytes (symbolic under dynamic
    shapes); ``bw`` is not changed."""
    out = next(iter(bw.graph.find_nodes(op="output")))
    outs = list(out.args[0])
    passed_in = {storage_of(p) for p in bw.graph.find_nodes(op="placeholder")} - {None}
    sharing: dict[object, int] = {}
    for o in outs:
        if isinstance(o, fx.Node) and (key := storage_of(o)) is not None:
            sharing[key] = sharing.get(key, 0) + 1
    own: dict[int, int] = {}  # output index -> the gradient's bytes
    for k in indices:
        g = outs[k] if k < len(outs) else None
        if not isinstance(g, fx.Node) or g.op == "placeholder" or outs.count(g) > 1:
            continue
        val = g.meta.get("val")
        key = storage_of(g)
        if not isinstance(val, torch.Tensor) or key is None or key in passed_in or sharing.get(key, 0) > 1:
            continue
        own[k] = val.numel() * val.element_size()
    if all(isinstance(b, int) for b in own.values()):  # symbolic sizes: every gradient is handed over
        small, total = 0, sum(own.values())
        for k in sorted(own, key=lambda k: (own[k], k)):
            if small + own[k] > SMALL_GRADIENTS_SHARE * total:
                break
            small += own[k]
            del own[k]
    return own


def handed_over(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Each add into ``.grad`` of ``gm`` and the gradient it adds, in program order."""
    return {n: n.args[1] for n in gm.graph.nodes if HAND_OVER in n.meta}


def grad_inputs(gm: fx.GraphModule) -> list[fx.Node]:
    """The ``.grad`` inputs of a handing backward, in the order its caller passes them."""
    return [p for p in gm.graph.find_nodes(op="placeholder") if GRAD_INPUT in p.meta]
