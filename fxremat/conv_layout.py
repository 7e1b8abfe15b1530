"""Whether a graph's convolutions run channels-last: Inductor's layout optimisation, chosen per graph.

Inductor lays out every 2-d convolution's input and weight channels-last when a
graph has one (always on CPU with oneDNN). What that costs and saves in a
training step, measured on CPU with fxremat's planned programs:

- saved: oneDNN reorders a contiguous activation for every convolution, forward
  and backward; channels-last activations need none;
- paid: each weight is copied channels-last in the forward and again in the
  backward, and its gradient comes back channels-last, so autograd copies it
  into ``.grad``'s layout: three copies of the weights a step, and one weight's
  worth more memory at the backward's end.

So it pays where the convolutions' activations outweigh their weights.
Grouped convolutions' (depthwise) activations are not counted (Inductor's own
measurements, on GPU, have them slower channels-last); their weights are, since
they are copied all the same. On this CPU depthwise convolutions do gain from
it, yet counting them separates the measured models no better (docs/CONCEPTS.md:
EfficientNet-B0 at 0.57 gains, ConvNeXt at 0.40 and 1.51 does not): the rule
misses where the two costs need a time model. Measured (fxremat,
no budget, steps alternating with plain ``torch.compile``'s, which has it on, in
one process; activation bytes: the input and output of every ungrouped
convolution; weights once):

| model | activations / weights | on | off |
|---|---:|---:|---:|
| ``benchmarks/compare.py`` CNN, batch 16 | 29.6 | 0.96x, 70.5 MB | 1.35x, 68.8 MB |
| the same CNN, batch 2 | 3.7 | 0.99x, 9.7 MB | 1.17x, 8.5 MB |
| the same CNN, widths 32-256, 32 px, batch 8 | 1.84 | 1.02x, 24.1 MB | 1.22x, 19.7 MB |
| timm convnext_atto, batch 8, 64 px | 1.28 | 1.07x | 1.01x, 18.7 MB both |
| timm resnet18, batch 8, 64 px | 0.27 | 1.12x, 48.9 MB | 0.84x, 30.0 MB |

``CHANNELS_LAST_FROM`` sits between the ratios where it lost and won (docs/CONCEPTS.md).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .passes.invariants import outputs_of

__all__ = ["CHANNELS_LAST_FROM", "channels_last_pays", "convolution_bytes"]

CHANNELS_LAST_FROM = 1.5
"""Activation bytes (ungrouped convolutions) per weight byte from which channels-last pays."""

_CONVOLUTIONS = (torch.conv2d, torch.nn.functional.conv2d, torch.ops.aten.convolution.default)


def _value(node: object) -> torch.Tensor | None:
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("example_value", node.meta.get("val"))
    return val if isinstance(val, torch.Tensor) else None


def _nbytes(t: torch.Tensor) -> int:
    numel = t.numel()
    if not isinstance(numel, int):
        raise _Symbolic
    return numel * t.element_size()


class _Symbolic(Exception):
    """A size is symbolic: the graph's bytes are not known."""


def _groups(node: fx.Node) -> int:
    """A convolution node's ``groups``: the last positional argument (``conv2d``'s 7th, ``convolution``'s 9th)."""
    if node.op == "call_module":
        owner = node.graph.owning_module
        return int(getattr(owner.get_submodule(str(node.target)), "groups", 1)) if owner is not None else 1
    at = 8 if node.target is torch.ops.aten.convolution.default else 6
    groups = node.args[at] if len(node.args) > at else node.kwargs.get("groups", 1)
    return groups if isinstance(groups, int) else 1


def convolution_bytes(gm: fx.GraphModule) -> tuple[int, int]:
    """(bytes of the ungrouped 2-d convolutions' inputs and outputs, bytes of all their weights, each weight
    once) in ``gm``, a graph as Dynamo hands it to a backend (or an aten graph)."""
    activations, weights = 0, {}
    for node in gm.graph.nodes:
        weight: object = None
        if node.op == "call_function" and node.target in _CONVOLUTIONS:
            weight = _value(node.args[1]) if len(node.args) > 1 else _value(node.kwargs.get("weight"))
            key: object = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        elif node.op == "call_module" and isinstance(module := gm.get_submodule(str(node.target)), torch.nn.Conv2d):
            weight, key = module.weight, node.target
        else:
            continue
        given, made = _value(node.args[0]) if node.args else None, _value(node)
        if not isinstance(weight, torch.Tensor) or given is None or made is None or made.dim() != 4:
            continue
        if _groups(node) == 1:
            activations += _nbytes(given) + _nbytes(made)
        weights[key] = _nbytes(weight)
    return activations, sum(weights.values())


def channels_last_pays(gm: fx.GraphModule) -> bool | None:
    """Whether Inductor's layout optimisation pays for ``gm``'s training step; None without 2-d convolutions
    (nothing to lay out). With symbolic sizes, False: the bytes are not known; when ``gm`` returns a
    feature map, False: the step is not predicted right with it yet."""
    try:
        activations, weights = convolution_bytes(gm)
    except _Symbolic:
        return False
    if weights == 0:
        return None
    if _returns_images(gm):
        # Not predicted right yet: three convolutions returning their 8 x 32 x 32 x 32 output
        # measured 6.82 MB against 4.76 MB predicted with it on (docs/CONCEPTS.md).
        return False
    return activations >= CHANNELS_LAST_FROM * weights


def _returns_images(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` returns a 4-d tensor to its caller (a feature map, not a loss or logits)."""
    return any((val := _value(v)) is not None and val.dim() == 4 for v in outputs_of(gm))
