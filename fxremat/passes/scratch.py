"""Scratch pass: bytes an op allocates inside itself beyond its outputs.

Some kernels allocate workspace that never appears in the graph: CPU
convolution's im2col columns, dropout's float noise before the mask, cuBLAS
and cuDNN workspaces. The liveness simulation adds each node's scratch to the
live bytes while the node runs, so predicted peaks match measured ones.

Scratch is measured, not guessed: each distinct (op, argument shapes, dtypes,
constants) of the graph runs once on real tensors of the graph's device,
under the allocator's bookkeeping (the profiler's allocation events on CPU,
``max_memory_allocated`` on CUDA). Graphs on the meta device, or with ops
that cannot run on synthetic inputs, get 0 for those nodes.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint

from .._torch_compat import EventType, disable_current_modes

__all__ = ["measure_scratch", "MAX_CALIBRATION_BYTES"]

log = logging.getLogger(__name__)

# Calibration allocates each op's inputs for real; skip ops whose inputs and
# outputs together exceed this (1 GiB), so planning never risks an OOM itself.
MAX_CALIBRATION_BYTES = 1 << 30


def _hint(x) -> int:
    return int(optimization_hint(x)) if isinstance(x, torch.SymInt) else int(x)


def _materialize(val, device_override=None):
    """A real tensor shaped like a FakeTensor ``val`` (zeros for ints and bools: valid indices)."""
    shape = [_hint(s) for s in val.shape]
    stride = [_hint(s) for s in val.stride()]
    device = device_override or val.device
    # Fill the backing storage, then view it: expanded (stride 0) tensors cannot be written.
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
    flat = torch.empty(extent, dtype=val.dtype, device=device)
    if val.dtype.is_floating_point or val.dtype.is_complex:
        flat.uniform_(0.1, 1.0)  # positive: safe for log, sqrt, division
    else:
        flat.zero_()
    return flat.as_strided(shape, stride)


def _signature(node: fx.Node) -> tuple:
    def sig(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return ("T", tuple(_hint(s) for s in v.shape), tuple(_hint(s) for s in v.stride()), v.dtype)
            return ("V", repr(v))
        return ("C", repr(a))

    args = fx.node.map_aggregate(node.args, sig)
    kwargs = fx.node.map_aggregate(node.kwargs, sig)
    return (node.target, repr(args), repr(kwargs))


def _nbytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return _hint(val.numel()) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_nbytes(v) for v in val)
    return 0


def _cpu_peak(fn) -> tuple[int, object]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.typed[0] == EventType.Allocation:
            events.append((e.start_time_ns, e.typed[1].alloc_size))
        stack.extend(e.children)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak, out


def _cuda_peak(fn, device) -> tuple[int, object]:
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before, out


def measure_scratch(nodes: list[fx.Node]) -> dict[fx.Node, int]:
    """Scratch bytes of each call_function node, measured once per distinct signature.

    Args:
        nodes: fx nodes with FakeTensor ``meta["val"]``.

    Returns:
        node -> bytes allocated while it runs beyond its outputs (0 where unknown).
    """
    cache: dict[tuple, int] = {}
    result: dict[fx.Node, int] = {}
    # Real tensors (outside AOTAutograd's fake mode); random ops must not move the user's RNG.
    with disable_current_modes(), torch.random.fork_rng(devices=[]), torch.no_grad():
        for node in nodes:
            if node.op != "call_function" or node.target is operator.getitem or not isinstance(node.target, torch._ops.OpOverload):
                continue
            val = node.meta.get("val")
            inputs = [a.meta.get("val") for a in node.all_input_nodes]
            tensors = [v for v in inputs if isinstance(v, torch.Tensor)]
            devices = {t.device.type for t in tensors}
            if not tensors or "meta" in devices or len(devices) > 1:
                continue
            if _nbytes(val) + sum(_nbytes(t) for t in tensors) > MAX_CALIBRATION_BYTES:
                continue
            key = _signature(node)
            if key not in cache:
                cache[key] = _run_one(node, val)
            result[node] = cache[key]
    return result


def _run_one(node: fx.Node, val) -> int:
    try:
        real: dict[fx.Node, object] = {}
        for a in node.all_input_nodes:
            v = a.meta.get("val")
            real[a] = _materialize(v) if isinstance(v, torch.Tensor) else v
        args = fx.node.map_arg(node.args, lambda a: real[a])
        kwargs = fx.node.map_arg(node.kwargs, lambda a: real[a])
        device = next((t.device for t in real.values() if isinstance(t, torch.Tensor)), torch.device("cpu"))
        if device.type == "cuda":
            peak, out = _cuda_peak(lambda: node.target(*args, **kwargs), device)
        else:
            peak, out = _cpu_peak(lambda: node.target(*args, **kwargs))
    except Exception as exc:  # an op that rejects synthetic inputs: no scratch known, say so
        log.debug("scratch of %s not measured (%s: %s)", node.target, type(exc).__name__, exc)
        return 0
    # The simulation allocates a single tensor output at the node itself, but the
    # elements of a tuple output at the getitems that follow: count those as scratch
    # of the node, so the moment the op runs carries its whole peak.
    schema = getattr(node.target, "_schema", None)
    aliased = schema is not None and schema.returns and schema.returns[0].alias_info is not None
    produced = 0 if aliased or not isinstance(out, torch.Tensor) else _nbytes(out)
    return max(0, peak - produced)
