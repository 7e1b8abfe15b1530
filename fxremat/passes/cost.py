"""Cost pass: one ``NodeCost`` record per fx node, from FakeTensor meta.

Bytes are counted per storage: a view or alias owns nothing and points at the
node whose storage it lives in. FLOPs come from ``torch.utils.flop_counter``'s
formulas where it has one, else one per element read (pointwise and reduction
ops). Time is a roofline ``max(flops / peak_flops, bytes_moved / bandwidth)``
plus a launch overhead for a named hardware profile.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils.flop_counter import flop_registry

from .._torch_compat import is_sym_node

__all__ = ["Hardware", "HARDWARE", "NodeCost", "annotate", "get_hardware", "module_path"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hardware:
    """Peak rates of a device for the roofline time estimate."""

    name: str
    peak_flops: float
    """FLOP/s for the dtype the model trains in (dense matmul)."""
    bandwidth: float
    """Bytes/s of main memory."""
    launch_seconds: float
    """Fixed cost of running one op."""


HARDWARE = {
    # This host, measured once by a microbenchmark and cached (passes/host.py).
    "cpu": None,
    # NVIDIA A100 SXM datasheet: 312 TFLOP/s bf16 dense, 2.0 TB/s HBM2e; ~5 us per kernel launch.
    "a100": Hardware("a100", 312e12, 2.0e12, 5e-6),
    # NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3.
    "h100": Hardware("h100", 989e12, 3.35e12, 5e-6),
    # NVIDIA H200 SXM datasheet: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e.
    "h200": Hardware("h200", 989e12, 4.8e12, 5e-6),
}


def get_hardware(name: str) -> Hardware:
    """The named profile; unknown names raise ValueError listing the valid ones."""
    if name not in HARDWARE:
        raise ValueError(f"hardware={name!r} is not a known profile; choose one of {sorted(HARDWARE)}")
    if name == "cpu":
        from .host import measure_cpu

        return Hardware("cpu", *measure_cpu())
    return HARDWARE[name]


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
        op: short op name ("aten.mm", "getitem", ...).
    """

    nbytes: int
    owner: fx.Node
    flops: int
    bytes_moved: int
    seconds: float
    module: str
    op: str


def _hint(x) -> int:
    return int(optimization_hint(x)) if isinstance(x, torch.SymInt) else int(x)


def _numel_bytes(t: torch.Tensor) -> int:
    return _hint(t.numel()) * t.element_size()


def _vals(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _vals(v)]
    return []


def _alias_source(node: fx.Node) -> fx.Node | None:
    """The input this node's output aliases, per the op schema, or None."""
    if node.op != "call_function":
        return None
    target = node.target
    if target is operator.getitem:
        parent = node.args[0]
        if isinstance(parent, fx.Node):
            return _alias_source(parent)
        return None
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return None
    # Views return Tensor(a) and in-place ops Tensor(a!): both live in input a's storage.
    alias = schema.returns[0].alias_info
    if alias is None:
        return None
    for arg, sarg in zip(node.args, schema.arguments):
        if sarg.alias_info is not None and sarg.alias_info.before_set & alias.before_set and isinstance(arg, fx.Node):
            return arg
    return None


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


def _flops(node: fx.Node, out_val) -> int:
    target = node.target
    packet = getattr(target, "_overloadpacket", None)
    args_vals = fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
    kwargs_vals = fx.node.map_arg(node.kwargs, lambda n: n.meta.get("val"))
    if packet in flop_registry:
        try:
            return _hint(flop_registry[packet](*args_vals, out_val=out_val, **kwargs_vals))
        except Exception as exc:  # a formula that rejects these args: fall back, but say so
            log.debug("flop formula for %s failed (%s); counting elements", packet, exc)
    name = getattr(packet, "__name__", "")
    if name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
        return _cpu_sdpa_flops(args_vals, backward=name.endswith("_backward"))
    if packet is None or _alias_source(node) is not None:
        return 0
    # Pointwise and reduction ops: one FLOP per element read (DESIGN.md, cost model).
    return sum(_hint(t.numel()) for t in _vals(args_vals))


def _cpu_sdpa_flops(args_vals, backward: bool) -> int:
    # CPU flash attention: QK^T and PV matmuls, 2*b*h*s_q*s_k*d each (as the CUDA
    # formulas in torch.utils.flop_counter); the backward does 2.5x the forward.
    if backward:
        q, k = args_vals[1], args_vals[2]
    else:
        q, k = args_vals[0], args_vals[1]
    b, h, s_q, d = (_hint(x) for x in q.shape)
    s_k = _hint(k.shape[-2])
    forward = 4 * b * h * s_q * s_k * d
    return int(forward * 2.5) if backward else forward


def annotate(gm: fx.GraphModule, hardware: Hardware) -> dict[fx.Node, NodeCost]:
    """Compute a NodeCost for every node of ``gm`` (placeholders cost nothing).

    Args:
        gm: a graph whose nodes carry FakeTensor ``meta["val"]`` (AOTAutograd's joint graph).
        hardware: the profile for time estimates.

    Returns:
        A side table from node to its cost record, in graph order.
    """
    costs: dict[fx.Node, NodeCost] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        op = _op_name(node)
        if node.op != "call_function" or is_sym_node(node):
            nbytes = sum(_numel_bytes(t) for t in _vals(val)) if node.op == "placeholder" else 0
            costs[node] = NodeCost(nbytes, node, 0, 0, 0.0, module_path(node), op)
            continue
        source = _alias_source(node)
        if source is not None and source in costs:
            owner = costs[source].owner
            costs[node] = NodeCost(0, owner, 0, 0, 0.0, module_path(node), op)
            continue
        tensors = _vals(val)
        multi = isinstance(val, (list, tuple))
        # A multi-output node allocates nothing itself; each getitem owns its element.
        nbytes = 0 if multi else sum(_numel_bytes(t) for t in tensors)
        flops = _flops(node, val)
        read = sum(_numel_bytes(t) for a in node.all_input_nodes for t in _vals(a.meta.get("val")))
        written = sum(_numel_bytes(t) for t in tensors)
        moved = 0 if node.target is operator.getitem else read + written
        seconds = 0.0 if node.target is operator.getitem else (
            max(flops / hardware.peak_flops, moved / hardware.bandwidth) + hardware.launch_seconds
        )
        costs[node] = NodeCost(nbytes, node, flops, moved, seconds, module_path(node), op)
    return costs


def _op_name(node: fx.Node) -> str:
    target = node.target
    if node.op != "call_function":
        return node.op
    if target is operator.getitem:
        return "getitem"
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        return f"{packet._qualified_op_name.replace('::', '.')}"
    return getattr(target, "__name__", str(target))


def total_flops(costs: dict[fx.Node, NodeCost]) -> int:
    """Sum of FLOPs of a cost table (for reports)."""
    return sum(c.flops for c in costs.values())

