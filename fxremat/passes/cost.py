"""Cost pass: one ``NodeCost`` record per fx node, from FakeTensor meta.

Bytes are counted per storage: a view or alias owns nothing and points at the
node whose storage it lives in. FLOPs come from ``torch.utils.flop_counter``'s
formulas where it has one, from this module's for grouped matmuls (experts of a
mixture of experts), else one per element read (pointwise and reduction ops).
Time is a roofline ``max(flops / peak_flops, bytes_moved / bandwidth)``
plus a launch overhead for a named hardware profile (and, on CPU, the page
faults of large fresh outputs); ``passes/calibrate.py`` can replace it by
times measured on the device. Under dynamic shapes bytes and FLOPs are also
kept as sympy expressions; the solver uses them evaluated at the size hints.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from .._torch_compat import is_op_overload, is_sym_node
from ..hardware import FRESH_OUTPUT_BYTES, Hardware
from .opinfo import alias_source, nbytes_hint, packet_name, qualified_op_name, size_hint, tensors_of

__all__ = ["NodeCost", "annotate", "compute_seconds", "module_path"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeCost:
    """What one fx node costs.

    Attributes:
        nbytes: bytes of the storage this node allocates (0 for views/aliases/non-tensors).
        owner: the node whose storage holds this node's output (itself when it allocates).
        flops: floating-point operations to compute it once.
        bytes_moved: bytes read plus bytes written.
        seconds: roofline estimate of its run time.
        module: module path it came from ("" when unknown).
        op: the op's qualified name (``opinfo.qualified_op_name``: "aten.mm", "getitem", ...).
        timed: ``seconds`` was measured on the device (``calibrate=True``), not estimated.
        sym_nbytes, sym_flops, sym_bytes_moved: under dynamic shapes, the same
            quantities as sympy expressions in the graph's size symbols (``s0``,
            ...); the int fields are these evaluated at the size hints. None
            when the node's sizes are all static.
    """

    nbytes: int
    owner: fx.Node
    flops: int
    bytes_moved: int
    seconds: float
    module: str
    op: str
    timed: bool = False
    sym_nbytes: sympy.Expr | None = None
    sym_flops: sympy.Expr | None = None
    sym_bytes_moved: sympy.Expr | None = None


def _expr(x) -> sympy.Expr:
    """A size as a sympy expression (a SymInt's expression in the graph's size symbols)."""
    return x.node.expr if isinstance(x, torch.SymInt) else sympy.Integer(int(x))


def _raw_bytes(t: torch.Tensor):
    """Bytes of ``t`` as an int, or a SymInt under dynamic shapes."""
    return t.numel() * t.element_size()


def _symbolic(tensors: list[torch.Tensor]) -> bool:
    return any(isinstance(d, torch.SymInt) for t in tensors for d in t.shape)


def module_path(node: fx.Node) -> str:
    """Dotted module path of the innermost module a node came from ("" if unknown)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _clean_path(path)


def _clean_path(path: str) -> str:
    # Dynamo writes sources like "L['self'].transformer.h[0].attn" or "L['m'].l1".
    if path.startswith("L["):
        end = path.find("]")
        path = path[end + 1 :].lstrip(".")
    return path.replace("[", ".").replace("]", "").replace("'", "")


