"""Parameter gradients handed over as the backward makes them: the backward's rewrite.

A compiled backward returns every parameter's gradient at its end, and autograd
adds each into ``.grad`` only then, so all of them are alive at once at the end
of the backward. ``hand_over_gradients`` rewrites a planned backward so that
each parameter's gradient is passed to a hand-over op right after its last use
in the program, and the program returns the op's empty marker in its place;
``fxremat/grads.py`` defines the op (what it does with the gradient at run
time) and the wrapper that gives autograd the gradients it kept.

Each hand-over node carries, in ``node.meta[HAND_OVER]``, the index of the
backward output it stands for; ``handed_over`` finds them, so the memory
models (``passes/simulate.py``, ``passes/inductor_memory.py``) can price the
gradients both ways: handed over (freed once added into an existing ``.grad``)
or kept until the end (``.grad`` did not exist, or autograd must see them).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .invariants import storage_of

__all__ = [
    "HAND_OVER",
    "HAND_OVER_SPEC",
    "SMALL_GRADIENTS_SHARE",
    "gradients_to_hand_over",
    "hand_over_gradients",
    "handed_over",
]

# The smallest gradients, together at most this share of the bytes of the gradients that could be
# handed over, are returned at the end instead. Each hand-over is a call into Python (about 9 us)
# and Inductor fuses no kernel across it: on a tiny HF GPT-2 (2 layers, hidden 64) handing over all
# 28 gradients made the backward 21 kernels instead of 12 and the step 1.35x plain torch.compile's.
# Its 17 biases and norm weights are 0.9% of the gradients' bytes.
SMALL_GRADIENTS_SHARE = 0.01

HAND_OVER = "fxremat_hand_over"
"""``node.meta`` key of a hand-over node: the backward output index it hands over."""
HAND_OVER_SPEC = "fxremat_hand_over_spec"
"""``GraphModule.meta`` key of a planned backward: ``(parameter output indices, graph inputs)``, what
``hand_over_gradients`` needs to build the program that hands their gradients over."""


def hand_over_gradients(bw: fx.GraphModule, indices: list[int], inputs: int, op) -> tuple[int, ...]:
    """Pass the gradients the backward returns at ``indices`` to ``op`` as soon as they are made.

    A gradient is handed over only when its memory is its own: not a backward
    input's (a tangent passed through), and shared with no other output, since
    the op may make it the parameter's ``.grad``. The smallest of those, together
    at most ``SMALL_GRADIENTS_SHARE`` of their bytes (biases, norm weights), stay
    returned: handing them over costs more time than the memory is worth.

    Args:
        bw: the planned backward program (rewritten in place).
        indices: positions of the backward's outputs that are parameters' gradients.
        inputs: how many inputs the graph has (the backward returns one gradient per input).
        op: the hand-over op, called as ``op(gradient, index, inputs)``; returns an empty tensor.

    Returns:
        The indices handed over, in order.
    """
    out = next(iter(bw.graph.find_nodes(op="output")))
    outs = list(out.args[0])
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    own = gradients_to_hand_over(bw, indices)
    handed = []
    for k in indices:
        if k not in own:
            continue
        g = outs[k]
        val = g.meta["val"]
        last = max((u for u in g.users if u is not out), key=order.__getitem__, default=g)
        with bw.graph.inserting_after(last):
            marker = bw.graph.call_function(op, (g, k, inputs))
        marker.meta["val"] = val.new_empty(0)
        marker.meta[HAND_OVER] = k
        outs[k] = marker
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
    """Each hand-over node of ``gm`` and the gradient it hands over, in program order."""
    return {n: n.args[0] for n in gm.graph.nodes if HAND_OVER in n.meta}