def _flops(node: fx.Node, out_val):
    """FLOPs of ``node`` as an int, or a SymInt under dynamic shapes."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    args_vals = fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
    kwargs_vals = fx.node.map_arg(node.kwargs, lambda n: n.meta.get("val"))
    if packet in flop_registry:
        try:
            return flop_registry[packet](*args_vals, out_val=out_val, **kwargs_vals)
        except Exception as exc:  # a formula that rejects these args: fall back, but say so
            log.debug("flop formula for %s failed (%s); counting elements", packet, exc)
    name = getattr(packet, "__name__", "")
    if name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
        return _cpu_sdpa_flops(args_vals, backward=name.endswith("_backward"))
    grouped = _grouped_mm_flops(str(packet), args_vals)
    if grouped is not None:
        return grouped
    if packet is None or alias_source(node) is not None:
        return 0
    # Pointwise and reduction ops: one FLOP per element read (DESIGN.md, cost model).
    return sum(t.numel() for t in tensors_of(args_vals))


# Grouped matmuls (a mixture of experts' experts, each on its own rows): ``torch.utils.flop_counter``
# has no formula, and one FLOP per element read priced HF Mixtral's expert matmuls 20x too cheap: its
# no-budget plan recomputed them within the 2% time slack and measured 1.12x plain torch.compile's step.
# ``transformers.grouped_mm_fallback(input (S, K), weight (E, K, N), offs (E,))`` runs one ``mm`` per
# expert; its backward two. torch's ``_grouped_mm``: (S, K) x (E, K, N), or (E, M, K) x (E, K, N).
# Op -> (products, whether it loops over the groups in Python, one launch each).
_GROUPED_MM = {
    "transformers.grouped_mm_fallback": (1, True),
    "transformers.grouped_mm_fallback_backward": (2, True),
    "aten._grouped_mm": (1, False),
}


def _grouped_mm_flops(op: str, args_vals):
    """2 * rows * K * N per product of a grouped matmul ``op`` (``_GROUPED_MM``), or None for other ops."""
    products, _ = _GROUPED_MM.get(op, (0, False))
    if not products or len(args_vals) < 2:
        return None
    a, b = args_vals[0], args_vals[1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or b.dim() != 3 or a.dim() not in (2, 3):
        return None
    rows = a.numel() // a.shape[-1]
    return products * 2 * rows * b.shape[-2] * b.shape[-1]


def _launches(node: fx.Node, op: str) -> int:
    """Kernel launches of ``node`` (its op's qualified name ``op``): a grouped matmul that loops over its
    groups in Python (transformers' fallback) launches one ``mm`` per expert, two in its backward; 1 for
    every other op."""
    products, loops = _GROUPED_MM.get(op, (0, False))
    if not loops:
        return 1
    weight = node.args[1].meta.get("val") if len(node.args) > 1 and isinstance(node.args[1], fx.Node) else None
    return products * size_hint(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 3 else 1


def _cpu_sdpa_flops(args_vals, backward: bool):
    # CPU flash attention: QK^T and PV matmuls, 2*b*h*s_q*s_k*d each (as the CUDA
    # formulas in torch.utils.flop_counter); the backward does 2.5x the forward.
    if backward:
        q, k = args_vals[1], args_vals[2]
    else:
        q, k = args_vals[0], args_vals[1]
    b, h, s_q, d = q.shape
    s_k = k.shape[-2]
    forward = 4 * b * h * s_q * s_k * d
    return forward * 5 // 2 if backward else forward  # exact: forward is even


def annotate(gm: fx.GraphModule, hardware: Hardware | None) -> dict[fx.Node, NodeCost]:
    """Compute a NodeCost for every node of ``gm`` (placeholders cost nothing).

    Time is ``max(flops / peak_flops, bytes_moved / bandwidth) + launch_seconds``
    (fused attention at ``attention_flops``), plus the first touch of outputs of
    ``FRESH_OUTPUT_BYTES`` or more at ``fresh_bandwidth``; views cost
    ``view_seconds``, getitems nothing. Under dynamic shapes the records also
    keep bytes and FLOPs as sympy expressions (``sym_*``); the ints are those
    evaluated at the size hints.

    Args:
        gm: a graph whose nodes carry FakeTensor ``meta["val"]`` (AOTAutograd's joint graph).
        hardware: the profile for time estimates; None for bytes only (every ``seconds`` is 0).

    Returns:
        A side table from node to its cost record, in graph order.

    Example:
        >>> costs = annotate(joint, get_hardware("a100"))  # doctest: +SKIP
        >>> sum(c.seconds for c in costs.values())         # estimated seconds of the step
    """
    costs: dict[fx.Node, NodeCost] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        op = qualified_op_name(node)
        if node.op != "call_function" or is_sym_node(node):
            tensors = tensors_of(val) if node.op == "placeholder" else []
            nbytes = nbytes_hint(tensors)
            sym = sympy.Add(*(_expr(_raw_bytes(t)) for t in tensors)) if _symbolic(tensors) else None
            costs[node] = NodeCost(nbytes, node, 0, 0, 0.0, module_path(node), op, sym_nbytes=sym)
            continue
        source = alias_source(node)
        if source is not None and source in costs:
            owner = costs[source].owner
            seconds = 0.0 if node.target is operator.getitem or hardware is None else hardware.view_seconds
            costs[node] = NodeCost(0, owner, 0, 0, seconds, module_path(node), op)
            continue
        tensors = tensors_of(val)
        inputs = [t for a in node.all_input_nodes for t in tensors_of(a.meta.get("val"))]
        multi = isinstance(val, (list, tuple))
        getitem = node.target is operator.getitem
        # A multi-output node allocates nothing itself; each getitem owns its element.
        raw_nbytes = 0 if multi else sum(_raw_bytes(t) for t in tensors)
        raw_flops = _flops(node, val)
        raw_moved = 0 if getitem else sum(_raw_bytes(t) for t in inputs) + sum(_raw_bytes(t) for t in tensors)
        nbytes, flops, moved = size_hint(raw_nbytes), size_hint(raw_flops), size_hint(raw_moved)
        seconds = 0.0
        if not getitem and hardware is not None:
            rate = hardware.peak_flops
            if hardware.attention_flops and _is_attention(node):
                rate = hardware.attention_flops
            fresh = sum(b for b in (nbytes_hint(t) for t in tensors) if b >= FRESH_OUTPUT_BYTES)
            seconds = (
                max(flops / rate, moved / hardware.bandwidth)
                + hardware.launch_seconds * _launches(node, op)
                + fresh / hardware.fresh_bandwidth
            )
        sym = {}
        if _symbolic(tensors + inputs):
            sym = {"sym_nbytes": _expr(raw_nbytes), "sym_flops": _expr(raw_flops), "sym_bytes_moved": _expr(raw_moved)}
        costs[node] = NodeCost(nbytes, node, flops, moved, seconds, module_path(node), op, **sym)
    return costs


def compute_seconds(costs: dict[fx.Node, NodeCost], hardware: Hardware) -> float:
    """The roofline time of the ops in ``costs`` without their launch overheads: FLOPs and bytes moved
    at ``hardware``'s rates, what a program that fuses the ops into few kernels still has to do."""
    return sum(
        max(c.flops / hardware.peak_flops, c.bytes_moved / hardware.bandwidth)
        for node, c in costs.items()
        if node.op == "call_function"
    )


def _is_attention(node: fx.Node) -> bool:
    """A fused attention kernel (SDPA's flash, efficient or cuDNN variants, forward or backward)."""
    name = packet_name(node) if is_op_overload(node.target) else ""
    return "attention" in name and name.startswith("_")
